"""Orbax checkpointing for the train loop: async saves, resume from the latest good step, cross-mesh restore.

Layout: `<workdir>/checkpoints/<step>/` with four Orbax items

  state     the whole train-state pytree (StandardSave: params, opt_state, loss scale, rng, step); a
            LoRA run (train.lora) saves its adapters as params and their optimizer state, not the
            frozen base (`merge_lora` rebuilds the model from the train.init_from it points to)
  data      the data iterator's state dict (JSON; absent when the loop passed None)
  meta      {"step": step, **meta} (JSON: the resolved config, anything else), plus the reserved key
            "_checkpoint": {"format": 1, "items": [...]} naming the items saved with the step
  manifest  the integrity manifest (JSON): for every array of `state` its dtype, shape and a 64-bit
            checksum of its bytes (`array_checksums`), and sha256 digests of `data` and `meta`

  ckpt = Checkpointer(workdir / "checkpoints", max_to_keep=3)   # CheckpointError if not writable
  restored = ckpt.restore(abstract_state, require_data_state=True)  # None: no checkpoint yet
  if restored is not None:
    step, state, data_state, meta = restored
  for step in ...:
    ckpt.check()                                  # every step: a finished async save that failed raises
    ...
    ckpt.save(step, state, it.get_state(), {"step": step})   # async: returns once arrays are on host
  ckpt.close()                                    # waits for the last save, raises if it failed

`abstract_state` is a pytree of `jax.ShapeDtypeStruct` (or arrays) whose `.sharding` says where each
tensor goes, so a checkpoint written on one mesh restores onto another mesh or device count.

Save failures stop the caller, in one line: `CheckpointError` is raised by the constructor when the
directory is not writable (probed with a real file), by `save` when a save cannot start (its step
directory is created before `save` returns, so a read-only or vanished directory fails there) or
when the previous async save failed, by `check()` (non-blocking) once a failed async save has
finished (a full disk), and by `wait()`/`close()` before exit. Each failure is raised once; steps
saved before it stay restorable. Orbax's tracebacks go to the debug log, `WORKDIR/debug.log`
(`<directory>/debug.log` when the directory is not named `checkpoints`).

Damage: if the newest step cannot be read (a truncated or missing file), is missing an item it was
saved with (its `data` or `manifest`), or fails its manifest (a changed byte), `restore` logs one
WARNING line naming the step and the reason and falls back to the previous step; nothing is deleted.
The next `save` moves such known-bad step directories aside to `<step>.corrupt` (still on disk) so
that the resumed run can write those steps again. Steps written before manifests existed restore
unverified. When no step is usable the CheckpointError is one line. A shape mismatch between the
checkpoint and the target (an incompatible config) raises `CheckpointError` listing the tensors,
without falling back. Orbax/TensorStore warnings, errors and the "Event loop is closed" noise of
failed reads go to the debug log instead of the console while a Checkpointer is in use.
"""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import os
import re
import sys
import threading
import traceback
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax import lax

PyTree = Any
log = logging.getLogger(__name__)

STATE, DATA, META, MANIFEST = "state", "data", "meta", "manifest"
CHECKPOINT_DIR = "checkpoints"
CONFIG_FILE = "config.json"
DEBUG_LOG = "debug.log"
FORMAT = 1               # of the manifest and the "_checkpoint" record in `meta`
_RECORD = "_checkpoint"  # reserved key in the saved `meta` (stripped on restore)
_MAX_LISTED = 20         # mismatching tensors listed in a CheckpointError
_MAX_ERROR_CHARS = 300   # of an Orbax/TensorStore error quoted in a one-line message
_LIBRARY_DIRS = (f"{os.sep}orbax{os.sep}", f"{os.sep}tensorstore{os.sep}")
# asyncio's "Future exception was never retrieved" for a failed TensorStore write/read (at exit)
_LIBRARY_TEXT = re.compile(r"orbax|tensorstore|OCDBT", re.IGNORECASE)


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


def _registry(state_handler: str = "standard") -> ocp.handlers.DefaultCheckpointHandlerRegistry:
  """Handlers for the items; `pytree` lets `state` be restored partially (params only)."""
  reg = ocp.handlers.DefaultCheckpointHandlerRegistry()
  if state_handler == "standard":
    reg.add(STATE, ocp.args.StandardSave, ocp.handlers.StandardCheckpointHandler)
    reg.add(STATE, ocp.args.StandardRestore, ocp.handlers.StandardCheckpointHandler)
  else:
    reg.add(STATE, ocp.args.PyTreeRestore, ocp.handlers.PyTreeCheckpointHandler)
  for name in (DATA, META, MANIFEST):
    reg.add(name, ocp.args.JsonSave, ocp.handlers.JsonCheckpointHandler)
    reg.add(name, ocp.args.JsonRestore, ocp.handlers.JsonCheckpointHandler)
  return reg


