"""One-shot generation: a prefill call and a compiled step loop (`generate`, `generate_stream`), and the
no-cache baseline `generate_recompute`."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tformer_jax.decode import layer_prefill
from tformer_jax.decode.cache import init_cache, with_cache_dtype
from tformer_jax.decode.compiled import Compiling, _aot, _model_key, lower
from tformer_jax.decode.layout import decode_layout
from tformer_jax.decode.request import (
  DecodeState,
  SamplingSpec,
  _cfg,
  _check,
  _emit,
  _rng,
  _spec,
  _stop_array,
  pad_prompts,
  prompt_bucket,
  prompt_positions,
  start_state,
)
from tformer_jax.ops.attention import soft_cap

Array = jax.Array


def _prefill_fn(model: nn.Module, slots: int) -> Callable:
  def prefill(params, tokens_BxP, mask_BxP, lengths_B, rng):
    cache = init_cache(model, params, tokens_BxP.shape[0], slots)   # fresh per request
    # only the last position's logits are needed: no (B, P, vocab) logits
    (h_BxPxD, unembed_DxV), upd = model.apply({"params": params, "cache": cache}, tokens_BxP,
                                              positions_BxL=prompt_positions(mask_BxP),
                                              attention_mask_BxL=mask_BxP, decode=True, return_hidden=True,
                                              mutable=["cache"])
    logits_BxV = soft_cap(jnp.einsum("bd,dv->bv", h_BxPxD[:, -1], unembed_DxV).astype(jnp.float32),
                          model.cfg.final_logit_softcap)
    return start_state(upd["cache"], logits_BxV, tokens_BxP, mask_BxP, lengths_B, rng, model.cfg.vocab_size)
  return prefill


def _loop_fn(model: nn.Module, spec: SamplingSpec, chunk: int, feed_last: bool) -> Callable:
  """Up to n_steps (<= chunk) tokens: while-loop of (sample, forward), a final sample, and a final
  forward only if feed_last (streaming: the next chunk continues from the logits)."""

  vocab = model.cfg.vocab_size

  def forward(params, st, tok_B):
    feed_Bx1 = jnp.clip(tok_B, 0, vocab - 1)[:, None]   # stopped rows may hold any pad_id
    logits_Bx1xV, upd = model.apply({"params": params, "cache": st.cache}, feed_Bx1,
                                    positions_BxL=st.pos_B[:, None],
                                    attention_mask_BxL=jnp.ones((tok_B.shape[0], 1), bool),
                                    decode=True, mutable=["cache"])
    return st._replace(cache=upd["cache"], logits_BxV=logits_Bx1xV[:, 0], pos_B=st.pos_B + 1)

  def run(params, st, n_steps, stop_S, pad_id, temperature, top_p, penalty):
    knobs = (temperature, top_p, penalty)
    b = st.done_B.shape[0]
    out_BxC = jnp.full((b, chunk), pad_id, jnp.int32)

    def cond(carry):
      i, s, _ = carry
      return (i < n_steps - 1) & ~jnp.all(s.done_B)

    def body(carry):
      i, s, out = carry
      tok_B, s = _emit(spec, s, stop_S, knobs, pad_id)
      out = jax.lax.dynamic_update_slice(out, tok_B[:, None], (0, i))
      return i + 1, forward(params, s, tok_B), out

    i, st, out_BxC = jax.lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), st, out_BxC))
    all_done = jnp.all(st.done_B)
    tok_B, st2 = _emit(spec, st, stop_S, knobs, pad_id)   # all pads (and nothing counted) if all done
    st = st2._replace(step=jnp.where(all_done, st.step, st2.step))
    out_BxC = jax.lax.dynamic_update_slice(out_BxC, tok_B[:, None], (0, i))
    if feed_last:
      st = forward(params, st, tok_B)
    return st, out_BxC
  return run


@dataclasses.dataclass
class Request:
  """A validated, padded request and its compiled prefill (what the benchmark times)."""
  model: nn.Module
  tokens_BxP: np.ndarray
  mask_BxP: np.ndarray
  lengths_B: np.ndarray
  slots: int
  max_new_tokens: int
  spec: SamplingSpec
  stop_S: np.ndarray
  knobs: tuple[np.ndarray, np.ndarray, np.ndarray]
  rng: Array
  pad_id: int
  prefill_layers: bool = True   # an unrolled stack's prefill one layer at a time (`layer_prefill`)

  def _prefill(self, params: Any) -> tuple[str, Any, Callable, tuple[Any, ...]]:
    b, p = self.tokens_BxP.shape
    args = (params, self.tokens_BxP, self.mask_BxP, self.lengths_B, self.rng)
    return "prefill", (_model_key(self.model), b, self.slots), _prefill_fn(self.model, self.slots), args

  def _steps(self, params: Any, st: Any, n_steps: int, chunk: int, feed_last: bool
             ) -> tuple[str, Any, Callable, tuple[Any, ...]]:
    args = (params, st, np.int32(n_steps), self.stop_S, np.int32(self.pad_id), *self.knobs)
    return ("decode_loop", (_model_key(self.model), self.spec, chunk, feed_last),
            _loop_fn(self.model, self.spec, chunk, feed_last), args)

  def _layered(self) -> layer_prefill.LayerPrefill | None:
    """The prefill one layer at a time (an unrolled stack: `layer_prefill`), or None (one program)."""
    if not (self.prefill_layers and layer_prefill.supported(self.model.cfg)):
      return None
    return layer_prefill.LayerPrefill(self.model, self.slots, self.tokens_BxP, self.mask_BxP,
                                      self.lengths_B, self.rng)

  def compile(self, params: Any, chunk: int, feed_last: bool) -> None:
    """Compile the prefill and the step loop (`steps(.., chunk, feed_last)`) when the prefill is not
    compiled yet, on threads: each function lowers while the ones before it compile."""
    layered = self._layered()
    with Compiling() as c:
      if layered is None:
        name, key, fn, args = self._prefill(params)
        pre = lower(name, key, fn, *args)
        if pre is None:
          return
        c.add(pre)
        st = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), pre.lowered.out_info)
        name, key, fn, args = self._steps(params, st, 1, chunk, feed_last)
        c.add(lower(name, key, fn, *args))
      else:
        pieces, state = layered.lower(params)
        if not pieces:
          return
        name, key, fn, args = self._steps(params, state, 1, chunk, feed_last)
        c.add(lower(name, key, fn, *args))   # the longest compile first
        for p in pieces:
          c.add(p)

  def prefill(self, params: Any) -> DecodeState:
    layered = self._layered()
    if layered is not None:
      return layered(params)
    name, key, fn, args = self._prefill(params)
    return _aot(name, key, fn, *args)(*args)

  def steps(self, params: Any, st: DecodeState, n_steps: int, chunk: int, feed_last: bool
            ) -> tuple[DecodeState, Array]:
    name, key, fn, args = self._steps(params, st, n_steps, chunk, feed_last)
    return _aot(name, key, fn, *args)(*args)


def make_request(model: nn.Module, prompt_tokens: Any, *, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int = 0, top_p: float = 1.0, repetition_penalty: float = 1.0,
                 stop_tokens: Sequence[int] = (), rng: Any = None, max_len: int | None = None,
                 pad_id: int = 0, bucket_prompts: bool = True) -> Request:
  """Validate and pad a request (ValueError before anything compiles).

  The prompts are left-padded to `prompt_bucket(P)` (or less when max_len leaves less room) unless
  bucket_prompts=False; slots default to that padded length + max_new_tokens.
  """
  cfg = _cfg(model)
  tokens, mask, lengths = pad_prompts(prompt_tokens, cfg.vocab_size)
  p = tokens.shape[1]
  slots = _check(cfg, p, max_new_tokens, max_len, temperature, top_k, top_p,
                 repetition_penalty, stop_tokens)
  if bucket_prompts:
    padded = prompt_bucket(p)
    if max_len is not None:   # the cache has max_len slots: pad no further than they allow
      padded = max(p, min(padded, int(max_len) - int(max_new_tokens)))
    if padded > p:
      extra = padded - p
      tokens = np.pad(tokens, ((0, 0), (extra, 0)))
      mask = np.pad(mask, ((0, 0), (extra, 0)))
    if max_len is None:
      slots = padded + int(max_new_tokens)
  knobs = (np.float32(temperature), np.float32(top_p), np.float32(repetition_penalty))
  return Request(model, tokens, mask, lengths, slots, int(max_new_tokens),
                 _spec(temperature, top_k, top_p, repetition_penalty), _stop_array(stop_tokens), knobs,
                 _rng(rng), int(pad_id))


def generate(model: nn.Module, params: Any, prompt_tokens: Any, *, max_new_tokens: int,
             temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, repetition_penalty: float = 1.0,
             stop_tokens: Sequence[int] = (), rng: Any = None, max_len: int | None = None, pad_id: int = 0,
             bucket_prompts: bool = True, scan_layers: bool | None = None, return_lengths: bool = False,
             cache_dtype: str | None = None) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
  """(B, max_new_tokens) int32 new tokens with the KV cache (and (B,) lengths if return_lengths).

  temperature <= 1e-5 is greedy; top_k=0 / top_p=1 / repetition_penalty=1 are off. rng: a key, an
  int seed or None (seed 0). max_len: cache slots (default: the bucketed prompt length +
  max_new_tokens). bucket_prompts=False compiles for the exact prompt length. scan_layers: True
  scanned, False unrolled, None the runtime's choice (`decode_layout`). cache_dtype: K/V storage ('' = compute dtype,
  bfloat16, int8; None = the model's setting).
  """
  model, params = decode_layout(with_cache_dtype(model, cache_dtype), nn.unbox(params), scan_layers)
  req = make_request(model, prompt_tokens, max_new_tokens=max_new_tokens, temperature=temperature,
                     top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty,
                     stop_tokens=stop_tokens, rng=rng, max_len=max_len, pad_id=pad_id,
                     bucket_prompts=bucket_prompts)
  req.compile(params, req.max_new_tokens, False)
  st = req.prefill(params)
  st, out = req.steps(params, st, req.max_new_tokens, req.max_new_tokens, False)
  out = np.asarray(out)
  return (out, np.asarray(st.lengths_B)) if return_lengths else out


def generate_stream(model: nn.Module, params: Any, prompt_tokens: Any, *, max_new_tokens: int,
                    chunk_size: int = 16, scan_layers: bool | None = None, cache_dtype: str | None = None,
                    **kwargs: Any) -> Iterator[np.ndarray]:
  """Like `generate`, but yields (B, c) chunks of new tokens as they are produced (c <= chunk_size).

  Stops after max_new_tokens or once every row has stopped; concatenating the chunks (and padding
  with pad_id to max_new_tokens) equals `generate(...)` with the same arguments.
  """
  if chunk_size < 1:
    raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
  model, params = decode_layout(with_cache_dtype(model, cache_dtype), nn.unbox(params), scan_layers)
  req = make_request(model, prompt_tokens, max_new_tokens=max_new_tokens, **kwargs)
  req.compile(params, chunk_size, req.max_new_tokens > chunk_size)
  st = req.prefill(params)
  left = req.max_new_tokens
  while left > 0:
    n = min(chunk_size, left)
    left -= n
    before = int(st.step)
    st, out = req.steps(params, st, n, chunk_size, left > 0)
    made = int(st.step) - before
    yield np.asarray(out)[:, :made]
    if bool(np.all(np.asarray(st.done_B))):
      return


def _recompute_fn(model: nn.Module, spec: SamplingSpec, p: int, n_new: int) -> Callable:
  def run(params, tokens_BxP, mask_BxP, rng, stop_S, pad_id, temperature, top_p, penalty):
    knobs = (temperature, top_p, penalty)
    b = tokens_BxP.shape[0]
    vocab = model.cfg.vocab_size
    buf_BxS = jnp.concatenate([tokens_BxP, jnp.zeros((b, n_new), jnp.int32)], axis=1)
    valid_BxS = jnp.concatenate([mask_BxP, jnp.zeros((b, n_new), bool)], axis=1)
    st = start_state(None, jnp.zeros((b, vocab), jnp.float32), tokens_BxP, mask_BxP,
                     jnp.zeros((b,), jnp.int32), rng, vocab)

    def cond(carry):
      i, s, _, _ = carry
      return (i < n_new) & ~jnp.all(s.done_B)

    def body(carry):
      i, s, buf, valid = carry
      feed_BxS = jnp.clip(buf, 0, vocab - 1)
      logits_BxSxV = model.apply({"params": params}, feed_BxS, attention_mask_BxL=valid)   # no cache
      logits_BxV = jax.lax.dynamic_index_in_dim(logits_BxSxV, p - 1 + i, axis=1, keepdims=False)
      tok_B, s = _emit(spec, s._replace(logits_BxV=logits_BxV), stop_S, knobs, pad_id)
      buf = jax.lax.dynamic_update_slice(buf, tok_B[:, None], (0, p + i))
      valid = jax.lax.dynamic_update_slice(valid, jnp.ones((b, 1), bool), (0, p + i))
      return i + 1, s, buf, valid

    init = (jnp.zeros((), jnp.int32), st, buf_BxS, valid_BxS)
    i, st, buf_BxS, _ = jax.lax.while_loop(cond, body, init)
    out = buf_BxS[:, p:]
    out = jnp.where(jnp.arange(n_new)[None] < i, out, pad_id)   # rows never reached after early exit
    return out, st.lengths_B
  return run


def generate_recompute(model: nn.Module, params: Any, prompt_tokens: Any, *, max_new_tokens: int,
                       temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                       repetition_penalty: float = 1.0, stop_tokens: Sequence[int] = (), rng: Any = None,
                       max_len: int | None = None, pad_id: int = 0, return_lengths: bool = False
                       ) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
  """Baseline without a cache: every step is a full forward over the (P + max_new_tokens) buffer.

  Same arguments, sampling and rng stream as `generate`, hence the same tokens (up to float noise).
  """
  req = make_request(model, prompt_tokens, max_new_tokens=max_new_tokens, temperature=temperature,
                     top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty,
                     stop_tokens=stop_tokens, rng=rng, max_len=max_len, pad_id=pad_id, bucket_prompts=False)
  params = nn.unbox(params)
  p = req.tokens_BxP.shape[1]
  key = (_model_key(model), req.spec, p, req.max_new_tokens)
  args = (params, req.tokens_BxP, req.mask_BxP, req.rng, req.stop_S, np.int32(req.pad_id), *req.knobs)
  fn = _recompute_fn(model, req.spec, p, req.max_new_tokens)
  out, lengths = _aot("recompute_loop", key, fn, *args)(*args)
  out = np.asarray(out)
  return (out, np.asarray(lengths)) if return_lengths else out
