"""Fine-tuning: `train.init_from` = a training workdir or `hf:DIR` (a Hugging Face model directory).

The run takes its architecture from the source: `with_source_architecture(cfg)` replaces every
architecture field of cfg.model (`ModelConfig.architecture`) by the source's and keeps the run's own
execution fields (dtype, scan_layers, remat, dropout, init: `config.NON_ARCHITECTURE_FIELDS`); the
data tokenizer becomes the source's (its token ids are what the weights know). `load_params` then
reads the weights, stacks unscanned layers when the run scans them, and checks every shape.

  tformer-train --config=configs/finetune_hf.py --config.train.init_from=hf:path/to/llama --workdir=runs/ft
"""
from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
from typing import Any

import jax
import ml_collections
import numpy as np

from tformer_jax import config as config_lib, decode
from tformer_jax.checkpoint import CheckpointError, restore_params
from tformer_jax.interop import hf

log = logging.getLogger("tformer_jax")
HF_PREFIX = "hf:"


def source_model_config(source: str) -> tuple[config_lib.ModelConfig, str | None]:
  """(the source's ModelConfig, its tokenizer spec or None), read without loading any weights."""
  if source.startswith(HF_PREFIX):
    path = pathlib.Path(source[len(HF_PREFIX):]).expanduser()
    hf_cfg = hf.read_hf_config(path)
    try:
      model = hf.model_config_from_hf(hf_cfg, hf.get_family(hf_cfg.get("model_type")))
    except hf.HFConfigError as e:
      raise hf.HFConfigError(f"train.init_from={source}: {e}") from None
    return model, (f"hf:{path}" if (path / "tokenizer.json").is_file() else None)
  cfg_path = pathlib.Path(source).expanduser() / "config.json"
  if not cfg_path.is_file():
    raise CheckpointError(f"train.init_from={source}: no config.json (not a training workdir)")
  src = ml_collections.ConfigDict(json.loads(cfg_path.read_text()))
  tok = src.get("data", {}).get("tokenizer")
  return config_lib.ModelConfig.from_config(src.model), (str(tok) if tok else None)


def with_source_architecture(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """cfg with the architecture (and tokenizer) of train.init_from; unchanged without one."""
  source = str(cfg.train.get("init_from", "") or "")
  if not source:
    return cfg
  theirs, tokenizer = source_model_config(source)
  ours = config_lib.ModelConfig.from_config(cfg.model)
  keep = {f: getattr(ours, f) for f in config_lib.NON_ARCHITECTURE_FIELDS}
  model = dataclasses.replace(theirs, **keep)
  out = cfg.copy_and_resolve_references()
  with out.unlocked():
    out.model = config_lib.to_configdict(model)
    if tokenizer and tokenizer != out.data.tokenizer:
      log.info("train.init_from: data.tokenizer %s -> %s (the source's)", out.data.tokenizer, tokenizer)
      out.data.tokenizer = tokenizer
    if out.data.seq_len > model.max_len and model.position == "learned":
      out.data.seq_len = model.max_len
  changed = sorted(k for k, v in model.architecture().items() if ours.architecture().get(k) != v)
  if changed:
    log.info("train.init_from: architecture from %s (%s)", source, ", ".join(changed[:12])
             + (" ..." if len(changed) > 12 else ""))
  return out


def load_params(source: str, abstract_params: Any, num_layers: int) -> Any:
  """The source's parameters in the layout and shardings of `abstract_params`, checked shape by shape."""
  if source.startswith(HF_PREFIX):
    _, params = hf.load_hf(pathlib.Path(source[len(HF_PREFIX):]).expanduser())
  else:
    _, params = restore_params(source)
  params = jax.tree.map(np.asarray, params)
  if "layers" in abstract_params and "layers" not in params and "layers_0" in params:
    params = decode.stack_layers(params, num_layers)            # an unscanned source, a scanned run
  flat = lambda t: {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(t)[0]}  # noqa: E731
  ours, theirs = flat(abstract_params), flat(params)
  diffs = [f"{k}: ours {a.shape} vs {theirs[k].shape if k in theirs else 'missing'}"
           for k, a in ours.items() if k not in theirs or tuple(theirs[k].shape) != tuple(a.shape)]
  diffs += [f"{k}: not in this model" for k in theirs if k not in ours]
  if diffs:
    raise CheckpointError(f"train.init_from={source}: parameters do not match this config: " + "; ".join(diffs[:8])
                          + (f" (+{len(diffs) - 8} more)" if len(diffs) > 8 else ""))
  leaves = [jax.device_put(np.asarray(theirs[k], a.dtype), a.sharding) for k, a in ours.items()]
  return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(abstract_params), leaves)
