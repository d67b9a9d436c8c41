"""`chunked_attention_cpu`: ops.chunked_attention's algorithm as one C++ custom call per direction.

Same semantics and chunking as `ops.chunked_attention.chunked_attention` (causal, sliding window,
static q_offset, ALiBi, padding via kv_valid, GQA/MQA), float32 or bfloat16 (the latter on a BLAS with a
bfloat16 gemm, oneMKL or oneDNN: float32 accumulation and softmax), CPU backend only; segment ids
are not supported here (use 'chunked'). The forward returns the output and the packed per-chunk
probabilities, which the backward reuses (no recompute). See attention.cc for why it is faster
than the XLA lowering on CPU.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from tformer_jax.backends.cpu.kernels import build
from tformer_jax.ops.chunked_attention import chunk_table

Array = jnp.ndarray


class _Static(NamedTuple):
  causal: bool
  window: int
  q_offset: int
  chunk: int
  scale: float
  use_alibi: bool
  use_valid: bool


def _table(st: _Static, l: int, s: int) -> tuple[np.ndarray, int]:
  """The chunk table and the packed probabilities' length (chunk after chunk, rows x keys)."""
  t = chunk_table(l, s, causal=st.causal, window=st.window, q_offset=st.q_offset, chunk=st.chunk)
  return t, int(np.sum((t[:, 1] - t[:, 0]).astype(np.int64) * (t[:, 3] - t[:, 2])))


def _forward(st: _Static, q, k, v, slopes, valid):
  b, l, h, _ = q.shape
  table, packed = _table(st, l, k.shape[1])
  call = jax.ffi.ffi_call(
      build.target("tfj_chunked_attention_fwd", q.dtype),
      (jax.ShapeDtypeStruct(q.shape, q.dtype),
       jax.ShapeDtypeStruct((b, h, packed), q.dtype)),
      vmap_method="sequential")
  return call(q, k, v, slopes, valid, jnp.asarray(table), causal=np.int64(st.causal),
              window=np.int64(st.window), q_offset=np.int64(st.q_offset),
              scale=np.float32(st.scale),
              use_alibi=np.int64(st.use_alibi), use_valid=np.int64(st.use_valid))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(st: _Static, q, k, v, slopes, valid):
  return _forward(st, q, k, v, slopes, valid)[0]


def _attention_fwd(st: _Static, q, k, v, slopes, valid):
  o, probs = _forward(st, q, k, v, slopes, valid)
  return o, (q, k, v, slopes, valid, o, probs)


def _attention_bwd(st: _Static, res, do):
  q, k, v, slopes, valid, o, probs = res
  table, _ = _table(st, q.shape[1], k.shape[1])
  call = jax.ffi.ffi_call(
      build.target("tfj_chunked_attention_bwd", q.dtype),
      (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, q.dtype),
       jax.ShapeDtypeStruct(v.shape, q.dtype)),
      vmap_method="sequential")
  dq, dk, dv = call(q, k, v, o, probs, do.astype(q.dtype), jnp.asarray(table),
                    scale=np.float32(st.scale))
  return dq, dk, dv, jnp.zeros_like(slopes), np.zeros(valid.shape, jax.dtypes.float0)


_attention.defvjp(_attention_fwd, _attention_bwd)


def chunked_attention_cpu(q_BxLxHxD: Array, k_BxSxKxD: Array, v_BxSxKxD: Array, *,
                          causal: bool = True, window: int = 0, q_offset: int = 0,
                          alibi_slopes_H: Array | None = None, kv_valid_BxS: Array | None = None,
                          scale: float | None = None, chunk: int = 64) -> Array:
  """Exact attention, (B, L, H, D) float32 or bfloat16 -> the same, by the C++ CPU kernel. GQA/MQA: K
  divides H. `q_offset` must be a Python int. No gradient flows to ALiBi slopes. bfloat16 needs a BLAS with
  a bfloat16 gemm (`build.has_bf16_gemm()`: oneMKL, oneDNN)."""
  b, l, h, d = q_BxLxHxD.shape
  s, kh = k_BxSxKxD.shape[1], k_BxSxKxD.shape[2]
  if k_BxSxKxD.shape != v_BxSxKxD.shape or k_BxSxKxD.shape[-1] != d or k_BxSxKxD.shape[0] != b \
      or h % kh:
    raise ValueError(f"bad shapes q {q_BxLxHxD.shape}, k {k_BxSxKxD.shape}, v {v_BxSxKxD.shape}")
  dtypes = {x.dtype for x in (q_BxLxHxD, k_BxSxKxD, v_BxSxKxD)}
  if len(dtypes) != 1 or dtypes.pop() not in (jnp.float32, jnp.bfloat16):
    raise ValueError("chunked_attention_cpu takes float32 or bfloat16 q, k and v of one dtype; got "
                     f"{q_BxLxHxD.dtype}/{k_BxSxKxD.dtype}/{v_BxSxKxD.dtype} (use 'chunked')")
  if window < 0 or chunk <= 0:
    raise ValueError(f"window must be >= 0 and chunk > 0, got window={window}, chunk={chunk}")
  if not isinstance(q_offset, (int, np.integer)):
    raise ValueError("chunked_attention_cpu needs a static (Python int) q_offset")
  if jax.default_backend() != "cpu":
    raise ValueError(f"chunked_attention_cpu is a CPU kernel; the default backend is "
                     f"{jax.default_backend()!r} (use 'chunked', 'xla' or 'cudnn' there)")
  build.load()
  if q_BxLxHxD.dtype == jnp.bfloat16:
    build.require_bf16_gemm("chunked_attention_cpu")
  st = _Static(causal=bool(causal), window=int(window), q_offset=int(q_offset), chunk=int(chunk),
               scale=1.0 / math.sqrt(d) if scale is None else float(scale),
               use_alibi=alibi_slopes_H is not None, use_valid=kv_valid_BxS is not None)
  slopes = (jnp.zeros((1,), jnp.float32) if alibi_slopes_H is None
            else jnp.asarray(alibi_slopes_H, jnp.float32).reshape(h))
  valid = (jnp.ones((1, 1), jnp.int32) if kv_valid_BxS is None
           else jnp.asarray(kv_valid_BxS).astype(jnp.int32).reshape(b, s))
  return _attention(st, q_BxLxHxD, k_BxSxKxD, v_BxSxKxD, slopes, valid)
