"""A request's inputs and sampling: validation, prompt padding and buckets, the static sampling spec,
the state the step loop threads and one sampling step (`_emit`)."""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tformer_jax.ops import sampling

Array = jax.Array
_STOP_BUCKET = 4  # stop-token arrays are padded (with -1) to a multiple of this: fewer recompiles
MIN_PROMPT_BUCKET = 16


@dataclasses.dataclass(frozen=True)
class SamplingSpec:
  """The static (compile-time) part of the sampling settings."""
  greedy: bool
  top_k: int
  use_top_p: bool
  use_penalty: bool


class DecodeState(NamedTuple):
  """Everything the step loop threads through (a pytree)."""
  cache: Any
  logits_BxV: Array      # next-token logits
  seen_BxV: Array        # tokens seen so far (prompt + generated), for the repetition penalty
  pos_B: Array           # position of the next token fed (counted over real tokens)
  done_B: Array          # row has emitted a stop token
  lengths_B: Array       # generated tokens so far per row (stop token included)
  step: Array            # generated tokens so far (global)
  rng: Array


def prompt_positions(mask_BxP: Any) -> Array:
  """(B, P) positions counted over real tokens only (left padding gets 0)."""
  return jnp.maximum(jnp.cumsum(mask_BxP, axis=1) - 1, 0).astype(jnp.int32)


def start_state(cache: Any, logits_BxV: Array, tokens_BxP: Any, mask_BxP: Any, pos_B: Any, rng: Array,
                vocab: int) -> DecodeState:
  """The state a step loop starts from after a prompt: its tokens seen, nothing generated yet."""
  b = tokens_BxP.shape[0]
  return DecodeState(cache=cache, logits_BxV=logits_BxV,
                     seen_BxV=sampling.seen_mask(jnp.where(mask_BxP, tokens_BxP, -1), vocab),
                     pos_B=pos_B, done_B=jnp.zeros((b,), bool), lengths_B=jnp.zeros((b,), jnp.int32),
                     step=jnp.zeros((), jnp.int32), rng=rng)


def _cfg(model: nn.Module) -> Any:
  cfg = getattr(model, "cfg", None)
  if cfg is None:
    raise ValueError("generate needs a tformer_jax Transformer (a module with a `cfg` ModelConfig)")
  if not cfg.causal:
    raise ValueError("generation needs a causal decoder; this model has causal=False (an encoder)")
  if not cfg.lm_head:
    raise ValueError("generation needs logits; this model has lm_head=False")
  return cfg


