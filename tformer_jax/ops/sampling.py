"""Pure logits processors and next-token sampling. jax.numpy only; all jit-friendly.

Logits are (..., V) (usually logits_BxV). Argument kinds under jit:
  temperature, top_p, penalty: Python floats or traced float arrays, scalar or per-row (B,).
  top_k: a static Python int (fast path: lax.top_k; 0 = off) or a traced int array, scalar or
    (B,) (rank path via a sort; <= 0 = off for that row).
Filtered-out logits are set to `mask_value(dtype)`, the dtype's most negative finite number, so
softmax gives them probability 0 without producing NaNs. The order used by `process_logits`
(as in HF transformers) is: repetition penalty, temperature, top-k, top-p.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

# temperature <= GREEDY_TEMPERATURE means greedy argmax in `sample_next`.
GREEDY_TEMPERATURE = 1e-5


def mask_value(dtype: Any) -> Array:
  """The value filtered logits get: the most negative finite number of `dtype`."""
  return jnp.asarray(jnp.finfo(dtype).min, dtype)


def _per_row(x: Any, logits: Array) -> Array:
  """A scalar stays scalar; a per-row (...,) value gets a trailing axis to broadcast over V."""
  x = jnp.asarray(x)
  return x if x.ndim == 0 else x[..., None]


def _scatter_rows(values_NxV: Array, order_NxV: Array) -> Array:
  """out[n, order[n, j]] = values[n, j]: undoes a per-row permutation (e.g. a sort)."""
  n = values_NxV.shape[0]
  out = jnp.zeros_like(values_NxV)
  return out.at[jnp.arange(n)[:, None], order_NxV].set(values_NxV)


def apply_temperature(logits: Array, temperature: Any) -> Array:
  """logits / temperature (clamped below at GREEDY_TEMPERATURE to avoid dividing by 0)."""
  t = jnp.maximum(_per_row(temperature, logits), GREEDY_TEMPERATURE)
  return (logits / t).astype(logits.dtype)


def top_k_filter(logits: Array, k: Any) -> Array:
  """Keep exactly the k largest logits per row (ties: lower index first); k <= 0 or >= V = off."""
  vocab = logits.shape[-1]
  flat_NxV = logits.reshape(-1, vocab)
  if isinstance(k, (int, np.integer)):
    k = int(k)
    if k <= 0 or k >= vocab:
      return logits
    _, idx_NxK = jax.lax.top_k(flat_NxV, k)
    rows = jnp.arange(flat_NxV.shape[0])[:, None]
    keep_NxV = jnp.zeros(flat_NxV.shape, bool).at[rows, idx_NxK].set(True)
  else:
    k_N = jnp.broadcast_to(jnp.asarray(k, jnp.int32).reshape(-1, 1), (flat_NxV.shape[0], 1))
    order_NxV = jnp.argsort(flat_NxV, axis=-1, descending=True, stable=True)
    rank_NxV = _scatter_rows(jnp.broadcast_to(jnp.arange(vocab), flat_NxV.shape), order_NxV)
    keep_NxV = (rank_NxV < k_N) | (k_N <= 0)
  out = jnp.where(keep_NxV, flat_NxV, mask_value(logits.dtype))
  return out.reshape(logits.shape)


def top_p_filter(logits: Array, p: Any) -> Array:
  """Nucleus filter: keep the smallest top set whose probability mass is >= p.

  A token (in descending order) is kept iff the mass strictly before it is < p, so the top token
  is always kept (also for p <= 0); p >= 1 keeps everything.
  """
  vocab = logits.shape[-1]
  flat_NxV = logits.reshape(-1, vocab)
  p_N = jnp.broadcast_to(jnp.asarray(p, jnp.float32).reshape(-1, 1), (flat_NxV.shape[0], 1))
  order_NxV = jnp.argsort(flat_NxV, axis=-1, descending=True, stable=True)
  sorted_NxV = jnp.take_along_axis(flat_NxV, order_NxV, axis=-1).astype(jnp.float32)
  probs_NxV = jax.nn.softmax(sorted_NxV, axis=-1)
  cum_NxV = jnp.cumsum(probs_NxV, axis=-1)
  before_NxV = jnp.concatenate([jnp.zeros_like(cum_NxV[:, :1]), cum_NxV[:, :-1]], axis=-1)
  keep_sorted_NxV = (before_NxV < p_N) | (p_N >= 1.0)
  keep_sorted_NxV = keep_sorted_NxV.at[:, 0].set(True)
  keep_NxV = _scatter_rows(keep_sorted_NxV, order_NxV)
  out = jnp.where(keep_NxV, flat_NxV, mask_value(logits.dtype))
  return out.reshape(logits.shape)


def seen_mask(history_BxT: Array, vocab_size: int) -> Array:
  """(B, V) bool: True for every token id in the history; negative ids (padding) are ignored."""
  b = history_BxT.shape[0]
  ids_BxT = jnp.where(history_BxT >= 0, history_BxT, vocab_size)   # out of range -> dropped
  rows = jnp.arange(b)[:, None]
  return jnp.zeros((b, vocab_size), bool).at[rows, ids_BxT].set(True, mode="drop")


def repetition_penalty(logits_BxV: Array, seen: Array, penalty: Any) -> Array:
  """CTRL / HF rule on already-seen tokens: positive logits / penalty, negative * penalty.

  `seen` is a (B, V) bool mask or a (B, T) integer token history (negative ids ignored).
  penalty: scalar or (B,); 1.0 leaves the logits unchanged.
  """
  if not jnp.issubdtype(seen.dtype, jnp.bool_):
    seen = seen_mask(seen, logits_BxV.shape[-1])
  pen = _per_row(penalty, logits_BxV).astype(logits_BxV.dtype)
  penalised = jnp.where(logits_BxV > 0, logits_BxV / pen, logits_BxV * pen)
  return jnp.where(seen, penalised, logits_BxV)


def process_logits(logits_BxV: Array, *, temperature: Any = 1.0, top_k: Any = 0,
                   top_p: Any = 1.0, penalty: Any = 1.0, seen: Array | None = None) -> Array:
  """float32 logits of the sampling distribution: penalty, temperature, top-k, top-p.

  Static no-ops are skipped (top_k == 0, Python top_p >= 1, Python penalty == 1 or seen=None).
  """
  x = logits_BxV.astype(jnp.float32)
  if seen is not None and not (isinstance(penalty, (int, float)) and penalty == 1.0):
    x = repetition_penalty(x, seen, penalty)
  x = apply_temperature(x, temperature)
  x = top_k_filter(x, top_k)
  if not (isinstance(top_p, (int, float)) and top_p >= 1.0):
    x = top_p_filter(x, top_p)
  return x


def _is_batched_key(rng: Array) -> bool:
  """True for a batch of keys: typed keys of shape (B,) or raw uint32 keys of shape (B, 2)."""
  if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
    return rng.ndim == 1
  return rng.ndim == 2


def sample_next(rng: Array, logits_BxV: Array, *, temperature: Any = 1.0, top_k: Any = 0,
                top_p: Any = 1.0, penalty: Any = 1.0, seen: Array | None = None) -> Array:
  """Next tokens (B,) int32 from logits_BxV.

  temperature <= GREEDY_TEMPERATURE (per row when (B,)) is greedy: argmax of the penalised
  logits. `rng` is one key for the whole batch, or one key per request ((B,) typed keys or (B, 2)
  raw keys): then row b depends only on rng[b] and its own logits, whatever else is batched.
  """
  x = logits_BxV.astype(jnp.float32)
  if seen is not None and not (isinstance(penalty, (int, float)) and penalty == 1.0):
    x = repetition_penalty(x, seen, penalty)
  greedy_B = jnp.argmax(x, axis=-1).astype(jnp.int32)
  probs_logits = process_logits(x, temperature=temperature, top_k=top_k, top_p=top_p)
  if _is_batched_key(rng):
    sampled_B = jax.vmap(lambda r, lg: jax.random.categorical(r, lg))(rng, probs_logits)
  else:
    sampled_B = jax.random.categorical(rng, probs_logits, axis=-1)
  t = jnp.asarray(temperature, jnp.float32)
  return jnp.where(t <= GREEDY_TEMPERATURE, greedy_B, sampled_B.astype(jnp.int32))
