"""What every part of a checkpoint shares: the layout and item names, the format number, CheckpointError, paths
and the logger."""
from __future__ import annotations

import logging
import os
from typing import Any

from etils import epath

PyTree = Any
log = logging.getLogger("tformer_jax.checkpoint")   # one logger for the package

STATE, DATA, META, MANIFEST = "state", "data", "meta", "manifest"
CHECKPOINT_DIR = "checkpoints"
FORMAT = 1               # of the manifest and the "_checkpoint" record in `meta`
_RECORD = "_checkpoint"  # reserved key in the saved `meta` (stripped on restore)
_MAX_LISTED = 20         # mismatching tensors listed in a CheckpointError


class CheckpointError(RuntimeError):
  """A checkpoint that cannot be used or written: missing, unreadable, damaged, incompatible with the
  target, or a save that failed. The message is one line (a shape mismatch lists the tensors)."""


class _Damaged(Exception):
  """A step that reads but is not what was saved (a missing item, a checksum mismatch)."""


def _path(p: str | os.PathLike) -> epath.Path:
  """An absolute local path, or a cloud path (gs://...) as given."""
  s = os.fspath(p)
  return epath.Path(s if "://" in s else os.path.abspath(s))


def _is_local(p: epath.Path) -> bool:
  return "://" not in os.fspath(p)


def _path_str(keys: tuple[str, ...]) -> str:
  return "/".join(keys) or "<root>"