def pad_prompts(prompt_tokens: Any, vocab_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Left-pad prompts to (B, P): (tokens_BxP, mask_BxP, lengths_B). Raises ValueError on bad input.

  `prompt_tokens`: a list of int sequences (variable lengths) or a 2-D integer array (all real).
  """
  if isinstance(prompt_tokens, (np.ndarray, jax.Array)):
    arr = np.asarray(prompt_tokens)
    if arr.ndim != 2:
      raise ValueError(f"prompt_tokens as an array must be 2-D (batch, length), got shape {arr.shape}")
    rows = list(arr)
  else:
    rows = [np.asarray(r) for r in prompt_tokens]
  if not rows:
    raise ValueError("empty prompt batch: pass at least one prompt")
  for i, r in enumerate(rows):
    if r.ndim != 1:
      raise ValueError(f"prompt {i} must be a flat sequence of token ids, got shape {r.shape}")
    if r.size == 0:
      raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
    if not np.issubdtype(r.dtype, np.integer):
      raise ValueError(f"prompt {i} must hold integer token ids, got dtype {r.dtype}")
    bad = r[(r < 0) | (r >= vocab_size)]
    if bad.size:
      raise ValueError(f"prompt {i} has token id {int(bad[0])} outside the vocabulary [0, {vocab_size})")
  lengths = np.array([r.size for r in rows], np.int32)
  p = int(lengths.max())
  tokens = np.zeros((len(rows), p), np.int32)
  mask = np.zeros((len(rows), p), bool)
  for i, r in enumerate(rows):
    tokens[i, p - r.size:] = r
    mask[i, p - r.size:] = True
  return tokens, mask, lengths


def _check(cfg: Any, p: int, max_new_tokens: Any, max_len: int | None, temperature: float, top_k: int,
           top_p: float, repetition_penalty: float, stop_tokens: Sequence[int]) -> int:
  """Validate the request; returns the number of cache slots S."""
  if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
  total = p + int(max_new_tokens)
  if max_len is not None and total > max_len:
    raise ValueError(f"prompt length {p} + max_new_tokens {max_new_tokens} = {total} exceeds "
                     f"max_len={max_len}")
  if cfg.position == "learned" and total > cfg.max_len:
    raise ValueError(f"prompt length {p} + max_new_tokens {max_new_tokens} = {total} exceeds the "
                     f"model's max_len={cfg.max_len} (learned positions cannot extrapolate)")
  if temperature < 0:
    raise ValueError(f"temperature must be >= 0, got {temperature}")
  if not isinstance(top_k, (int, np.integer)) or top_k < 0:
    raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {top_k!r}")
  if not 0.0 < top_p <= 1.0:
    raise ValueError(f"top_p must be in (0, 1], got {top_p}")
  if repetition_penalty <= 0:
    raise ValueError(f"repetition_penalty must be > 0, got {repetition_penalty}")
  for t in stop_tokens:
    if not 0 <= int(t) < cfg.vocab_size:
      raise ValueError(f"stop token {t} is outside the vocabulary [0, {cfg.vocab_size})")
  return total if max_len is None else int(max_len)


def _spec(temperature: float, top_k: int, top_p: float, repetition_penalty: float) -> SamplingSpec:
  return SamplingSpec(greedy=temperature <= sampling.GREEDY_TEMPERATURE, top_k=int(top_k),
                      use_top_p=top_p < 1.0, use_penalty=repetition_penalty != 1.0)


def _stop_array(stop_tokens: Sequence[int]) -> np.ndarray:
  n = -(-max(len(stop_tokens), 1) // _STOP_BUCKET) * _STOP_BUCKET
  out = np.full((n,), -1, np.int32)
  out[:len(stop_tokens)] = np.asarray(list(stop_tokens), np.int32)
  return out


def _rng(rng: Any) -> Array:
  if rng is None:
    return jax.random.PRNGKey(0)
  if isinstance(rng, (int, np.integer)):
    return jax.random.PRNGKey(int(rng))
  return rng


def _pick(spec: SamplingSpec, rng: Array, logits_BxV: Array, seen_BxV: Array, temperature: Array,
          top_p: Array, penalty: Array) -> Array:
  """Next tokens (B,) under the static spec and the traced temperature/top_p/penalty."""
  seen = seen_BxV if spec.use_penalty else None
  pen = penalty if spec.use_penalty else 1.0
  if spec.greedy:
    x = logits_BxV.astype(jnp.float32)
    if spec.use_penalty:
      x = sampling.repetition_penalty(x, seen, penalty)
    return jnp.argmax(x, axis=-1).astype(jnp.int32)
  return sampling.sample_next(rng, logits_BxV, temperature=temperature, top_k=spec.top_k,
                              top_p=top_p if spec.use_top_p else 1.0, penalty=pen, seen=seen)


def _emit(spec: SamplingSpec, st: DecodeState, stop_S: Array, knobs: tuple[Array, Array, Array],
          pad_id: Array) -> tuple[Array, DecodeState]:
  """Sample one token per row; returns (tokens_B, state with seen/done/lengths/step/rng updated)."""
  if sampling._is_batched_key(st.rng):      # one key per row: each row its own stream
    pair = jax.vmap(jax.random.split)(st.rng)
    rng, sub = pair[:, 0], pair[:, 1]
  else:
    rng, sub = jax.random.split(st.rng)
  tok_B = _pick(spec, sub, st.logits_BxV, st.seen_BxV, *knobs)
  live_B = ~st.done_B
  tok_B = jnp.where(live_B, tok_B, pad_id)
  b, v = st.seen_BxV.shape
  seen = st.seen_BxV | (jax.nn.one_hot(tok_B, v, dtype=jnp.bool_) & live_B[:, None])
  lengths = jnp.where(live_B, st.step + 1, st.lengths_B)
  done = st.done_B | (live_B & jnp.any(tok_B[:, None] == stop_S[None, :], axis=-1))
  return tok_B, st._replace(seen_BxV=seen, done_B=done, lengths_B=lengths, step=st.step + 1, rng=rng)


def prompt_bucket(p: int) -> int:
  """The padded prompt length compiled for a prompt of p tokens: the next power of two (>= 16)."""
  return max(MIN_PROMPT_BUCKET, 1 << (int(p) - 1).bit_length())