def _async_options() -> ocp.AsyncOptions:
  """Step directories are created before `save` returns: a directory that cannot be written then
  fails in `save` itself. (Created in Orbax's background threads, the failure leaves the other
  threads waiting the 300 s coordination timeout for a directory signal that never comes.)"""
  if "create_directories_asynchronously" in {f.name for f in dataclasses.fields(ocp.AsyncOptions)}:
    return ocp.AsyncOptions(create_directories_asynchronously=False)
  return ocp.AsyncOptions()


def _json_default(x: Any) -> Any:
  """numpy / jax scalars and arrays, paths, ConfigDicts and sets -> JSON values."""
  if isinstance(x, (np.generic, np.ndarray, jax.Array)):
    return np.asarray(x).tolist()
  if isinstance(x, os.PathLike):
    return os.fspath(x)
  if isinstance(x, ml_collections.ConfigDict):
    return x.to_dict()
  if isinstance(x, (set, frozenset)):
    return sorted(x)
  raise TypeError(f"not JSON-serialisable: {type(x).__name__} {x!r}")


def _to_json(name: str, value: Any) -> Any:
  """`value` as plain JSON data; fails here (not in Orbax's background thread) if it can't be."""
  try:
    return json.loads(json.dumps(value, default=_json_default))
  except (TypeError, ValueError) as e:
    raise CheckpointError(f"checkpoint item {name!r} must be JSON-serialisable: {e}") from e


def _digest(value: Any) -> str:
  """sha256 of the canonical JSON of `value`."""
  return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _short(e: BaseException, limit: int = _MAX_ERROR_CHARS) -> str:
  """`Type: message` on one line, without TensorStore's spec dumps; an OS error's reason first."""
  raw = str(e)
  text = raw.split("See full TensorStore details")[0]
  text = re.sub(r"\s*\[tensorstore_spec=.*", "", text, flags=re.S)
  text = " ".join(text.split()).rstrip(".")
  msg = f"{type(e).__name__}: {text}" if text else type(e).__name__
  code = re.search(r"os_error_code='(\d+)'", raw)
  if code:
    msg = f"{os.strerror(int(code.group(1)))} ({msg})"
  elif isinstance(e, OSError) and e.strerror:
    msg = e.strerror + (f": {os.fspath(e.filename)}" if e.filename else "")
  return msg if len(msg) <= limit else msg[:limit] + " ..."


def _path_str(keys: tuple[str, ...]) -> str:
  return "/".join(keys) or "<root>"


# -- the debug log: library tracebacks and noise, kept off the console ----------------------------

def _debug_log_path(directory: epath.Path) -> epath.Path:
  """WORKDIR/debug.log for WORKDIR/checkpoints; `<directory>/debug.log` otherwise."""
  return directory.parent / DEBUG_LOG if directory.name == CHECKPOINT_DIR else directory / DEBUG_LOG


def _append_debug(path: epath.Path | None, text: str) -> bool:
  """Append `text` to the debug log; False if there is none or it cannot be written."""
  if path is None or not _is_local(path):
    return False
  stamp = datetime.datetime.now().isoformat(sep=" ", timespec="milliseconds")
  try:
    with open(os.fspath(path), "a") as f:
      f.write(f"--- {stamp} [process {jax.process_index()}, pid {os.getpid()}] {text.rstrip()}\n")
  except OSError:
    return False
  return True


def _format_exc(e: BaseException) -> str:
  return "".join(traceback.format_exception(type(e), e, e.__traceback__))


def _tb_in_library(tb: Any) -> bool:
  while tb is not None:
    if any(d in tb.tb_frame.f_code.co_filename for d in _LIBRARY_DIRS):
      return True
    tb = tb.tb_next
  return False


