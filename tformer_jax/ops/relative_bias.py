"""T5 relative position buckets and the (B, H, L, S) bias built from a learned (num_buckets, H) table.

Exact distances for small offsets, logarithmically wider buckets up to `max_distance`, one shared bucket
beyond. The rule and its float32 arithmetic follow T5 / transformers' `T5Attention._relative_position_bucket`.
"""
from __future__ import annotations

import math

import jax.numpy as jnp

Array = jnp.ndarray


def t5_relative_bucket(relative_position: Array, *, bidirectional: bool, num_buckets: int = 32,
                       max_distance: int = 128) -> Array:
  """Bucket ids (int32, same shape) for relative_position = key_pos - query_pos.

  bidirectional: half the buckets for keys after the query (positive offsets), half for keys before.
  Otherwise (causal decoder) only keys at or before the query get distinct buckets; later keys map to 0.
  """
  rel = jnp.asarray(relative_position).astype(jnp.int32)
  buckets = jnp.zeros_like(rel)
  if bidirectional:
    num_buckets //= 2
    buckets = buckets + (rel > 0).astype(jnp.int32) * num_buckets
    n = jnp.abs(rel)
  else:
    n = -jnp.minimum(rel, 0)
  max_exact = num_buckets // 2
  is_small = n < max_exact
  n_large = jnp.maximum(n, 1).astype(jnp.float32)  # log(0) is never selected; avoid -inf -> int casts
  scaled = (jnp.log(n_large / max_exact) / jnp.float32(math.log(max_distance / max_exact))
            * (num_buckets - max_exact))
  large = max_exact + scaled.astype(jnp.int32)  # truncation toward zero, like torch's .to(long)
  large = jnp.minimum(large, num_buckets - 1)
  return buckets + jnp.where(is_small, n, large)


def t5_bias(table_NBxH: Array, q_pos_BxL: Array, k_pos_BxS: Array, *, bidirectional: bool,
            num_buckets: int = 32, max_distance: int = 128) -> Array:
  """(B, H, L, S) additive bias table[bucket(k_pos - q_pos)] for explicit (possibly offset) positions."""
  if table_NBxH.shape[0] != num_buckets:
    raise ValueError(f"table has {table_NBxH.shape[0]} rows, expected num_buckets={num_buckets}")
  rel_BxLxS = k_pos_BxS[:, None, :] - q_pos_BxL[:, :, None]
  bucket_BxLxS = t5_relative_bucket(rel_BxLxS, bidirectional=bidirectional, num_buckets=num_buckets,
                                    max_distance=max_distance)
  bias_BxLxSxH = jnp.take(table_NBxH, bucket_BxLxS, axis=0)
  return jnp.transpose(bias_BxLxSxH, (0, 3, 1, 2))
