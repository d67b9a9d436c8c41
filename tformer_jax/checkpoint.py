"""Orbax checkpointing for the train loop: async saves, resume from the latest good step, cross-mesh restore.

Layout: `<workdir>/checkpoints/<step>/` with three Orbax items

  state  the whole train-state pytree (StandardSave: params, opt_state, loss scale, rng, step)
  data   the data iterator's state dict (JSON; absent when the loop passed None)
  meta   {"step": step, **meta} (JSON: the resolved config, anything else)

  ckpt = Checkpointer(workdir / "checkpoints", max_to_keep=3)
  restored = ckpt.restore(abstract_state)        # None: no checkpoint yet, start fresh
  if restored is not None:
    step, state, data_state, meta = restored
  ...
  ckpt.save(step, state, it.get_state(), {"step": step})   # async: returns once arrays are on host
  ckpt.wait(); ckpt.close()                                 # before exit, or the last save may be lost

`abstract_state` is a pytree of `jax.ShapeDtypeStruct` (or arrays) whose `.sharding` says where each
tensor goes, so a checkpoint written on one mesh restores onto another mesh or device count.

Corruption: if the newest step cannot be read (a truncated or missing file), `restore` logs a WARNING
naming the step and the error and falls back to the previous step; nothing is deleted. The next
`save` moves such known-bad step directories aside to `<step>.corrupt` (still on disk) so that the
resumed run can write those steps again. A shape mismatch between the checkpoint and the target
(an incompatible config) raises `CheckpointError` listing the tensors, without falling back.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any, Callable

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

PyTree = Any
log = logging.getLogger(__name__)

STATE, DATA, META = "state", "data", "meta"
CHECKPOINT_DIR = "checkpoints"
CONFIG_FILE = "config.json"
_MAX_LISTED = 20      # mismatching tensors listed in a CheckpointError
_MAX_ERROR_CHARS = 600  # of an Orbax/TensorStore error quoted in a warning


class CheckpointError(RuntimeError):
  """A checkpoint that cannot be used: missing, unreadable, or incompatible with the target."""


def _path(p: str | os.PathLike) -> epath.Path:
  """An absolute local path, or a cloud path (gs://...) as given."""
  s = os.fspath(p)
  return epath.Path(s if "://" in s else os.path.abspath(s))


def _registry(state_handler: str = "standard") -> ocp.handlers.DefaultCheckpointHandlerRegistry:
  """Handlers for the three items; `pytree` lets `state` be restored partially (params only)."""
  reg = ocp.handlers.DefaultCheckpointHandlerRegistry()
  if state_handler == "standard":
    reg.add(STATE, ocp.args.StandardSave, ocp.handlers.StandardCheckpointHandler)
    reg.add(STATE, ocp.args.StandardRestore, ocp.handlers.StandardCheckpointHandler)
  else:
    reg.add(STATE, ocp.args.PyTreeRestore, ocp.handlers.PyTreeCheckpointHandler)
  for name in (DATA, META):
    reg.add(name, ocp.args.JsonSave, ocp.handlers.JsonCheckpointHandler)
    reg.add(name, ocp.args.JsonRestore, ocp.handlers.JsonCheckpointHandler)
  return reg


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


def _short(e: BaseException) -> str:
  msg = f"{type(e).__name__}: {e}"
  return msg if len(msg) <= _MAX_ERROR_CHARS else msg[:_MAX_ERROR_CHARS] + " ..."


def _path_str(keys: tuple[str, ...]) -> str:
  return "/".join(keys) or "<root>"


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
                explicit: bool) -> tuple[int, Any, list[int]]:
  """Try `attempt(step)` newest first; warn about and skip steps that fail (unless `explicit`).

  A CheckpointError from `attempt` (a shape mismatch) propagates: it is not corruption.
  Returns (step, result, bad_steps).
  """
  bad, errors = [], []
  for s in sorted(steps, reverse=True):
    try:
      return s, attempt(s), bad
    except CheckpointError:
      raise
    except Exception as e:  # noqa: BLE001 - any read failure means this step is unusable
      if explicit:
        raise CheckpointError(
            f"checkpoint step {s} in {directory} cannot be restored: {_short(e)}") from e
      log.warning("checkpoint step %d in %s is unreadable (partial or corrupt?), falling back to an "
                  "earlier step; nothing was deleted. Error: %s", s, directory, _short(e))
      bad.append(s)
      errors.append(f"step {s}: {_short(e)}")
  raise CheckpointError(f"no restorable checkpoint in {directory}; every step failed:\n  "
                        + "\n  ".join(errors))


