"""Fast generation: KV-cache decoding with one prefill call and a compiled fixed-shape step loop.

`generate(model, params, prompts, max_new_tokens=...)` left-pads the prompts to a common length P
(attention mask + positions counted over real tokens only), runs ONE jit-compiled prefill over the
padded prompts into a fresh zero cache of S = max_len slots (default P + max_new_tokens), then ONE
jit-compiled `lax.while_loop` that samples a token, writes it to the cache and computes the next
logits, exiting early once every row has produced a stop token. Every request starts from a fresh
zero cache, so consecutive requests never see each other's keys ("conversations bleeding together").

What keeps compilation short:
- the layers are scanned or unrolled for decoding whatever the training layout, as the runtime
  decides per platform (`decode_layout`: scanned compiles one layer body, unrolled runs faster per
  token on XLA:CPU; params are converted once and the result reused), and never remat'd;
- P is rounded up to a prompt bucket (a power of two, at least 16: `prompt_bucket`), so a prompt of
  another length in the same bucket reuses the executables (the extra left padding is masked);
- the CLIs enable JAX's persistent compilation cache (`backends.enable_compilation_cache`).
Compiled executables are cached per (model, batch, bucketed prompt length, slots, static sampling
choices); every compile is logged in `COMPILE_LOG`. `generate_recompute` is the no-cache baseline
(a full forward over the whole fixed-size buffer every step, exact prompt length) with the same
sampling and rng stream, so both give the same tokens.
Output: (B, max_new_tokens) int32 numpy; after a row's stop token (which is kept) come `pad_id`s.
`return_lengths=True` also returns the number of generated tokens per row (stop token included).
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tformer_jax import backends
from tformer_jax.ops import kv_quant, sampling

Array = jax.Array
# (name, seconds) for every lower+compile done here; the benchmark reports compile time from it.
COMPILE_LOG: list[tuple[str, float]] = []
_COMPILED: dict[Any, Any] = {}
_MAX_COMPILED = 64  # executables kept (oldest dropped first)
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


# --------------------------------------------------------------------------------------- helpers


def _model_key(model: nn.Module) -> Any:
  try:
    hash(model)
    return model
  except TypeError:
    return id(model)


def _aot(name: str, key: Any, fn: Callable, *args: Any, donate: tuple[int, ...] = ()) -> Any:
  """Lower+compile `fn` once per (name, key, argument shapes/dtypes); cached in `_COMPILED`.
  donate: argument positions whose buffers the executable may reuse (then invalid after the call)."""
  leaves, tree = jax.tree_util.tree_flatten(args)
  avals = tuple((np.shape(x), str(getattr(x, "dtype", None) or np.result_type(x))) for x in leaves)
  full_key = (name, key, tree, avals)
  exe = _COMPILED.get(full_key)
  if exe is None:
    t0 = time.perf_counter()
    exe = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
    COMPILE_LOG.append((name, time.perf_counter() - t0))
    if len(_COMPILED) >= _MAX_COMPILED:
      _COMPILED.pop(next(iter(_COMPILED)))
    _COMPILED[full_key] = exe
  return exe


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
  rng, sub = jax.random.split(st.rng)
  tok_B = _pick(spec, sub, st.logits_BxV, st.seen_BxV, *knobs)
  live_B = ~st.done_B
  tok_B = jnp.where(live_B, tok_B, pad_id)
  b, v = st.seen_BxV.shape
  seen = st.seen_BxV | (jax.nn.one_hot(tok_B, v, dtype=jnp.bool_) & live_B[:, None])
  lengths = jnp.where(live_B, st.step + 1, st.lengths_B)
  done = st.done_B | (live_B & jnp.any(tok_B[:, None] == stop_S[None, :], axis=-1))
  return tok_B, st._replace(seen_BxV=seen, done_B=done, lengths_B=lengths, step=st.step + 1, rng=rng)


# ------------------------------------------------------------------------------- decode layout


def prompt_bucket(p: int) -> int:
  """The padded prompt length compiled for a prompt of p tokens: the next power of two (>= 16)."""
  return max(MIN_PROMPT_BUCKET, 1 << (int(p) - 1).bit_length())


def _uniform_layers(cfg: Any) -> bool:
  """All blocks alike (a scan needs one body): not the case for MoE every k-th layer."""
  return len({cfg.is_moe_layer(i) for i in range(cfg.num_layers)}) <= 1


def stack_layers(params: Any, num_layers: int) -> Any:
  """Unscanned params ('layers_0' .. 'layers_{n-1}') -> the scanned layout ('layers', leading axis)."""
  names = [f"layers_{i}" for i in range(num_layers)]
  missing = [n for n in names if n not in params]
  if missing:
    raise ValueError(f"params have no {missing[0]!r}: not the unscanned layout of a {num_layers}-layer model")
  out = {k: v for k, v in params.items() if k not in names}
  out["layers"] = jax.tree.map(lambda *xs: jnp.stack(xs), *(params[n] for n in names))
  return out


_LAYOUT: list[tuple[Any, list[Any], Any]] = []   # (key, the source leaves kept alive, result): one entry


def unstack_layers(params: Any, num_layers: int) -> Any:
  """Scanned params ('layers', leading axis) -> the unrolled layout ('layers_0' .. 'layers_{n-1}')."""
  if "layers" not in params:
    raise ValueError("params have no 'layers': not the scanned layout")
  out = {k: v for k, v in params.items() if k != "layers"}
  for i in range(num_layers):
    out[f"layers_{i}"] = jax.tree.map(lambda x, i=i: x[i], params["layers"])
  return out


def _converted(model: nn.Module, params: Any, convert: Callable[[], Any]) -> Any:
  """`convert()` of these params, the last conversion kept (repeated calls reuse it)."""
  leaves = jax.tree.leaves(params)
  key = (_model_key(model), tuple(id(x) for x in leaves))
  if _LAYOUT and _LAYOUT[0][0] == key:
    return _LAYOUT[0][2]
  out = convert()
  _LAYOUT[:] = [(key, leaves, out)]
  return out


def decode_layout(model: nn.Module, params: Any, scan: bool | None = None) -> tuple[nn.Module, Any]:
  """(model, params) as decoding compiles them: scanned (scan=True) or unrolled (False) layers, no
  remat; None = the runtime's choice (`backends.current().decode_layout`, decided per platform by
  `resolve_runtime`; outside a `backends.use` block: scanned).

  Scanning compiles one layer body instead of num_layers copies (the decode loop's compile time falls
  by the layer count's share); on XLA:CPU each scanned step slices every layer's weights out of the
  stack (a copy), so unrolled layers decode faster per token there (0.9B bf16, 2 cores: 64 vs 208
  ms/token) but compile 2.6x longer (4.7 vs 1.8 s). Params are converted to the chosen layout (a copy
  of the layer weights), the last conversion kept. A stack whose layers differ (MoE every k-th layer)
  stays unrolled.
  """
  cfg = _cfg(model)
  if scan is None:
    scan = backends.current().decode_layout != "unrolled"
  scan = bool(scan) and (cfg.scan_layers or _uniform_layers(cfg))
  new_cfg = dataclasses.replace(cfg, scan_layers=scan, remat="none")
  out_model = model if new_cfg == cfg else model.clone(cfg=new_cfg)
  if cfg.scan_layers == scan:
    return out_model, params
  if scan:
    return out_model, _converted(model, params, lambda: stack_layers(params, cfg.num_layers))
  return out_model, _converted(model, params, lambda: unstack_layers(params, cfg.num_layers))


# --------------------------------------------------------------------------------- cached path


def _prefill_fn(model: nn.Module, slots: int) -> Callable:
  vocab = model.cfg.vocab_size

  def prefill(params, tokens_BxP, mask_BxP, lengths_B, rng):
    shapes = _cache_shapes(model, tokens_BxP.shape[0], slots)
    cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)   # fresh per request
    positions_BxP = jnp.maximum(jnp.cumsum(mask_BxP, axis=1) - 1, 0).astype(jnp.int32)
    # only the last position's logits are needed: no (B, P, vocab) logits
    (h_BxPxD, unembed_DxV), upd = model.apply({"params": params, "cache": cache}, tokens_BxP,
                                              positions_BxL=positions_BxP, attention_mask_BxL=mask_BxP,
                                              decode=True, return_hidden=True, mutable=["cache"])
    logits_BxV = jnp.einsum("bd,dv->bv", h_BxPxD[:, -1], unembed_DxV).astype(jnp.float32)
    seen = sampling.seen_mask(jnp.where(mask_BxP, tokens_BxP, -1), vocab)
    b = tokens_BxP.shape[0]
    return DecodeState(cache=upd["cache"], logits_BxV=logits_BxV, seen_BxV=seen,
                       pos_B=lengths_B, done_B=jnp.zeros((b,), bool), lengths_B=jnp.zeros((b,), jnp.int32),
                       step=jnp.zeros((), jnp.int32), rng=rng)
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

  def prefill(self, params: Any) -> DecodeState:
    b, p = self.tokens_BxP.shape
    key = (_model_key(self.model), b, self.slots)
    args = (params, self.tokens_BxP, self.mask_BxP, self.lengths_B, self.rng)
    return _aot("prefill", key, _prefill_fn(self.model, self.slots), *args)(*args)

  def steps(self, params: Any, st: DecodeState, n_steps: int, chunk: int, feed_last: bool
            ) -> tuple[DecodeState, Array]:
    key = (_model_key(self.model), self.spec, chunk, feed_last)
    args = (params, st, np.int32(n_steps), self.stop_S, np.int32(self.pad_id), *self.knobs)
    fn = _loop_fn(self.model, self.spec, chunk, feed_last)
    return _aot("decode_loop", key, fn, *args)(*args)


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


# ------------------------------------------------------------------------------ recompute path


def _recompute_fn(model: nn.Module, spec: SamplingSpec, p: int, n_new: int) -> Callable:
  def run(params, tokens_BxP, mask_BxP, rng, stop_S, pad_id, temperature, top_p, penalty):
    knobs = (temperature, top_p, penalty)
    b = tokens_BxP.shape[0]
    vocab = model.cfg.vocab_size
    buf_BxS = jnp.concatenate([tokens_BxP, jnp.zeros((b, n_new), jnp.int32)], axis=1)
    valid_BxS = jnp.concatenate([mask_BxP, jnp.zeros((b, n_new), bool)], axis=1)
    st = DecodeState(cache=None, logits_BxV=jnp.zeros((b, vocab), jnp.float32),
                     seen_BxV=sampling.seen_mask(jnp.where(mask_BxP, tokens_BxP, -1), vocab),
                     pos_B=jnp.zeros((b,), jnp.int32), done_B=jnp.zeros((b,), bool),
                     lengths_B=jnp.zeros((b,), jnp.int32), step=jnp.zeros((), jnp.int32), rng=rng)

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


# ------------------------------------------------------------------------- cache continuation


def _append_fn(model: nn.Module, all_logits: bool) -> Callable:
  """Feed tokens_BxN (the first n_real real, the rest right padding) at cache slot `start` = position."""

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
      return new_cache, jnp.einsum("bnd,dv->bnv", h_BxNxD, unembed_DxV).astype(jnp.float32)
    h_BxD = jax.lax.dynamic_index_in_dim(h_BxNxD, n_real - 1, axis=1, keepdims=False)
    return new_cache, jnp.einsum("bd,dv->bv", h_BxD, unembed_DxV).astype(jnp.float32)
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


# ------------------------------------------------------------------- scoring through the cache


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


# ------------------------------------------------------------------------ slots (continuous batching)


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
