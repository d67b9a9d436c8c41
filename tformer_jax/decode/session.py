"""Continuing a cache: `append_tokens` at the cache's offset and `Session`, one conversation across turns."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tformer_jax.decode.cache import init_cache, with_cache_dtype
from tformer_jax.decode.compiled import _aot, _model_key
from tformer_jax.decode.generation import _loop_fn
from tformer_jax.decode.layout import decode_layout
from tformer_jax.decode.request import DecodeState, _cfg, _check, _rng, _spec, _stop_array, prompt_bucket
from tformer_jax.ops import sampling
from tformer_jax.ops.attention import soft_cap

Array = jax.Array


def _append_fn(model: nn.Module, all_logits: bool) -> Callable:
  """Feed tokens_BxN (the first n_real real, the rest right padding) at cache slot `start` = position."""

  cap = _cfg(model).final_logit_softcap

  def run(params, cache, tokens_BxN, n_real, start):
    b, n = tokens_BxN.shape
    mask_BxN = jnp.broadcast_to(jnp.arange(n) < n_real, (b, n))
    positions_BxN = jnp.broadcast_to(start + jnp.arange(n, dtype=jnp.int32), (b, n))
    (h_BxNxD, unembed_DxV), upd = model.apply(
        {"params": params, "cache": cache}, tokens_BxN, positions_BxL=positions_BxN,
        attention_mask_BxL=mask_BxN, decode=True, return_hidden=True, mutable=["cache"])
    new_cache = dict(upd["cache"])
    new_cache["index"] = (start + n_real).astype(jnp.int32)   # the padding's slots are written again next
    if all_logits:
      return new_cache, soft_cap(jnp.einsum("bnd,dv->bnv", h_BxNxD, unembed_DxV).astype(jnp.float32), cap)
    h_BxD = jax.lax.dynamic_index_in_dim(h_BxNxD, n_real - 1, axis=1, keepdims=False)
    return new_cache, soft_cap(jnp.einsum("bd,dv->bv", h_BxD, unembed_DxV).astype(jnp.float32), cap)
  return run


def append_tokens(model: nn.Module, params: Any, cache: Any, tokens_BxN: np.ndarray, start: int, *,
                  all_logits: bool = False) -> tuple[Any, Array]:
  """Feed tokens into a cache whose rows hold `start` tokens (no padding: slot = position).

  Returns (cache, logits): the last token's (B, V) float32 logits, or every fed token's (B, N, V)
  with all_logits. The feed is right-padded to `prompt_bucket(N)` (capped by the free slots) so
  calls of similar lengths share one executable; positions and ALiBi/T5 distances follow the cache.
  """
  tokens_BxN = np.asarray(tokens_BxN, np.int32)
  b, n = tokens_BxN.shape
  slots = int(cache["kv_valid"].shape[1])
  if start + n > slots:
    raise ValueError(f"{start} tokens in the cache + {n} new = {start + n} exceed its {slots} slots")
  padded = max(n, min(prompt_bucket(n), slots - start))
  feed = np.zeros((b, padded), np.int32)
  feed[:, :n] = tokens_BxN
  args = (params, cache, feed, np.int32(n), np.int32(start))
  cache, logits = _aot("append", (_model_key(model), all_logits), _append_fn(model, all_logits), *args)(*args)
  return cache, (logits[:, :n] if all_logits else logits)


class Session:
  """One conversation: a KV cache of `max_len` slots kept across turns.

  `append(tokens)` feeds tokens after everything already in the cache (positions continue) and
  returns the next-token logits; `generate(n, ...)` samples from there, the generated tokens staying
  in the conversation; `reset()` starts a new conversation on a fresh zero cache (nothing of the old
  one is visible). The last generated token is fed lazily, by the next append or generate.
  """

  def __init__(self, model: nn.Module, params: Any, *, max_len: int, cache_dtype: str | None = None,
               scan_layers: bool | None = None):
    self.cfg = _cfg(model)
    if max_len < 1:
      raise ValueError(f"max_len must be >= 1, got {max_len}")
    if self.cfg.position == "learned" and max_len > self.cfg.max_len:
      raise ValueError(f"max_len={max_len} exceeds the model's max_len={self.cfg.max_len} "
                       "(learned positions cannot extrapolate)")
    self.model, self.params = decode_layout(with_cache_dtype(model, cache_dtype), nn.unbox(params),
                                            scan_layers)
    self.max_len = int(max_len)
    self.reset()

  def reset(self) -> None:
    """Forget the conversation: a fresh all-zero cache."""
    self.cache = init_cache(self.model, None, 1, self.max_len)
    self.fed: list[int] = []        # tokens in the cache
    self.pending: list[int] = []    # generated, not yet fed
    self.logits: np.ndarray | None = None   # (V,) after the last fed token

  @property
  def tokens(self) -> list[int]:
    """The whole conversation so far (fed + pending)."""
    return self.fed + self.pending

  def rewind(self, n: int) -> None:
    """Keep only the first n tokens of the conversation (e.g. a reply cut at a stop string); the
    slots after them are rewritten by the next call and never seen before (causal attention)."""
    if not 0 <= n <= len(self.tokens):
      raise ValueError(f"rewind to {n}: the conversation has {len(self.tokens)} tokens")
    if n == len(self.tokens):
      return
    kept = self.tokens[:n]
    self.fed, self.pending = kept[:-1], kept[-1:]    # the last kept token is fed again: its logits
    self.cache = dict(self.cache, index=jnp.asarray(len(self.fed), jnp.int32))
    self.logits = None

  def append(self, tokens: Sequence[int], *, all_logits: bool = False) -> np.ndarray:
    """Feed tokens; returns the next-token logits (V,) float32 (or (N, V) for every new token,
    the pending generated token first if there is one)."""
    new = self.pending + [int(t) for t in np.asarray(tokens, np.int64).reshape(-1)]
    if not new:
      raise ValueError("append needs at least one token")
    bad = [t for t in new if not 0 <= t < self.cfg.vocab_size]
    if bad:
      raise ValueError(f"token id {bad[0]} outside the vocabulary [0, {self.cfg.vocab_size})")
    if len(self.fed) + len(new) > self.max_len:
      raise ValueError(f"conversation of {len(self.fed) + len(new)} tokens exceeds the session's "
                       f"max_len={self.max_len}")
    self.cache, logits = append_tokens(self.model, self.params, self.cache, np.asarray([new]),
                                       len(self.fed), all_logits=all_logits)
    self.fed, self.pending = self.fed + new, []
    self.logits = np.asarray(logits[0, -1] if all_logits else logits[0])
    return np.asarray(logits[0])

  def generate(self, max_new_tokens: int, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
               repetition_penalty: float = 1.0, stop_tokens: Sequence[int] = (), rng: Any = None,
               chunk_size: int = 16) -> np.ndarray:
    """Sample up to max_new_tokens tokens continuing the conversation (a stop token ends it and is
    kept); returns them (n,) int32. They become part of the conversation."""
    if self.pending or self.logits is None:
      if not self.fed and not self.pending:
        raise ValueError("generate needs a prompt: append tokens first")
      self.append([])
    start = len(self.fed)
    _check(self.cfg, start, max_new_tokens, self.max_len, temperature, top_k, top_p,
           repetition_penalty, stop_tokens)
    spec = _spec(temperature, top_k, top_p, repetition_penalty)
    knobs = (np.float32(temperature), np.float32(top_p), np.float32(repetition_penalty))
    seen = sampling.seen_mask(jnp.asarray([self.fed], jnp.int32), self.cfg.vocab_size)
    st = DecodeState(cache=self.cache, logits_BxV=jnp.asarray(self.logits)[None], seen_BxV=seen,
                     pos_B=jnp.asarray([start], jnp.int32), done_B=jnp.zeros((1,), bool),
                     lengths_B=jnp.zeros((1,), jnp.int32), step=jnp.zeros((), jnp.int32), rng=_rng(rng))
    out: list[np.ndarray] = []
    left = int(max_new_tokens)
    while left > 0 and not bool(st.done_B[0]):
      n = min(chunk_size, left)
      left -= n
      key = (_model_key(self.model), spec, chunk_size, True)
      args = (self.params, st, np.int32(n), _stop_array(stop_tokens), np.int32(0), *knobs)
      st, chunk = _aot("decode_loop", key, _loop_fn(self.model, spec, chunk_size, True), *args)(*args)
      out.append(np.asarray(chunk)[0])
    made = np.concatenate(out)[:int(st.lengths_B[0])].astype(np.int32)
    # every generated token but the last is in the cache; the last is fed by the next call
    cache = dict(st.cache)
    cache["index"] = jnp.asarray(start + made.size - 1, jnp.int32)
    self.cache, self.fed, self.pending, self.logits = cache, self.fed + made[:-1].tolist(), [int(made[-1])], None
    return made