class Checkpointer:
  """Async Orbax checkpoints of (train state, data-iterator state, meta) in `directory`.

  All processes must make the same calls (Orbax synchronises them); only the primary writes JSON.
  """

  def __init__(self, directory: str | os.PathLike, *, max_to_keep: int = 3, async_save: bool = True):
    self.directory = _path(directory)
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=async_save,
                                           create=True, cleanup_tmp_directories=False)
    self._manager = ocp.CheckpointManager(self.directory, options=options, handler_registry=_registry())
    self._bad: set[int] = set()      # steps `restore` found unreadable; moved aside by the next save
    self._closed = False

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
    """
    step = int(step)
    self._quarantine_bad_steps()
    if step in self._manager.all_steps():
      log.info("checkpoint step %d already exists in %s; not saving it again", step, self.directory)
      return False
    items = {STATE: ocp.args.StandardSave(state),
             META: ocp.args.JsonSave(_to_json(META, {"step": step, **(meta or {})}))}
    if data_state is not None:
      items[DATA] = ocp.args.JsonSave(_to_json(DATA, data_state))
    saved = bool(self._manager.save(step, args=ocp.args.Composite(**items), force=force))
    if not saved:
      latest = self._manager.latest_step()
      if latest is not None and step <= latest:
        log.warning("checkpoint step %d not saved: step %d already exists in %s (pass force=True to "
                    "save an older step)", step, latest, self.directory)
    return saved

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

  def wait(self) -> None:
    """Block until pending async saves are written and finalised (call before exiting)."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Wait for pending saves and release Orbax's threads. Idempotent."""
    if not self._closed:
      self._manager.close()
      self._closed = True

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()

  # -- restore ---------------------------------------------------------------------------------
  def restore(self, abstract_state: PyTree,
              step: int | None = None) -> tuple[int, PyTree, dict | None, dict | None] | None:
    """Restore `step` (default: the latest good one) onto `abstract_state`'s shapes and shardings.

    Returns (step, state, data_state or None, meta) or None when there is no checkpoint.
    Raises CheckpointError on a shape mismatch, if an explicit `step` is missing or unreadable, or
    if no step at all is readable.
    """
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
      items = {STATE: ocp.args.StandardRestore(abstract_state), META: ocp.args.JsonRestore()}
      has_data = (self.directory / str(s) / DATA).exists()
      if has_data:
        items[DATA] = ocp.args.JsonRestore()
      out = self._manager.restore(s, args=ocp.args.Composite(**items))
      _check_restored(abstract_state, out[STATE])
      return out[STATE], (out[DATA] if has_data else None), out[META]

    s, (state, data, meta), bad = _first_good(self.directory, steps, attempt, explicit=step is not None)
    self._bad.update(bad)
    return s, state, data, meta


def _read_config(path: epath.Path) -> ml_collections.ConfigDict:
  try:
    return ml_collections.ConfigDict(json.loads(path.read_text()))
  except (OSError, ValueError) as e:
    raise CheckpointError(f"cannot read the run config {path}: {e}") from e


def restore_params(workdir: str | os.PathLike,
                   step: int | None = None) -> tuple[ml_collections.ConfigDict, PyTree]:
  """(config, params) of a train workdir, for inference: params as host numpy arrays.

  Reads `<workdir>/config.json` and only the `params` field of the saved train state (as it was
  saved) from the latest readable checkpoint (or `step`), whatever the optimizer or the mesh it
  was trained on; an unreadable latest step falls back like `Checkpointer.restore`.
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
      out = manager.restore(s, args=ocp.args.Composite(**{STATE: ocp.args.PyTreeRestore(
          item={"params": item}, restore_args={"params": args}, partial_restore=True)}))
      return out[STATE]["params"]

    steps_to_try = [int(step)] if step is not None else steps
    _, params, _ = _first_good(ckpt_dir, steps_to_try, attempt, explicit=step is not None)
  finally:
    manager.close()
  return config, params
