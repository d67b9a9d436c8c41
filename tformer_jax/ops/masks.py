"""Boolean attention masks, True = "may attend". Shapes broadcast to (B, H, L, S).

Pure jax.numpy; no Flax. Combine masks with `combine_masks` (logical AND).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

Array = jnp.ndarray


def causal_mask(q_len: int, kv_len: int | None = None, *, offset: int = 0) -> Array:
  """(1, 1, L, S): query i (at absolute position offset+i) sees keys j <= offset+i."""
  kv_len = q_len if kv_len is None else kv_len
  q_pos = jnp.arange(q_len)[:, None] + offset
  k_pos = jnp.arange(kv_len)[None, :]
  return (k_pos <= q_pos)[None, None]


def causal_mask_from_positions(q_pos_BxL: Array, k_pos_BxS: Array) -> Array:
  """(B, 1, L, S) causal mask from explicit positions (left-padded batches, caches)."""
  return (k_pos_BxS[:, None, None, :] <= q_pos_BxL[:, None, :, None])


def padding_mask_from_lengths(lengths_B: Array, kv_len: int) -> Array:
  """(B, 1, 1, S): keys at index >= length are padding."""
  return (jnp.arange(kv_len)[None, :] < lengths_B[:, None])[:, None, None, :]


def padding_mask(kv_valid_BxS: Array) -> Array:
  """(B, 1, 1, S) from a (B, S) validity mask (1/True = real token)."""
  return kv_valid_BxS.astype(bool)[:, None, None, :]


def segment_mask(q_segment_BxL: Array, kv_segment_BxS: Array | None = None) -> Array:
  """(B, 1, L, S): tokens attend only within their segment; segment id 0 is padding."""
  kv_segment_BxS = q_segment_BxL if kv_segment_BxS is None else kv_segment_BxS
  same = q_segment_BxL[:, :, None] == kv_segment_BxS[:, None, :]
  return (same & (kv_segment_BxS[:, None, :] != 0))[:, None]


def sliding_window_mask(q_len: int, kv_len: int | None = None, *, window: int, offset: int = 0) -> Array:
  """(1, 1, L, S): causal, and query i sees only the last `window` keys (j > i - window)."""
  kv_len = q_len if kv_len is None else kv_len
  q_pos = jnp.arange(q_len)[:, None] + offset
  k_pos = jnp.arange(kv_len)[None, :]
  return ((k_pos <= q_pos) & (k_pos > q_pos - window))[None, None]


def local_window_mask(q_len: int, kv_len: int | None = None, *, window: int) -> Array:
  """(1, 1, L, S): bidirectional band |i - j| < window (Longformer-style local attention)."""
  kv_len = q_len if kv_len is None else kv_len
  d = jnp.arange(q_len)[:, None] - jnp.arange(kv_len)[None, :]
  return (jnp.abs(d) < window)[None, None]


def global_token_mask(q_len: int, kv_len: int | None = None, *, num_global: int) -> Array:
  """(1, 1, L, S): the first `num_global` tokens see and are seen by every token.

  OR this with a local/window mask: `local | global` (then AND with causal if needed).
  """
  kv_len = q_len if kv_len is None else kv_len
  q_glob = jnp.arange(q_len)[:, None] < num_global
  k_glob = jnp.arange(kv_len)[None, :] < num_global
  return (q_glob | k_glob)[None, None]


def random_block_mask(q_len: int, kv_len: int | None = None, *, block_size: int, num_random_blocks: int,
                      seed: int = 0) -> Array:
  """(1, 1, L, S): BigBird-style random attention. Each query block sees `num_random_blocks` key blocks,
  chosen without replacement by a seeded numpy RNG (static, so it is a compile-time constant)."""
  kv_len = q_len if kv_len is None else kv_len
  nq = -(-q_len // block_size)
  nk = -(-kv_len // block_size)
  rng = np.random.default_rng(seed)
  blocks = np.zeros((nq, nk), dtype=bool)
  for i in range(nq):
    chosen = rng.choice(nk, size=min(num_random_blocks, nk), replace=False)
    blocks[i, chosen] = True
  dense = np.repeat(np.repeat(blocks, block_size, 0), block_size, 1)[:q_len, :kv_len]
  return jnp.asarray(dense)[None, None]


def combine_masks(*masks: Array | None) -> Array | None:
  """Logical AND of the given masks (None entries ignored); None if all are None."""
  out = None
  for m in masks:
    if m is None:
      continue
    out = m if out is None else jnp.logical_and(out, m)
  return out
