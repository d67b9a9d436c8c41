"""Loading a model for every command that runs one (generate, serve, eval, convert, bench, doctor, attention
maps): a training workdir, an HF directory, or a config file + random init.

Each loader returns (model, params, tokenizer). The workdir and HF loaders delegate to
`tformer_jax.checkpoint.restore_params` and `tformer_jax.interop.hf.load_hf`.
"""
from __future__ import annotations

import os
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from tformer_jax import config as config_lib
from tformer_jax.checkpoint import CheckpointError, restore_params
from tformer_jax.config import ModelConfig, load_config_file, validate_model  # noqa: F401 (re-exported)
from tformer_jax.data import pipeline
from tformer_jax.interop import hf
from tformer_jax.nn import Transformer


def model_from_config(cfg: Any) -> Transformer:
  """The Transformer of a config (ConfigDict or dict with a 'model' entry), validated."""
  m = ModelConfig.from_config(config_lib.resolved(cfg)["model"])   # vocab_size 0: the tokenizer's
  validate_model(m)
  return Transformer(m)


def tokenizer_from_config(cfg: Any) -> Any:
  """The tokenizer the run's batches were in: a prepared dataset's own, a synthetic task's vocabulary, else
  data.tokenizer ('bpe' from the cache, trained on the corpus if missing)."""
  data = cfg.get("data", {}) if hasattr(cfg, "get") else {}
  return pipeline.tokenizer_for(data)


def check_max_len(cfg: Any, max_len: int, flag: str = "--max_len") -> None:
  """ConfigError unless the model of `cfg` (a config with a 'model' entry) can represent `max_len` tokens: a
  learned position table has model.max_len rows and cannot extrapolate (0: the model's own max_len)."""
  model = cfg["model"] if "model" in cfg else None
  if model is None or not max_len:
    return
  if str(model.get("position", "")) == "learned" and int(max_len) > int(model.get("max_len", 0)):
    raise config_lib.ConfigError(
        f"{flag}={max_len} exceeds this model's max_len={int(model['max_len'])} (learned positions: its table "
        f"has {int(model['max_len'])} rows and cannot extrapolate); pass {flag}={int(model['max_len'])} or less")


def random_init(cfg: Any, seed: int = 0) -> tuple[Transformer, Any, Any]:
  """(model, randomly initialised params, tokenizer) of a config: for smoke tests and benchmarks."""
  model = model_from_config(cfg)
  tokens = jnp.zeros((1, min(8, model.cfg.max_len)), jnp.int32)
  params = nn.unbox(jax.jit(model.init)(jax.random.PRNGKey(seed), tokens)["params"])
  return model, params, tokenizer_from_config(cfg)


def check_params(model: Transformer, params: Any, source: str) -> Any:
  """params, if their tree and shapes are the model's; else a one-line CheckpointError listing the
  first differences (e.g. a config.json overridden with another architecture)."""
  tokens = jax.ShapeDtypeStruct((1, min(8, model.cfg.max_len)), jnp.int32)
  want = nn.unbox(jax.eval_shape(model.init, jax.random.PRNGKey(0), tokens)["params"])
  flat = lambda t: {jax.tree_util.keystr(k): tuple(jnp.shape(v))  # noqa: E731
                    for k, v in jax.tree_util.tree_flatten_with_path(t)[0]}
  ours, theirs = flat(want), flat(params)
  diffs = [f"{k}: config {s} vs checkpoint {theirs.get(k, 'missing')}" for k, s in ours.items()
           if theirs.get(k) != s]
  diffs += [f"{k}: not in this config's model" for k in theirs if k not in ours]
  if diffs:
    more = f" (+{len(diffs) - 3} more)" if len(diffs) > 3 else ""
    raise CheckpointError(f"{source}: the parameters do not fit the config's model: "
                          + "; ".join(diffs[:3]) + more)
  return params


def load_for_inference(workdir: str | os.PathLike) -> tuple[Transformer, Any, Any]:
  """(model, params, tokenizer) from a training workdir (config.json + latest Orbax checkpoint)."""
  cfg, params = restore_params(workdir)
  model = model_from_config(cfg)
  return model, check_params(model, params, str(workdir)), tokenizer_from_config(cfg)


def load_hf(path: str | os.PathLike) -> tuple[Transformer, Any, Any]:
  """(model, params, tokenizer) from a Hugging Face model directory (its tokenizer.json)."""
  model, params = hf.load_hf(path)
  return model, params, hf.load_hf_tokenizer(path)
