"""One run per workdir, and nothing in it changed by a command that does not belong there.

`WorkdirLock(path).acquire()` takes `WORKDIR/.lock` before anything else is written: an advisory
`fcntl.flock` on the file (the kernel drops it when the holder dies, even by kill -9) plus the holder's
pid, host, start time and command in the file, for the message. A second run stops at once with one
line naming the holder. A lock file left by a process that is gone is taken over with a warning.
Multi-process runs: process 0 holds the lock for the run.

`check_owned(workdir)` refuses, in one line, an existing directory that holds files but nothing of a
run's (`config.json` with a model, `checkpoints/`, `metrics.jsonl`, the lock): a user's own folder is never
written into, nor a model tformer-convert --from-hf wrote (train from it with train.init_from).
`check_architecture(workdir, cfg)` compares the architecture of the config about to run with the one already
saved in `WORKDIR/config.json` (when the workdir has checkpoints): a difference is a one-line ConfigError listing
the fields, and the saved config is left untouched.
"""
from __future__ import annotations

import datetime
import fcntl
import json
import logging
import os
import pathlib
import shutil
import socket
import sys
from typing import Any

from tformer_jax import config as config_lib

log = logging.getLogger("tformer_jax")
LOCK_NAME = ".lock"
CONVERTED_MARKER = "tformer_convert.json"     # tformer-convert --from-hf's workdir (cli/convert.py)


class WorkdirBusy(config_lib.ConfigError):
  """Another run holds this workdir."""


class WorkdirLock:
  def __init__(self, workdir: str | os.PathLike):
    self.path = pathlib.Path(workdir) / LOCK_NAME
    self._fd: int | None = None

  def acquire(self) -> WorkdirLock:
    try:
      self.path.parent.mkdir(parents=True, exist_ok=True)
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
      raise config_lib.ConfigError(f"workdir: {self.path.parent} is not writable ({e.strerror or e})") from None
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = _describe(_read(fd))
      os.close(fd)
      raise WorkdirBusy(f"workdir: {self.path.parent} is in use by {holder}; wait for it to finish, "
                        "or use another --workdir") from None
    old = _read(fd)
    if old:  # the lock was free, so its last holder is gone
      log.warning("workdir: taking over the lock left by %s (not running any more)", _describe(old))
    info = {"pid": os.getpid(), "host": socket.gethostname(),
            "started": datetime.datetime.now().isoformat(timespec="seconds"), "argv": sys.argv}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(info).encode(), 0)
    os.fsync(fd)
    self._fd = fd
    return self

  def release(self) -> None:
    if self._fd is None:
      return
    try:
      os.ftruncate(self._fd, 0)   # an empty file: released cleanly
      fcntl.flock(self._fd, fcntl.LOCK_UN)
    finally:
      os.close(self._fd)
      self._fd = None

  def __enter__(self) -> WorkdirLock:
    return self.acquire()

  def __exit__(self, *exc: Any) -> None:
    self.release()


def _read(fd: int) -> dict[str, Any]:
  try:
    raw = os.pread(fd, 65536, 0)
    return json.loads(raw) if raw.strip() else {}
  except (OSError, ValueError):
    return {"pid": "?"}


def _describe(info: dict[str, Any]) -> str:
  if not info:
    return "another process"
  return (f"pid {info.get('pid', '?')} on {info.get('host', '?')} since {info.get('started', '?')} "
          f"({' '.join(map(str, info.get('argv', [])))[:120]})")


# what a run writes first into its workdir: one of these marks a directory as a run's
RUN_MARKERS = (LOCK_NAME, "checkpoints", "metrics.jsonl", "runtime.json")


def check_owned(workdir: str | os.PathLike) -> None:
  """ConfigError if `workdir` exists, is not empty and holds nothing a run writes: training writes only
  into a new or empty directory, or one of its own."""
  work = pathlib.Path(workdir).expanduser()
  if not work.exists():
    return
  if not work.is_dir():
    raise config_lib.ConfigError(f"workdir: {work} is a file, not a directory; pass a new or empty directory")
  if (work / CONVERTED_MARKER).is_file():      # tformer-convert --from-hf's output: weights to start from
    raise config_lib.ConfigError(
        f"workdir: {work} is a converted model (tformer-convert --from-hf wrote it), not a training run: "
        f"use train.init_from (a new --workdir with --config.train.init_from={work}); nothing there was changed")
  entries = sorted(p.name for p in work.iterdir())
  if not entries or any(name in entries for name in RUN_MARKERS) or _is_run_config(work / "config.json"):
    return
  shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
  raise config_lib.ConfigError(f"workdir: {work} holds files that are not a training run's ({shown}); pass a "
                               "new or empty directory (nothing there was changed)")