class _LibraryNoise(logging.Filter):
  """Sends Orbax/TensorStore WARNING+ log records (tracebacks from their background threads, failed
  reads, asyncio's reports of their futures' unretrieved errors) and the "Event loop is closed"
  unraisable errors that a failed TensorStore read leaves behind to the debug log of the latest
  Checkpointer, instead of the console. Records it cannot write there pass through unchanged; every
  other record and unraisable error is untouched."""

  def __init__(self) -> None:
    super().__init__()
    self.path: epath.Path | None = None
    self._previous_hook: Callable[[Any], Any] | None = None

  def attach(self, path: epath.Path) -> None:
    self.path = path
    for name in ("absl", "asyncio"):
      logger = logging.getLogger(name)
      if self not in logger.filters:
        logger.addFilter(self)
    if sys.unraisablehook != self._unraisable:   # (re)install: pytest swaps the hook per test
      self._previous_hook = sys.unraisablehook
      sys.unraisablehook = self._unraisable

  def filter(self, record: logging.LogRecord) -> bool:
    if self.path is None or record.levelno < logging.WARNING:
      return True
    exc = record.exc_info[1] if record.exc_info else None
    if not (any(d in record.pathname for d in _LIBRARY_DIRS)
            or (exc is not None and _tb_in_library(exc.__traceback__))
            or (record.name == "asyncio" and _LIBRARY_TEXT.search(f"{record.getMessage()} {exc}"))):
      return True
    text = f"{record.levelname} {record.name}: {record.getMessage()}"
    if exc is not None:
      text += "\n" + _format_exc(exc)
    return not _append_debug(self.path, text)

  def _unraisable(self, unraisable: Any) -> None:
    exc = unraisable.exc_value
    noise = ((isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed")
             or _tb_in_library(unraisable.exc_traceback)
             or "orbax" in repr(getattr(unraisable, "object", None)))
    if noise and exc is not None and _append_debug(self.path, "unraisable (ignored): " + _format_exc(exc)):
      return
    (self._previous_hook or sys.__unraisablehook__)(unraisable)


_NOISE = _LibraryNoise()


# -- array checksums ------------------------------------------------------------------------------

def _fmix32(h: jax.Array) -> jax.Array:
  """MurmurHash3's finaliser: a bijection of uint32 that mixes every bit into every other."""
  h = h ^ (h >> 16)
  h = h * np.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * np.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def _words(x: jax.Array) -> jax.Array:
  """The bytes of `x` as uint32 words (one per element; 8-byte elements gain a trailing axis of 2)."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if jnp.issubdtype(x.dtype, jnp.complexfloating):
    x = jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  bits = np.dtype(x.dtype).itemsize * 8
  if bits > 32:
    return lax.bitcast_convert_type(x, jnp.uint32)
  if bits not in (8, 16, 32):          # sub-byte types (int4, ...): their values, widened
    return x.astype(jnp.int32).view(jnp.uint32)
  unsigned = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32}[bits]
  return lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _leaf_checksum(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Two independent 32-bit sums over the words, each word mixed with its flat index: any change of
  one element changes both; the sums are exact in any order, so any sharding gives the same value."""
  w = _words(jnp.asarray(x))
  idx = jnp.zeros(w.shape, jnp.uint32)
  stride = 1
  for axis in reversed(range(w.ndim)):
    idx = idx + lax.broadcasted_iota(jnp.uint32, w.shape, axis) * np.uint32(stride % (1 << 32))
    stride *= w.shape[axis]
  a = jnp.sum(_fmix32(w ^ _fmix32(idx + np.uint32(0x9E3779B9))), dtype=jnp.uint32)
  b = jnp.sum(_fmix32(_fmix32(w) + idx * np.uint32(0x85EBCA77) + np.uint32(0x27D4EB2F)), dtype=jnp.uint32)
  return a, b


# One leaf per call: XLA materialises a leaf's index and mixed words (two uint32 arrays of its size), so one
# program over the whole state held 2x the state in temporaries (a 1.5 GiB state: +3.1 GiB of RSS at a save).
_checksum_jit = jax.jit(_leaf_checksum)


def _local(x: Any) -> Any:
  """A replicated scalar's copy on this process (fetchable on multi-process meshes too)."""
  return x.addressable_data(0) if isinstance(x, jax.Array) else x


def array_checksums(tree: PyTree) -> dict[str, dict[str, Any]]:
  """{leaf path: {"dtype", "shape", "checksum"}} of every array leaf of `tree`, computed on device, one
  leaf at a time (all processes of a multi-process run must call it together, like a save)."""
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  if not flat:
    return {}
  sums = [jax.device_get(tuple(_local(v) for v in _checksum_jit(x))) for _, x in flat]
  out = {}
  for (path, x), (a, b) in zip(flat, sums):
    dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
    out[_path_str(ocp.tree.str_keypath(path))] = {
        "dtype": str(dtype), "shape": list(np.shape(x)), "checksum": f"{int(a):08x}{int(b):08x}"}
  return out


def _verify_arrays(expected: Any, tree: PyTree, prefix: str = "") -> None:
  """_Damaged unless the leaves of `tree` are exactly the manifest's entries under `prefix`, each with
  its saved dtype, shape and checksum."""
  if not isinstance(expected, dict):
    raise _Damaged("the integrity manifest has no array entries")
  got = array_checksums(tree)
  wanted = {k: v for k, v in expected.items() if k.startswith(prefix)}
  bad = sorted(k for k in got if k not in wanted or wanted[k] != got[k])
  bad += sorted(k for k in wanted if k not in got)
  if bad:
    more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
    raise _Damaged(f"array checksum mismatch in {', '.join(bad[:3])}{more} (changed bytes on disk?)")


def _expected_items(meta: Any) -> set[str] | None:
  """The items the step was saved with (from its `meta` record), None for steps saved before records."""
  record = meta.get(_RECORD) if isinstance(meta, dict) else None
  if not isinstance(record, dict) or not isinstance(record.get("items"), list):
    return None
  return set(record["items"])


def _user_meta(meta: Any) -> Any:
  return {k: v for k, v in meta.items() if k != _RECORD} if isinstance(meta, dict) else meta


def _check_items(step_dir: epath.Path, meta: Any, *, require_data: bool,
                 needed: tuple[str, ...] = (DATA, MANIFEST)) -> None:
  """_Damaged if an item among `needed` that the step was saved with (or a required one) is gone."""
  present = {name for name in (DATA, MANIFEST) if (step_dir / name).exists()}
  expected = _expected_items(meta)
  missing = sorted((expected or set()) & set(needed) - present)
  if require_data and DATA not in present and DATA not in missing:
    missing.insert(0, DATA)
  if missing:
    what = {DATA: "the data-iterator state ('data')", MANIFEST: "the integrity manifest ('manifest')"}
    raise _Damaged("missing " + " and ".join(what[m] for m in missing))


def _verify_json(manifest: dict, name: str, value: Any) -> None:
  want = manifest.get(name)
  if want is not None and want != _digest(value):
    raise _Damaged(f"the '{name}' item does not match its digest in the manifest (changed on disk?)")


# -- shapes -----------------------------------------------------------------------------------------

def _target_shape(leaf: Any) -> tuple[int, ...] | None:
  """The shape a target leaf occupies on disk (a typed PRNG key is stored as its key data)."""
  dtype = getattr(leaf, "dtype", None)
  if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    return tuple(jax.eval_shape(jax.random.key_data, leaf).shape)
  if hasattr(leaf, "shape"):
    return tuple(leaf.shape)
  if isinstance(leaf, (int, float, bool, complex, np.generic)):
    return ()
  return None


def shape_mismatches(abstract_state: PyTree, metadata_tree: PyTree) -> list[str]:
  """Lines 'path: checkpoint (..) vs target (..)' for every tensor whose shape or presence differs."""
  saved = ocp.tree.to_flat_dict(metadata_tree)
  flat = jax.tree_util.tree_flatten_with_path(abstract_state)[0]
  target = {ocp.tree.str_keypath(p): leaf for p, leaf in flat}
  lines = []
  for key, leaf in target.items():
    want = _target_shape(leaf)
    if key not in saved:
      lines.append(f"{_path_str(key)}: not in the checkpoint (target shape {want})")
      continue
    have = getattr(saved[key], "shape", None)
    if have is not None and want is not None and tuple(have) != want:
      lines.append(f"{_path_str(key)}: checkpoint shape {tuple(have)} vs target shape {want}")
  for key, meta in saved.items():
    if key not in target:
      shape = getattr(meta, "shape", "?")
      lines.append(f"{_path_str(key)}: in the checkpoint (shape {shape}) but not in the target")
  return lines


def _mismatch_error(directory: epath.Path, step: int, lines: list[str]) -> CheckpointError:
  shown = lines[:_MAX_LISTED]
  more = f"\n  ... and {len(lines) - len(shown)} more" if len(lines) > len(shown) else ""
  return CheckpointError(
      f"checkpoint step {step} in {directory} does not fit the state being restored "
      f"({len(lines)} tensor(s) differ; was it written with a different model/optimizer config?):\n  "
      + "\n  ".join(shown) + more)


def _state_tree(manager: ocp.CheckpointManager, step: int) -> PyTree:
  """The saved tree metadata of the `state` item; raises if it is missing or unreadable."""
  meta = manager.item_metadata(step)
  tree_meta = meta.get(STATE) if hasattr(meta, "get") else None
  if tree_meta is None or getattr(tree_meta, "tree", None) is None:
    raise FileNotFoundError(f"no readable '{STATE}' metadata in step {step}")
  return tree_meta.tree


def _check_restored(abstract_state: PyTree, restored: PyTree) -> None:
  """Raise if Orbax returned other dtypes/shapes than asked for (e.g. a PRNG key restored as raw
  uint32 because the checkpoint's array metadata is missing): the checkpoint is damaged."""
  flat = jax.tree_util.tree_flatten_with_path(abstract_state)[0]
  got = jax.tree.leaves(restored)
  if len(got) != len(flat):
    raise ValueError(f"restored {len(got)} tensors, expected {len(flat)}")
  for (path, want), x in zip(flat, got):
    w_dtype, w_shape = getattr(want, "dtype", None), getattr(want, "shape", None)
    if w_dtype is None or w_shape is None:
      continue
    if x.dtype != w_dtype or tuple(x.shape) != tuple(w_shape):
      raise ValueError(f"{jax.tree_util.keystr(path)} restored as {x.dtype}{list(x.shape)}, expected "
                       f"{w_dtype}{list(w_shape)} (damaged array metadata?)")


def _first_good(directory: epath.Path, steps: list[int], attempt: Callable[[int], Any],
                explicit: bool, debug_log: epath.Path | None = None) -> tuple[int, Any, list[int]]:
  """Try `attempt(step)` newest first; warn (one line each) about and skip steps that fail (unless
  `explicit`). The full errors go to `debug_log`; Orbax's noise meanwhile too.

  A CheckpointError from `attempt` (a shape mismatch) propagates: it is not corruption.
  Returns (step, result, bad_steps).
  """
  if debug_log is not None:
    _NOISE.attach(debug_log)
  details = ""
  bad, errors = [], []
  for s in sorted(steps, reverse=True):
    try:
      return s, attempt(s), bad
    except CheckpointError:
      raise
    except Exception as e:  # noqa: BLE001 - any read failure means this step is unusable
      if _append_debug(debug_log, f"checkpoint step {s} in {directory} cannot be restored:\n{_format_exc(e)}"):
        details = f"; details in {debug_log}"
      reason = str(e) if isinstance(e, _Damaged) else _short(e)
      if explicit:
        raise CheckpointError(f"checkpoint step {s} in {directory} cannot be restored: {reason}{details}") from None
      log.warning("checkpoint step %d in %s is unreadable or damaged (%s), falling back to an earlier step; "
                  "nothing was deleted%s", s, directory, reason, details)
      bad.append(s)
      errors.append(f"step {s}: {_short(e, 150) if not isinstance(e, _Damaged) else reason}")
  shown = "; ".join(errors[:3]) + (f"; and {len(errors) - 3} more" if len(errors) > 3 else "")
  raise CheckpointError(f"no restorable checkpoint in {directory}: all {len(errors)} step(s) are unreadable "
                        f"or damaged ({shown}){details}")


def _check_writable(directory: epath.Path) -> None:
  """CheckpointError unless a step directory and a file can be created in `directory` (local paths)."""
  if not _is_local(directory):
    return
  path = os.fspath(directory)
  if os.path.exists(path) and not os.path.isdir(path):
    raise CheckpointError(f"checkpoint directory {path} is not writable: it exists and is not a directory")
  probe = os.path.join(path, f".write_test.{os.uname().nodename}.{os.getpid()}.{threading.get_ident()}")
  try:
    os.makedirs(path, exist_ok=True)
    os.makedirs(probe, exist_ok=True)
    with open(os.path.join(probe, "probe"), "wb") as f:
      f.write(b"ok")
    os.unlink(os.path.join(probe, "probe"))
    os.rmdir(probe)
  except OSError as e:
    where = f" ({e.filename})" if e.filename and os.fspath(e.filename) != path else ""
    raise CheckpointError(f"checkpoint directory {path} is not writable: {e.strerror or e}{where}") from None


class Checkpointer:
  """Async Orbax checkpoints of (train state, data-iterator state, meta) in `directory`.

  All processes must make the same calls (Orbax synchronises them); only the primary writes JSON.
  Raises CheckpointError if `directory` cannot be written (every process probes it).
  """

  def __init__(self, directory: str | os.PathLike, *, max_to_keep: int = 3, async_save: bool = True,
               debug_log: str | os.PathLike | None = None):
    self.directory = _path(directory)
    self.debug_log = _path(debug_log) if debug_log is not None else _debug_log_path(self.directory)
    _check_writable(self.directory)
    _NOISE.attach(self.debug_log)
    self._options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, enable_async_checkpointing=async_save, create=True,
        cleanup_tmp_directories=False, async_options=_async_options())
    self._manager = self._open()
    self._bad: set[int] = set()      # steps `restore` found unreadable; moved aside by the next save
    self._pending: int | None = None  # the step of the async save in flight, until its outcome is known
    self._failure: CheckpointError | None = None  # a failed save not yet raised to the caller
    self._broken = False             # Orbax's manager re-raises a failed save forever: replaced on next use
    self._closed = False

  def _open(self) -> ocp.CheckpointManager:
    try:
      return ocp.CheckpointManager(self.directory, options=self._options, handler_registry=_registry())
    except Exception as e:  # noqa: BLE001 - e.g. the directory vanished or became a file meanwhile
      _append_debug(self.debug_log, f"opening {self.directory} failed:\n{_format_exc(e)}")
      raise CheckpointError(f"cannot open checkpoint directory {self.directory}: {_short(e)}") from None

  def _release(self) -> None:
    """Close Orbax's manager; after a failed save its close re-raises that failure: logged only."""
    try:
      self._manager.close()
    except Exception as e:  # noqa: BLE001 - already reported by _settle
      _append_debug(self.debug_log, f"closing the checkpoint manager: {_format_exc(e)}")

  def _usable(self) -> None:
    """After a failed save (reported), a fresh Orbax manager: the old one would raise it again."""
    if self._broken:
      self._release()
      self._manager = self._open()
      self._broken = False

  # -- queries ---------------------------------------------------------------------------------
  def all_steps(self) -> list[int]:
    """Finalised steps on disk (interrupted saves' tmp dirs excluded), minus ones found corrupt."""
    return sorted(s for s in self._manager.all_steps() if s not in self._bad)

  def latest_step(self) -> int | None:
    steps = self.all_steps()
    return steps[-1] if steps else None

  # -- save ------------------------------------------------------------------------------------
  def save(self, step: int, state: PyTree, data_state: dict | None = None, meta: dict | None = None, *,
           force: bool = False) -> bool:
    """Start saving `step` (async); returns whether a save was started.

    Not saved (False): the step already exists, or (without `force`) it is not newer than the
    latest step. Arrays are copied to host before this returns, so `state` may then be donated.
    Raises CheckpointError if the previous async save failed (waiting for it first, as Orbax does)
    or if this one cannot start (e.g. the directory is no longer writable).
    """
    step = int(step)
    self._settle(block=True)
    self._raise_failure()
    self._usable()
    user_meta = _to_json(META, {"step": step, **(meta or {})})
    data_json = _to_json(DATA, data_state) if data_state is not None else None
    try:
      self._quarantine_bad_steps()
      exists = step in self._manager.all_steps()
    except Exception as e:  # noqa: BLE001 - the directory vanished, became a file, ...
      raise self._save_error(step, e) from None
    if exists:
      log.info("checkpoint step %d already exists in %s; not saving it again", step, self.directory)
      return False
    names = [STATE, META, MANIFEST] + ([DATA] if data_json is not None else [])
    manifest = {"format": FORMAT, "arrays": array_checksums(state), META: _digest(user_meta),
                DATA: _digest(data_json) if data_json is not None else None}
    items = {STATE: ocp.args.StandardSave(state),
             META: ocp.args.JsonSave({**user_meta, _RECORD: {"format": FORMAT, "items": sorted(names)}}),
             MANIFEST: ocp.args.JsonSave(manifest)}
    if data_json is not None:
      items[DATA] = ocp.args.JsonSave(data_json)
    try:
      saved = bool(self._manager.save(step, args=ocp.args.Composite(**items), force=force))
    except Exception as e:  # noqa: BLE001 - the step's directory could not be created, a write failed
      raise self._save_error(step, e) from None
    if not saved:
      latest = self._manager.latest_step()
      if latest is not None and step <= latest:
        log.warning("checkpoint step %d not saved: step %d already exists in %s (pass force=True to "
                    "save an older step)", step, latest, self.directory)
    else:
      self._pending = step
    return saved

  def _save_error(self, step: int, e: BaseException) -> CheckpointError:
    logged = _append_debug(self.debug_log, f"saving checkpoint step {step} in {self.directory} failed:\n"
                                           f"{_format_exc(e)}")
    try:
      last = self._last_complete(step)
    except Exception:  # noqa: BLE001 - listing may fail for the same reason (a vanished directory)
      last = None
    kept = "no earlier checkpoint" if last is None else f"the last complete checkpoint is step {last}"
    details = f" (details in {self.debug_log})" if logged else ""
    return CheckpointError(f"saving checkpoint step {step} to {self.directory} failed: {_short(e)}; {kept}{details}")

  def _settle(self, block: bool, timeout_s: float | None = None) -> bool:
    """Learn the outcome of the async save in flight, if it has finished (or wait for it when
    `block`); a failure is kept in `_failure` until raised. False if the wait timed out."""
    step = self._pending
    if step is None or (not block and self._manager.is_saving_in_progress()):
      return True
    self._pending = None
    try:
      if not _wait(self._manager.wait_until_finished, timeout_s):
        last = self._last_complete(step)
        self._failure = CheckpointError(
            f"checkpoint step {step} in {self.directory} is still being written after {timeout_s:g} s; gave up "
            f"waiting (the step is incomplete; the last complete one is {'none' if last is None else f'step {last}'})")
        return False
      if not (self.directory / str(step)).exists():   # Orbax logs some commit failures and returns
        raise FileNotFoundError(f"step {step} was not finalised: {self.directory / str(step)} is missing")
    except Exception as e:  # noqa: BLE001 - whatever Orbax/TensorStore raised in the background
      self._failure = self._save_error(step, e)
      self._broken = True
    return True

  def _last_complete(self, step: int) -> int | None:
    """The newest complete step other than `step` (the one being written), or None."""
    return max((s for s in self._manager.all_steps() if s != step and s not in self._bad), default=None)

  def _raise_failure(self) -> None:
    if self._failure is not None:
      failure, self._failure = self._failure, None
      raise failure

  def check(self) -> None:
    """Non-blocking: raise CheckpointError if an async save has finished and failed (once per failure).

    Cheap enough to call every step (one lock-protected flag read while a save is in flight)."""
    self._settle(block=False)
    self._raise_failure()

  def _quarantine_bad_steps(self) -> None:
    """Rename step dirs `restore` found corrupt to `<step>.corrupt[-n]` so Orbax stops listing them."""
    present = sorted(self._bad & set(self._manager.all_steps()))
    if not present:
      return
    self._manager.wait_until_finished()
    if jax.process_index() == 0:
      for s in present:
        src = self.directory / str(s)
        dst, n = self.directory / f"{s}.corrupt", 0
        while dst.exists():
          n += 1
          dst = self.directory / f"{s}.corrupt-{n}"
        if src.exists():
          src.rename(dst)
          log.warning("moved unreadable checkpoint step %d aside to %s (not deleted)", s, dst)
    ocp.multihost.sync_global_processes("tformer_jax_checkpoint_quarantine")
    self._manager.reload()
    self._bad.clear()

  def wait(self, timeout_s: float | None = None) -> None:
    """Block until the pending async save is written and finalised (call before exiting); raise
    CheckpointError if it (or an earlier one not yet reported) failed, or is still running after
    `timeout_s` seconds (None: no limit)."""
    self._settle(block=True, timeout_s=timeout_s)
    self._raise_failure()

  def close(self, timeout_s: float | None = None, *, quiet: bool = False) -> None:
    """Wait for the pending save (see `wait`), release Orbax's threads, then raise a save failure not
    yet reported (`quiet`: log it as one ERROR line instead, for use while another exception is
    already on its way out). Idempotent."""
    if self._closed:
      return
    finished = True
    try:
      finished = self._settle(block=True, timeout_s=timeout_s)
    finally:
      self._closed = True
      if finished:   # (after a timeout, closing would wait for the save again)
        self._release()
    if quiet and self._failure is not None:
      log.error("%s", self._failure)
      self._failure = None
    self._raise_failure()

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close(quiet=exc[0] is not None)   # the body's exception wins; a save failure is then logged

  # -- restore ---------------------------------------------------------------------------------
  def restore(self, abstract_state: PyTree, step: int | None = None, *,
              require_data_state: bool = False) -> tuple[int, PyTree, dict | None, dict | None] | None:
    """Restore `step` (default: the latest good one) onto `abstract_state`'s shapes and shardings.

    Returns (step, state, data_state or None, meta) or None when there is no checkpoint.
    A step is damaged (and skipped with a warning) when it cannot be read, when an item it was saved
    with is missing, when its arrays or JSON items fail the manifest, or, with `require_data_state`,
    when it has no data-iterator state (steps saved before manifests existed: the only way to tell).
    Raises CheckpointError on a shape mismatch, if an explicit `step` is missing or damaged, or if
    no step at all is usable.
    """
    self._settle(block=True)
    self._usable()
    self._manager.wait_until_finished()
    self._manager.reload()
    steps = [s for s in self._manager.all_steps() if s not in self._bad]
    if step is not None:
      if int(step) not in steps:
        raise CheckpointError(
            f"no checkpoint step {step} in {self.directory}; available: {sorted(steps)}")
      steps = [int(step)]
    if not steps:
      return None

    def attempt(s: int) -> tuple[PyTree, dict | None, dict | None]:
      lines = shape_mismatches(abstract_state, _state_tree(self._manager, s))
      if lines:
        raise _mismatch_error(self.directory, s, lines)
      step_dir = self.directory / str(s)
      present = {name for name in (DATA, MANIFEST) if (step_dir / name).exists()}
      items = {STATE: ocp.args.StandardRestore(abstract_state), META: ocp.args.JsonRestore()}
      items.update({name: ocp.args.JsonRestore() for name in present})
      out = self._manager.restore(s, args=ocp.args.Composite(**items))
      _check_restored(abstract_state, out[STATE])
      _check_items(step_dir, out[META], require_data=require_data_state)
      meta = _user_meta(out[META])
      data = out[DATA] if DATA in present else None
      if MANIFEST in present:
        manifest = out[MANIFEST]
        if not isinstance(manifest, dict):
          raise _Damaged("the integrity manifest is not a JSON object")
        _verify_json(manifest, META, meta)
        if data is not None:
          _verify_json(manifest, DATA, data)
        _verify_arrays(manifest.get("arrays"), out[STATE])
      return out[STATE], data, meta

    s, (state, data, meta), bad = _first_good(self.directory, steps, attempt, explicit=step is not None,
                                              debug_log=self.debug_log)
    self._bad.update(bad)
    return s, state, data, meta


