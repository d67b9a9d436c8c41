"""Boolean attention masks, True = "may attend". Shapes broadcast to (B, H, L, S).

`Visibility` is the one description of which keys a query sees (causal, sliding window, global
tokens, BigBird random blocks, padding, segments) and `band` its one rule on query-key distances: every attention
implementation (the dense reference, `ops.blockwise`, `ops.chunked_attention`, the C++ CPU kernel
through `chunked_attention.chunk_table`) consumes these. The builders below are the same rule
spelled as dense masks, for users who want one. Pure jax.numpy; no Flax.
"""
from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np

Array = jnp.ndarray


def band(dist_QxS, *, causal: bool, window: int, xp=jnp):
  """The structural rule on distances dist = q_pos - k_pos: causal keeps dist >= 0, a window w
  keeps dist < w (|dist| < w when not causal). None when everything is visible. `xp` = jnp or np
  (np gives a static mask: chunked attention skips fully visible tiles with it)."""
  mask = None
  if causal:
    mask = dist_QxS >= 0
    if window > 0:
      mask = mask & (dist_QxS < window)
  elif window > 0:
    mask = xp.abs(dist_QxS) < window
  return mask


@functools.lru_cache(maxsize=32)
def random_block_table(num_q_blocks: int, num_k_blocks: int, num_random_blocks: int, seed: int) -> np.ndarray:
  """(Q blocks, K blocks) bool: query block i sees `num_random_blocks` key blocks, drawn without
  replacement by numpy's default_rng(seed), one block row after another (a static constant)."""
  rng = np.random.default_rng(seed)
  blocks = np.zeros((num_q_blocks, num_k_blocks), dtype=bool)
  for i in range(num_q_blocks):
    blocks[i, rng.choice(num_k_blocks, size=min(num_random_blocks, num_k_blocks), replace=False)] = True
  blocks.setflags(write=False)
  return blocks


@dataclasses.dataclass(frozen=True)
class RandomBlocks:
  """BigBird's random attention as a rule on positions: `random_block_mask(length, length)` of the
  whole context, so every call (training windows, a query decoding at any cache slot) sees the same
  pattern. Position p lies in block p // size; positions past `length` share the last block."""
  num: int
  size: int
  seed: int
  length: int

  def visible(self, q_pos: Array, k_pos: Array) -> Array:
    """Broadcast bool: key position k_pos lies in one of q_pos's random key blocks."""
    n = -(-self.length // self.size)
    table = jnp.asarray(random_block_table(n, n, self.num, self.seed))
    last = n - 1
    return table[jnp.minimum(q_pos // self.size, last), jnp.minimum(k_pos // self.size, last)]


@dataclasses.dataclass(frozen=True)
class Visibility:
  """Which keys each query may see. Query i of a call sits at position q_offset + i, key j at j.

  causal: j <= p; window w > 0 adds j > p - w (|p - j| < w when not causal); the first
  `num_global` positions see and are seen by every token (with a window; dense paths only);
  `random` (with a window; dense paths only): each query block also sees its random key blocks
  (BigBird = window + global + random; causal still hides the later keys of those blocks);
  kv_valid_BxS: False = padding, never seen; with segment ids a query sees only keys of its own
  segment, segment 0 being padding. q_offset is a Python int, or a traced scalar when decoding
  into a cache. kv_positions_BxS: key j's index is kv_positions_BxS[b, j] instead of j (a sliding-window
  layer's ring cache; dense paths only)."""
  causal: bool = True
  window: int = 0
  num_global: int = 0
  random: RandomBlocks | None = None
  q_offset: int | Array = 0
  kv_valid_BxS: Array | None = None
  q_segment_ids_BxL: Array | None = None
  kv_segment_ids_BxS: Array | None = None
  kv_positions_BxS: Array | None = None

  @property
  def static_offset(self) -> bool:
    return isinstance(self.q_offset, (int, np.integer))

  @property
  def is_plain_causal(self) -> bool:
    """Causal with nothing else (kernels with a causal mode need no mask tensor)."""
    return (self.causal and not self.window and self.random is None and self.kv_valid_BxS is None
            and self.q_segment_ids_BxL is None and self.static_offset and self.q_offset == 0
            and self.kv_positions_BxS is None)

  def structural(self, l: int, s: int) -> Array | None:
    """(L, S) mask from causality, window, global tokens and random blocks ((B, L, S) with per-row key
    positions); None if everything is visible."""
    q = self.q_offset + jnp.arange(l)[:, None]
    if self.kv_positions_BxS is not None:   # per-row key indices: a (B, L, S) structure
      q, k = q[None], self.kv_positions_BxS[:, None, :]
    else:
      k = jnp.arange(s)[None, :]
    if not (self.window and (self.num_global or self.random is not None)):
      return band(q - k, causal=self.causal, window=self.window)
    # global tokens and random blocks widen the window: inside it, or a global query or key, or a key
    # in one of the query's random blocks (still causal if causal)
    mask = band(q - k, causal=False, window=self.window)
    if self.num_global:
      mask = mask | (q < self.num_global) | (k < self.num_global)
    if self.random is not None:
      mask = mask | self.random.visible(q, k)
    return mask & (q >= k) if self.causal else mask

  def mask(self, l: int, s: int) -> Array | None:
    """The whole dense mask (B|1, 1, L, S), or None if every key is visible to every query."""
    m = self.structural(l, s)
    m = None if m is None else m[:, None] if m.ndim == 3 else m[None, None]
    if self.kv_valid_BxS is not None:
      m = combine_masks(m, padding_mask(self.kv_valid_BxS))
    if self.q_segment_ids_BxL is not None:
      m = combine_masks(m, segment_mask(self.q_segment_ids_BxL, self.kv_segment_ids_BxS))
    return m


def causal_mask(q_len: int, kv_len: int | None = None, *, offset: int = 0) -> Array:
  """(1, 1, L, S): query i (at absolute position offset+i) sees keys j <= offset+i."""
  kv_len = q_len if kv_len is None else kv_len
  dist = jnp.arange(q_len)[:, None] + offset - jnp.arange(kv_len)[None, :]
  return band(dist, causal=True, window=0)[None, None]


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
  dist = jnp.arange(q_len)[:, None] + offset - jnp.arange(kv_len)[None, :]
  return band(dist, causal=True, window=window)[None, None]


def local_window_mask(q_len: int, kv_len: int | None = None, *, window: int) -> Array:
  """(1, 1, L, S): bidirectional band |i - j| < window (Longformer-style local attention)."""
  kv_len = q_len if kv_len is None else kv_len
  dist = jnp.arange(q_len)[:, None] - jnp.arange(kv_len)[None, :]
  return band(dist, causal=False, window=window)[None, None]


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
  blocks = random_block_table(-(-q_len // block_size), -(-kv_len // block_size), num_random_blocks, seed)
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
