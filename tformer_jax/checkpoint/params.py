"""`restore_params`: a workdir's parameters for inference (a LoRA run's adapters merged into the base they were
trained on).

A LoRA run records its base when it starts, in WORKDIR/lora_base.json: the source (train.init_from), the step
read from a workdir base, and a sha256 of the base's weights (`params_digest`). Every reader (generate, eval,
serve, convert, a resumed run) reads that step, not the base's latest, and refuses a base whose weights changed
since (an HF directory exported again, a workdir base that was replaced) in one line naming both digests."""
from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from typing import Any

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from tformer_jax.checkpoint.common import (
  CHECKPOINT_DIR,
  MANIFEST,
  META,
  STATE,
  CheckpointError,
  PyTree,
  _is_local,
  _path,
)
from tformer_jax.checkpoint.integrity import _check_items, _verify_arrays
from tformer_jax.checkpoint.logs import _NOISE, _debug_log_path, _short
from tformer_jax.checkpoint.manager import _first_good, _registry, _state_tree
from tformer_jax.nn.stacking import cycle_of, dense_of

CONFIG_FILE = "config.json"
BASE_FILE = "lora_base.json"     # a LoRA run's base: {"source", "step", "sha256"}


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


def params_digest(params: PyTree) -> str:
  """sha256 of a parameter tree: every leaf's path, dtype, shape and bytes, in path order."""
  h = hashlib.sha256()
  flat = sorted((jax.tree_util.keystr(k), v) for k, v in jax.tree_util.tree_flatten_with_path(params)[0])
  for path, x in flat:
    a = np.ascontiguousarray(np.asarray(x))
    h.update(f"{path}|{a.dtype}|{a.shape}\n".encode())
    h.update(a.tobytes())
  return h.hexdigest()


def read_base(source: str, step: int | None = None) -> tuple[PyTree, int | None]:
  """(the parameters of a LoRA base, the step read: None for hf:DIR) as host numpy arrays, as the source
  holds them (an HF directory's unstacked layers); a workdir base at `step` (default its latest)."""
  if source.startswith("hf:"):
    from tformer_jax.interop import hf  # noqa: PLC0415 (interop imports this package)
    _, base = hf.load_hf(os.path.expanduser(source[3:]))
    used = None
  else:
    _, base, used = restore_params(source, step, with_step=True)
  return jax.tree.map(np.asarray, base), used


def base_identity(source: str, params: PyTree, step: int | None) -> dict[str, Any]:
  """What a LoRA run records of its base (WORKDIR/lora_base.json)."""
  return {"source": source, "step": step, "sha256": params_digest(params)}


def read_base_record(workdir: str | os.PathLike) -> dict[str, Any] | None:
  """WORKDIR/lora_base.json, None when the run has none (a run from before it was recorded)."""
  path = _path(workdir) / BASE_FILE
  if not path.exists():
    return None
  try:
    record = json.loads(path.read_text())
  except (OSError, ValueError) as e:
    raise CheckpointError(f"cannot read the LoRA base record {path}: {e}; move it away to read the base's "
                          "latest step unchecked") from None
  if not isinstance(record, dict) or not isinstance(record.get("sha256"), str):
    raise CheckpointError(f"the LoRA base record {path} is not one this code wrote (no sha256); move it away "
                          "to read the base's latest step unchecked")
  return record


def write_base_record(workdir: str | os.PathLike, record: dict[str, Any]) -> None:
  path, text = _path(workdir) / BASE_FILE, json.dumps(record, indent=1) + "\n"
  if not _is_local(path):
    path.write_text(text)
    return
  tmp = path.parent / f".{BASE_FILE}.tmp"
  tmp.write_text(text)
  os.replace(os.fspath(tmp), os.fspath(path))


def _at(source: str, step: int | None) -> str:
  return source if step is None else f"{source} (step {step})"


def check_base(workdir: str | os.PathLike, record: dict[str, Any], source: str, params: PyTree,
               step: int | None) -> None:
  """CheckpointError unless `params` (the base read now) are the weights `record` says the run trained on."""
  now = params_digest(params)
  if now != record["sha256"]:
    was = _at(str(record.get("source", source)), record.get("step"))
    raise CheckpointError(
        f"the LoRA base of {workdir} changed: {_at(source, step)} has weights sha256 {now[:12]} now, the run "
        f"trained on {was} with sha256 {record['sha256'][:12]} ({_path(workdir) / BASE_FILE}); put that base "
        "back, or train new adapters on this one in another workdir")


def pinned_step(record: dict[str, Any] | None) -> int | None:
  step = record.get("step") if record else None
  return int(step) if isinstance(step, int) and not isinstance(step, bool) else None