def _wait(fn: Callable[[], Any], timeout_s: float | None) -> bool:
  """Run `fn()`; with a timeout, in a helper thread: False if it has not returned after `timeout_s`
  (it keeps running). Exceptions propagate."""
  if timeout_s is None:
    fn()
    return True
  box: dict[str, BaseException] = {}

  def run() -> None:
    try:
      fn()
    except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
      box["error"] = e

  t = threading.Thread(target=run, name="tformer_jax_checkpoint_wait", daemon=True)
  t.start()
  t.join(timeout_s)
  if t.is_alive():
    return False
  if "error" in box:
    raise box["error"]
  return True


def _read_config(path: epath.Path) -> ml_collections.ConfigDict:
  try:
    return ml_collections.ConfigDict(json.loads(path.read_text()))
  except (OSError, ValueError) as e:
    raise CheckpointError(f"cannot read the run config {path}: {e}") from e


def lora_of(config: Any) -> tuple[int, float] | None:
  """(rank, alpha / rank) of a run config's train.lora, None when the run trained every parameter."""
  lo = (config.get("train") or {}).get("lora") if hasattr(config, "get") else None
  rank = int(lo.get("rank", 0)) if lo else 0
  return (rank, float(lo.get("alpha", rank)) / rank) if rank > 0 else None


