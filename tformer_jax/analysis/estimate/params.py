"""Exact sizes from shapes (nothing allocated): the parameters, the optimizer state, the LoRA adapters
and the kernels they adapt, the decode KV cache."""
from __future__ import annotations

import math
from typing import Any

import jax

from tformer_jax.analysis import flops as flops_lib
from tformer_jax.config import ModelConfig, default_config
from tformer_jax.ops import kv_quant, lora as lora_ops
from tformer_jax.train import optim, precision

param_shapes = flops_lib.param_shapes       # the parameter tree as ShapeDtypeStructs (nothing is allocated)


def _leaves(m: ModelConfig) -> list[tuple[list[str], Any]]:
  return [([str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)], x)
          for path, x in jax.tree_util.tree_flatten_with_path(param_shapes(m))[0]]


def param_count(m: ModelConfig) -> int:
  """Exact number of parameters of the model."""
  return int(sum(math.prod(x.shape) for x in jax.tree.leaves(param_shapes(m))))


def compute_cast_params(m: ModelConfig) -> int:
  """Parameters the train step casts to the compute dtype once per step (precision.cast_for_compute)."""
  return sum(math.prod(x.shape) for keys, x in _leaves(m) if keys[-1] in precision.COMPUTE_CAST_NAMES)


def layer_params(m: ModelConfig) -> int:
  return sum(math.prod(x.shape) for keys, x in _leaves(m) if keys[0].startswith(("layers", "dense_layers")))


def optimizer_state_bytes(m: ModelConfig, optim_cfg: Any = None) -> int:
  """Bytes of the optimizer state of m's parameters (exact: jax.eval_shape of the optimizer's init)."""
  tx, _ = optim.make_optimizer(optim_cfg if optim_cfg is not None else default_config().optim, 1000)
  state = jax.eval_shape(tx.init, param_shapes(m))
  return int(sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(state)))


def lora_shapes(m: ModelConfig, lora: tuple[tuple[str, ...], int]) -> tuple[int, int]:
  """(adapter parameters, parameters of the kernels they adapt) of train.lora on m (ops/lora.py)."""
  shapes = param_shapes(m)
  adapters = jax.eval_shape(lambda p: lora_ops.init(jax.random.PRNGKey(0), p, lora[0], lora[1]), shapes)
  targeted = sum(math.prod(w.shape) for _, w, _, _ in lora_ops._targeted(shapes, lora[0]))
  return int(sum(math.prod(x.shape) for x in jax.tree.leaves(adapters))), int(targeted)


def kv_cache_bytes(num_layers: int, batch: int, length: int, kv_heads: int, head_dim: int,
                   bytes_per_elem: int = 2) -> int:
  """2 (K, V) * layers * batch * length * kv_heads * head_dim * bytes."""
  return 2 * num_layers * batch * length * kv_heads * head_dim * bytes_per_elem


def kv_cache_bytes_as(m: ModelConfig, batch: int, length: int, cache_dtype: str) -> int:
  """The decode cache's K/V bytes stored as `cache_dtype` (decode.cache_dtype: '' = the compute dtype,
  bfloat16, int8 with its per-token-and-head scales: ops/kv_quant.py)."""
  return batch * length * kv_quant.cache_bytes_per_token(m.num_layers, m.kv_heads, m.hd, cache_dtype, m.dtype)
