"""`Checkpointer`: async saves, resume from the latest good step (damaged steps skipped and later moved aside
to <step>.corrupt), cross-mesh restore."""
from __future__ import annotations

import dataclasses
import os
import threading
from typing import Any, Callable

import jax
import orbax.checkpoint as ocp
from etils import epath

from tformer_jax.checkpoint.common import (
  _RECORD,
  DATA,
  FORMAT,
  MANIFEST,
  META,
  STATE,
  CheckpointError,
  PyTree,
  _Damaged,
  _is_local,
  _path,
  log,
)
from tformer_jax.checkpoint.integrity import (
  _check_items,
  _digest,
  _mismatch_error,
  _to_json,
  _user_meta,
  _verify_arrays,
  _verify_json,
  array_checksums,
  shape_mismatches,
)
from tformer_jax.checkpoint.logs import _NOISE, _append_debug, _debug_log_path, _format_exc, _short


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
