"""The KV cache: its shapes (traced once per model and size), storage dtype, bytes and a fresh zero cache."""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from tformer_jax.decode.compiled import _MAX_COMPILED, _model_key
from tformer_jax.ops import kv_quant

_SHAPES: dict[Any, Any] = {}


def _cache_shapes(model: nn.Module, batch_size: int, max_len: int) -> Any:
  key = (_model_key(model), int(batch_size), int(max_len))
  if key not in _SHAPES:   # tracing model.init takes a while: once per model and cache size
    tokens = jax.ShapeDtypeStruct((batch_size, max_len), jnp.int32)
    shapes = jax.eval_shape(lambda t: model.init(jax.random.PRNGKey(0), t, decode=True), tokens)
    if len(_SHAPES) >= _MAX_COMPILED:
      _SHAPES.pop(next(iter(_SHAPES)))
    _SHAPES[key] = shapes["cache"]
  return _SHAPES[key]


def with_cache_dtype(model: nn.Module, cache_dtype: str | None) -> nn.Module:
  """The model whose decode cache stores K/V as `cache_dtype` ('' = compute dtype | float32 |
  bfloat16 | int8); None keeps the model's own setting."""
  if cache_dtype is None or cache_dtype == getattr(model, "cache_dtype", ""):
    return model
  kv_quant.storage_dtype(cache_dtype, "float32")   # ValueError naming the choices
  return model.clone(cache_dtype=cache_dtype)


def cache_bytes(model: nn.Module, batch_size: int, max_len: int) -> int:
  """Bytes of the decode cache for `batch_size` rows of `max_len` slots (K/V, scales, index, mask)."""
  return kv_quant.tree_bytes(_cache_shapes(model, batch_size, max_len))


def init_cache(model: nn.Module, params: Any, batch_size: int, max_len: int) -> Any:
  """A fresh all-zero KV cache for `batch_size` rows of `max_len` slots (index 0, no valid keys)."""
  del params  # the cache shapes follow from the config alone
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), _cache_shapes(model, batch_size, max_len))
