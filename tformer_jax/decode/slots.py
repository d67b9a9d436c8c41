"""Cache slots for continuous batching: one-row caches stacked, and one step for every slot at once."""
from __future__ import annotations

import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tformer_jax.decode.cache import _cache_shapes
from tformer_jax.decode.compiled import _aot, _model_key
from tformer_jax.ops import sampling

Array = jax.Array


def slot_caches(model: nn.Module, num_slots: int, max_len: int) -> Any:
  """`num_slots` independent one-row caches stacked on a leading axis (each with its own index)."""
  one = _cache_shapes(model, 1, max_len)
  return jax.tree.map(lambda s: jnp.zeros((num_slots, *s.shape), s.dtype), one)


@functools.partial(jax.jit, donate_argnums=0)
def set_slot(caches: Any, i: Any, cache: Any) -> Any:
  """caches with slot i replaced by the one-row `cache` (one executable for every slot; `caches` is
  donated: updated in place)."""
  return jax.tree.map(lambda c, x: jax.lax.dynamic_update_index_in_dim(c, x, i, 0), caches, cache)


def slot_buckets(num_slots: int) -> list[int]:
  """The slot-count branches of the step: powers of two below num_slots, then num_slots."""
  return [b for b in (1 << i for i in range(num_slots.bit_length())) if b < num_slots] + [num_slots]


def _slot_step_fn(model: nn.Module, num_slots: int, k: int) -> Callable:
  """The step on slots [0, k) of num_slots (the others keep their state)."""
  vocab = model.cfg.vocab_size

  def feed_one(params, cache, tok):
    pos = cache["index"]
    logits_1x1xV, upd = model.apply({"params": params, "cache": cache}, jnp.reshape(tok, (1, 1)),
                                    positions_BxL=jnp.reshape(pos, (1, 1)),
                                    attention_mask_BxL=jnp.ones((1, 1), bool), decode=True, mutable=["cache"])
    return upd["cache"], logits_1x1xV[0, 0]

  def step(params, caches, logits_SxV, keys_Sx2, counts_S, temperature_S, top_p_S, active_S):
    sub = jax.tree.map(lambda c: c[:k], caches)
    keys = jax.vmap(jax.random.fold_in)(keys_Sx2[:k], counts_S[:k])
    tok_K = sampling.sample_next(keys, logits_SxV[:k], temperature=temperature_S[:k], top_p=top_p_S[:k])
    tok_K = jnp.where(active_S[:k], jnp.clip(tok_K, 0, vocab - 1), 0)
    sub, logits_KxV = jax.vmap(feed_one, in_axes=(None, 0, 0))(params, sub, tok_K)
    sub = dict(sub)
    sub["index"] = jnp.where(active_S[:k], sub["index"], 0)   # idle slots stay at slot 0
    caches = jax.tree.map(lambda c, x: jax.lax.dynamic_update_slice_in_dim(c, x, 0, 0), caches, sub)
    logits_SxV = jax.lax.dynamic_update_slice_in_dim(logits_SxV, logits_KxV.astype(logits_SxV.dtype), 0, 0)
    return caches, logits_SxV, jnp.zeros((num_slots,), jnp.int32).at[:k].set(tok_K)
  return step


def slot_step(model: nn.Module, params: Any, caches: Any, logits_SxV: Any, keys_Sx2: Any, counts_S: Any,
              temperature_S: Any, top_p_S: Any, active_S: Any) -> tuple[Any, Array, Array]:
  """One decode step for every slot at once (one executable whatever the slots hold): sample slot
  s's next token from logits_SxV[s] with its own key (fold_in(key, count): a request's tokens
  depend on its seed and its own logits only), feed it at the slot's own position, return
  (caches, next logits, tokens). Only slots [0, k) are computed, k the smallest of `slot_buckets`
  covering the last active slot, so a lone request does not pay for idle slots: one executable per
  bucket (log2(slots) + 1 of them, the same whatever the requests; `Engine.warmup` compiles them
  all); inactive slots below k compute garbage that is never read. `caches` is donated: updated in
  place, the array passed in is invalid afterwards."""
  active = np.asarray(active_S)
  num_slots = int(active.shape[0])
  live = int(np.max(np.nonzero(active)[0], initial=-1)) + 1
  k = next(b for b in slot_buckets(num_slots) if b >= live)
  args = (params, caches, logits_SxV, keys_Sx2, counts_S, temperature_S, top_p_S, active)
  fn = _slot_step_fn(model, num_slots, k)
  return _aot("slot_step", (_model_key(model), k), fn, *args, donate=(1,))(*args)