def _is_run_config(path: pathlib.Path) -> bool:
  try:
    saved = json.loads(path.read_text())
  except (OSError, ValueError):
    return False
  return isinstance(saved, dict) and "model" in saved and "train" in saved


def check_architecture(workdir: str | os.PathLike, cfg: Any) -> None:
  """ConfigError if `workdir` holds checkpoints of a model whose architecture differs from cfg.model."""
  work = pathlib.Path(workdir)
  saved_path = work / "config.json"
  ckpt = work / "checkpoints"
  if not saved_path.is_file() or not ckpt.is_dir() or not any(p.name.isdigit() for p in ckpt.iterdir()):
    return
  try:
    old = config_lib.ModelConfig.from_config(json.loads(saved_path.read_text())["model"]).architecture()
  except (ValueError, KeyError, TypeError) as e:
    raise config_lib.ConfigError(f"workdir: {saved_path} is not a readable config ({e}); move it away "
                                 "to start over") from None
  new = config_lib.ModelConfig.from_config(cfg.model).architecture()
  diff = [f"model.{k}: {old[k]!r} in the workdir, {new[k]!r} now" for k in sorted(old)
          if k in new and old[k] != new[k]]
  if diff:
    raise config_lib.ConfigError(f"workdir: {work} holds checkpoints of another architecture ("
                                 + "; ".join(diff) + "); use another --workdir, or the saved config")


def _data_source(data: Any) -> tuple[tuple[str, float], ...]:
  """((corpus spec, weight), ...) of data.mixture, else data.corpus; a prepared dataset's directory absolute (the
  same data named from another directory is the same)."""
  mixture = str(data.get("mixture") or "").strip()
  entries = config_lib.parse_mixture(mixture) if mixture else [(str(data.get("corpus") or "").strip(), 1.0)]
  out = []
  for spec, weight in entries:
    spec = str(spec).strip()
    if spec.startswith("prepared:"):
      spec = "prepared:" + str(pathlib.Path(spec[len("prepared:"):].strip()).expanduser().absolute())
    out.append((spec, float(weight)))
  return tuple(out)


def check_data(workdir: str | os.PathLike, cfg: Any) -> None:
  """ConfigError if `workdir` holds checkpoints of a run on other data (data.corpus / data.mixture) than cfg's:
  a resumed run continues on the data it started on (config.json and data.json are left untouched)."""
  work = pathlib.Path(workdir)
  saved_path, ckpt = work / "config.json", work / "checkpoints"
  if not saved_path.is_file() or not ckpt.is_dir() or not any(p.name.isdigit() for p in ckpt.iterdir()):
    return
  try:
    old = json.loads(saved_path.read_text()).get("data") or {}
  except (OSError, ValueError, AttributeError) as e:
    raise config_lib.ConfigError(f"workdir: {saved_path} is not a readable config ({e}); move it away "
                                 "to start over") from None
  if not old.get("corpus") and not old.get("mixture"):
    return
  was, now = _data_source(old), _data_source(cfg.data)
  if was != now:
    show = lambda d: str(d.get("mixture") or d.get("corpus"))  # noqa: E731
    raise config_lib.ConfigError(f"workdir: {work} holds checkpoints of a run on {show(old)}, this config trains on "
                                 f"{show(cfg.data)}: resume on the data the run started on, or use another "
                                 "--workdir (nothing there was changed)")


def remove_if_unused(workdir: str | os.PathLike) -> None:
  """Delete a workdir this run created, if nothing of value landed in it (no checkpoint step, no
  metrics): a command that failed early leaves the filesystem as it found it."""
  work = pathlib.Path(workdir).expanduser()
  ckpt = work / "checkpoints"
  if ckpt.is_dir() and any(p.name.isdigit() for p in ckpt.iterdir()):
    return
  if (work / "metrics.jsonl").is_file() and (work / "metrics.jsonl").stat().st_size:
    return
  shutil.rmtree(work, ignore_errors=True)
