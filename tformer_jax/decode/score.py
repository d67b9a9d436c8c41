"""Teacher-forced scoring through the decode cache, one token at a time (what a quantized cache costs)."""
from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tformer_jax.decode.cache import _cache_shapes, with_cache_dtype
from tformer_jax.decode.compiled import _aot, _model_key
from tformer_jax.decode.layout import decode_layout


def _score_fn(model: nn.Module) -> Callable:
  def run(params, tokens_BxL):
    b, l = tokens_BxL.shape
    cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), _cache_shapes(model, b, l))

    def body(cache, t):
      feed_Bx1 = jax.lax.dynamic_slice_in_dim(tokens_BxL, t, 1, axis=1)
      logits_Bx1xV, upd = model.apply({"params": params, "cache": cache}, feed_Bx1,
                                      positions_BxL=jnp.full((b, 1), t, jnp.int32),
                                      attention_mask_BxL=jnp.ones((b, 1), bool), decode=True,
                                      mutable=["cache"])
      logp_BxV = jax.nn.log_softmax(logits_Bx1xV[:, 0].astype(jnp.float32), axis=-1)
      target_B = jax.lax.dynamic_index_in_dim(tokens_BxL, t + 1, axis=1, keepdims=False)
      return upd["cache"], jnp.take_along_axis(logp_BxV, target_B[:, None], axis=-1)[:, 0]

    _, logp_LxB = jax.lax.scan(body, cache, jnp.arange(l - 1))
    return logp_LxB.T
  return run


def cache_logprobs(model: nn.Module, params: Any, tokens_BxL: Any, *, cache_dtype: str | None = None,
                   scan_layers: bool | None = None) -> np.ndarray:
  """Teacher-forced log p(token t+1 | tokens <= t) (B, L-1), fed one token at a time through the
  decode cache (so a quantized cache's error is what is measured)."""
  tokens_BxL = np.asarray(tokens_BxL, np.int32)
  model, params = decode_layout(with_cache_dtype(model, cache_dtype), nn.unbox(params), scan_layers)
  args = (params, tokens_BxL)
  return np.asarray(_aot("score", _model_key(model), _score_fn(model), *args)(*args))