def merge_lora(config: Any, adapters: PyTree, workdir: str | os.PathLike | None = None) -> PyTree:
  """A LoRA run's model: its adapters merged into the frozen base its train.init_from names (read
  again: an HF directory, or a workdir, itself merged when it is a LoRA run), as host numpy arrays.
  With the run's `workdir`, its base record (lora_base.json) pins a workdir base's step and checks the
  base's weights (`check_base`)."""
  from tformer_jax import decode  # noqa: PLC0415 (these import this module: imported when used)
  from tformer_jax.ops import lora as lora_ops  # noqa: PLC0415
  _, scale = lora_of(config)
  source = str(config.train.get("init_from", "") or "")
  if not source:
    raise CheckpointError("a LoRA run's config.json has no train.init_from: its base model is unknown")
  record = read_base_record(workdir) if workdir is not None else None
  step = pinned_step(record)
  try:
    base, used = read_base(source, step)
  except (OSError, CheckpointError, ValueError) as e:
    pinned = f" at step {step}, the step the run trained on," if step is not None else ""
    raise CheckpointError(f"the LoRA base train.init_from={source}{pinned} cannot be read: {_short(e)}") from None
  if record is not None:
    check_base(workdir, record, source, base, used)
  if "layers" in adapters and "layers" not in base and "layers_0" in base:
    # an unscanned base, a scanned run
    base = decode.stack_layers(base, int(config.model.num_layers), cycle_of(adapters), dense_of(adapters))
  try:
    merged = lora_ops.merge(base, adapters, scale)
  except (ValueError, TypeError) as e:
    raise CheckpointError(f"the LoRA adapters do not fit their base train.init_from={source}: {e}") from None
  return jax.tree.map(np.asarray, merged)


RACE_RETRIES = 5    # reads of a checkpoint directory a running trainer is changing, before giving up


class _Raced(CheckpointError):
  """A step failed to read while the directory changed (a step saved or rotated away meanwhile): not damage."""


def _listing(ckpt_dir: epath.Path) -> tuple[str, ...]:
  """The entries of a local checkpoint directory (steps, temporary steps), () elsewhere or when it is gone."""
  if not _is_local(ckpt_dir):
    return ()
  try:
    return tuple(sorted(os.listdir(os.fspath(ckpt_dir))))
  except OSError:
    return ()


def _trainer(work: epath.Path) -> str | None:
  """'pid N on HOST' when a training run holds `work` (its WORKDIR/.lock, train/workdir.py: non-empty while held,
  the pid alive when it is this host's), else None."""
  if not _is_local(work):
    return None
  try:
    info = json.loads((work / ".lock").read_text() or "{}")
  except (OSError, ValueError):
    return None
  if not isinstance(info, dict) or "pid" not in info:
    return None
  if info.get("host") == socket.gethostname():
    try:
      os.kill(int(info["pid"]), 0)
    except ProcessLookupError:
      return None
    except (OSError, ValueError, TypeError):
      pass
  return f"pid {info.get('pid')} on {info.get('host', '?')}"


def _read_params(ckpt_dir: epath.Path, step: int | None, debug_log: epath.Path | None,
                 listing: tuple[str, ...]) -> tuple[int, PyTree]:
  """(the step read, its params): the latest usable step (or `step`), damaged ones skipped (`_first_good`); a
  step that fails while the directory's `listing` changes raises _Raced (the caller reads again)."""
  options = ocp.CheckpointManagerOptions(create=False, enable_async_checkpointing=False)
  manager = ocp.CheckpointManager(ckpt_dir, options=options, handler_registry=_registry("pytree"))
  try:
    steps = list(manager.all_steps())
    if not steps:
      raise CheckpointError(f"no checkpoints in {ckpt_dir}")
    if step is not None and int(step) not in steps:
      raise CheckpointError(f"no checkpoint step {step} in {ckpt_dir}; available: {sorted(steps)}")

    def attempt(s: int) -> PyTree:
      try:
        return read(s)
      except CheckpointError:
        raise
      except Exception as e:  # noqa: BLE001 - damage, unless the directory changed meanwhile (a race)
        if _listing(ckpt_dir) != listing or _trainer(ckpt_dir.parent) is not None:
          raise _Raced(f"checkpoint step {s} in {ckpt_dir} changed while it was read") from e
        raise

    def read(s: int) -> PyTree:
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
  return used, params


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
  for attempt in range(RACE_RETRIES):      # a run saving and rotating steps while we read: read again
    before = _listing(ckpt_dir)
    try:
      used, params = _read_params(ckpt_dir, step, debug_log, before)
      break
    except _Raced:
      pass
    except (CheckpointError, OSError):    # a step gone under the listing (FileNotFoundError, NotADirectoryError)
      if _listing(ckpt_dir) == before:
        raise
    time.sleep(0.2 * (attempt + 1))
  else:
    who = _trainer(work)
    raise CheckpointError(f"the checkpoints in {ckpt_dir} changed while they were read, {RACE_RETRIES} times: a "
                          f"run{f' ({who})' if who else ''} is saving and rotating them (not damage); retry, or "
                          "read once it has finished")
  if merge and lora_of(config) is not None:
    params = merge_lora(config, params, work)
  return (config, params, used) if with_step else (config, params)