def merge_lora(config: Any, adapters: PyTree) -> PyTree:
  """A LoRA run's model: its adapters merged into the frozen base its train.init_from names (read
  again: an HF directory, or a workdir, itself merged when it is a LoRA run), as host numpy arrays."""
  from tformer_jax import decode  # noqa: PLC0415 (these import this module: imported when used)
  from tformer_jax.interop import hf  # noqa: PLC0415
  from tformer_jax.ops import lora as lora_ops  # noqa: PLC0415
  _, scale = lora_of(config)
  source = str(config.train.get("init_from", "") or "")
  if not source:
    raise CheckpointError("a LoRA run's config.json has no train.init_from: its base model is unknown")
  try:
    if source.startswith("hf:"):
      _, base = hf.load_hf(os.path.expanduser(source[3:]))
    else:
      _, base = restore_params(source)
  except (OSError, CheckpointError, ValueError) as e:
    raise CheckpointError(f"the LoRA base train.init_from={source} cannot be read: {_short(e)}") from None
  base = jax.tree.map(np.asarray, base)
  if "layers" in adapters and "layers" not in base and "layers_0" in base:
    base = decode.stack_layers(base, int(config.model.num_layers))   # an unscanned base, a scanned run
  try:
    merged = lora_ops.merge(base, adapters, scale)
  except (ValueError, TypeError) as e:
    raise CheckpointError(f"the LoRA adapters do not fit their base train.init_from={source}: {e}") from None
  return jax.tree.map(np.asarray, merged)


