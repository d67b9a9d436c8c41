"""`restore_params`: a workdir's parameters for inference (a LoRA run's adapters merged into the base they were
trained on)."""
from __future__ import annotations

import json
import os
from typing import Any

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from tformer_jax.checkpoint.common import CHECKPOINT_DIR, MANIFEST, META, STATE, CheckpointError, PyTree, _path
from tformer_jax.checkpoint.integrity import _check_items, _verify_arrays
from tformer_jax.checkpoint.logs import _NOISE, _debug_log_path, _short
from tformer_jax.checkpoint.manager import _first_good, _registry, _state_tree

CONFIG_FILE = "config.json"


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