def restore_params(workdir: str | os.PathLike, step: int | None = None, *,
                   with_step: bool = False, merge: bool = True) -> tuple[Any, ...]:
  """(config, params) of a train workdir, for inference: params as host numpy arrays; with_step=True:
  (config, params, the step they come from). A LoRA run (train.lora.rank > 0) saved only its adapters:
  they come merged into its base (`merge_lora`), or as they are with merge=False.

  Reads `<workdir>/config.json` and only the `params` field of the saved train state (as it was
  saved) from the latest usable checkpoint (or `step`), whatever the optimizer or the mesh it
  was trained on; the params are checked against the step's manifest, and an unreadable or damaged
  latest step falls back like `Checkpointer.restore`.
  """
  work = _path(workdir)
  if not work.is_dir():
    raise CheckpointError(f"workdir {work} does not exist")
  cfg_path, ckpt_dir = work / CONFIG_FILE, work / CHECKPOINT_DIR
  if not cfg_path.is_file():
    raise CheckpointError(f"{cfg_path} not found: is {work} a training workdir?")
  config = _read_config(cfg_path)
  if not ckpt_dir.is_dir():
    raise CheckpointError(f"no checkpoints in {work} ({ckpt_dir} does not exist)")
  debug_log = _debug_log_path(ckpt_dir)
  _NOISE.attach(debug_log)
  options = ocp.CheckpointManagerOptions(create=False, enable_async_checkpointing=False)
  manager = ocp.CheckpointManager(ckpt_dir, options=options, handler_registry=_registry("pytree"))
  try:
    steps = list(manager.all_steps())
    if not steps:
      raise CheckpointError(f"no checkpoints in {ckpt_dir}")
    if step is not None and int(step) not in steps:
      raise CheckpointError(f"no checkpoint step {step} in {ckpt_dir}; available: {sorted(steps)}")

    def attempt(s: int) -> PyTree:
      tree = _state_tree(manager, s)
      if not isinstance(tree, dict) or "params" not in tree:
        raise CheckpointError(f"checkpoint step {s} in {ckpt_dir} has no 'params' in its state")
      meta = tree["params"]
      item = jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype), meta)
      args = jax.tree.map(lambda m: ocp.RestoreArgs(restore_type=np.ndarray), meta)
      step_dir = ckpt_dir / str(s)
      has_manifest = (step_dir / MANIFEST).exists()
      items = {STATE: ocp.args.PyTreeRestore(item={"params": item}, restore_args={"params": args},
                                             partial_restore=True)}
      if (step_dir / META).exists():
        items[META] = ocp.args.JsonRestore()
      if has_manifest:
        items[MANIFEST] = ocp.args.JsonRestore()
      out = manager.restore(s, args=ocp.args.Composite(**items))
      if META in items:   # (the data iterator's state does not matter for inference)
        _check_items(step_dir, out[META], require_data=False, needed=(MANIFEST,))
      if has_manifest:
        arrays = out[MANIFEST].get("arrays") if isinstance(out[MANIFEST], dict) else None
        _verify_arrays(arrays, {"params": out[STATE]["params"]}, prefix="params/")
      return out[STATE]["params"]

    steps_to_try = [int(step)] if step is not None else steps
    used, params, _ = _first_good(ckpt_dir, steps_to_try, attempt, explicit=step is not None, debug_log=debug_log)
  finally:
    manager.close()
  if merge and lora_of(config) is not None:
    params = merge_lora(config, params)
  return (config, params, used) if with_step else (config, params)
