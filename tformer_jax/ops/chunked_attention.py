"""Chunked exact attention: each query chunk runs a full softmax over only the keys it can see.

The queries are cut into static chunks of `chunk` rows. With a causal mask chunk i (rows
[i*c, (i+1)*c)) can only see keys [0, (i+1)*c), and with a sliding window also none below
i*c - window + 1, so the key range of every chunk is a static slice: the masked upper triangle is
skipped at chunk granularity (c = L/4 computes 10 of 16 tiles, 62.5% of the dense work; c = L/8, 56%)
and no online softmax is needed. The forward keeps each chunk's probabilities and the backward is a
hand-written VJP (`jax.custom_vjp`) with the 4 matmuls of the dense backward on the same static
slices (no recompute, unlike `ops.blockwise`; delta = rowsum(dO * O) as in FlashAttention-2).

When to use which (all exact, same semantics):
  `ops.attention` reference  one L x S softmax; simplest; O(L*S) memory; every tile computed.
  this module                 short and medium sequences (up to a few thousand): O(L*S/2) memory for
                              causal; the fastest on CPU (docs/benchmarks.md).
  `ops.blockwise`             long sequences: O(L) memory, recomputes in the backward.

Semantics match `ops.attention.dot_product_attention` with the equivalent dense mask: query i at
absolute position q_offset + i, key j at j; causal j <= p; window w adds j > p - w (|p - j| < w when
not causal); ALiBi bias -slope_h * (p - j) (|p - j| when not causal); kv_valid and segment ids
(0 = padding) as in `ops.blockwise`; a soft cap c > 0 turns each score into c * tanh(score / c)
before any bias (the backward recomputes the chunk's scores for its derivative); sinks add one logit
per head to every row's denominator (the chunk keeps its sink probability for the backward). A query
row that sees no key returns zeros, never NaN.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from tformer_jax.ops.blockwise import MASK_VALUE, zero_cotangents
from tformer_jax.ops.masks import band

Array = jnp.ndarray


class _Static(NamedTuple):
  causal: bool
  window: int
  q_offset: int
  chunk: int
  softcap: float = 0.0


def chunk_key_range(i: int, chunk: int, l: int, s: int, *, causal: bool, window: int,
                    q_offset: int) -> tuple[int, int]:
  """Static [lo, hi) of the keys that query chunk i (rows [i*chunk, min(l, (i+1)*chunk))) can see."""
  p_min, p_max = q_offset + i * chunk, q_offset + min(l, (i + 1) * chunk) - 1
  lo, hi = 0, s
  if causal:
    hi = p_max + 1
    if window > 0:
      lo = p_min - window + 1
  elif window > 0:
    lo, hi = p_min - window + 1, p_max + window
  lo = min(max(lo, 0), s)
  return lo, min(max(hi, lo), s)


def chunk_table(l: int, s: int, *, causal: bool, window: int, q_offset: int,
                chunk: int) -> np.ndarray:
  """(n_chunks, 4) int32 rows (row0, row1, lo, hi): every query chunk and its static key range (also
  the table the C++ kernel in backends/cpu/kernels walks)."""
  rows = []
  for i in range(-(-l // chunk)):
    lo, hi = chunk_key_range(i, chunk, l, s, causal=causal, window=window, q_offset=q_offset)
    rows.append((i * chunk, min(l, (i + 1) * chunk), lo, hi))
  return np.asarray(rows, np.int32).reshape(-1, 4)


def _chunks(st: _Static, l: int, s: int):
  """(row0, row1, lo, hi) of every query chunk, as Python ints."""
  table = chunk_table(l, s, causal=st.causal, window=st.window, q_offset=st.q_offset, chunk=st.chunk)
  for row in table.tolist():
    yield tuple(row)


def _scores(st: _Static, q_i: Array, k_c: Array) -> tuple[Array, Array | None]:
  """The chunk's scores (B, K, G, Q, C) in float32, soft-capped when st.softcap, and the cap's
  derivative 1 - tanh^2 (None without a cap)."""
  s = jnp.einsum("bkgqd,bkcd->bkgqc", q_i, k_c, preferred_element_type=jnp.float32)
  if not st.softcap:
    return s, None
  t = jnp.tanh(s / st.softcap)
  return st.softcap * t, 1.0 - t * t


def _probs(st: _Static, q_i: Array, k_c: Array, r0: int, r1: int, lo: int, hi: int,
           aux: dict) -> tuple[Array, Array | None]:
  """Softmax probabilities (B, K, G, Q, C) in float32 of one query chunk over keys [lo, hi), and with
  sinks each row's sink probability (B, K, G, Q) (else None); rows that see no key are all zero."""
  s_BxKxGxQxC, _ = _scores(st, q_i, k_c)
  dist_QxC = (st.q_offset + np.arange(r0, r1))[:, None] - np.arange(lo, hi)[None, :]
  mask = None  # (1 or B, Q, C)
  m = band(dist_QxC, causal=st.causal, window=st.window, xp=np)
  if m is not None and not m.all():
    mask = jnp.asarray(m)[None]
  if aux["slopes"] is not None:
    dist = dist_QxC if st.causal else np.abs(dist_QxC)
    s_BxKxGxQxC = s_BxKxGxQxC - aux["slopes"][None, :, :, None, None] * jnp.asarray(dist, jnp.float32)
  if aux["kv_valid"] is not None:
    m = aux["kv_valid"][:, None, lo:hi]
    mask = m if mask is None else mask & m
  if aux["q_seg"] is not None:
    qs, ks = aux["q_seg"][:, r0:r1, None], aux["kv_seg"][:, None, lo:hi]
    m = (qs == ks) & (ks != 0)
    mask = m if mask is None else mask & m
  if mask is not None:
    s_BxKxGxQxC = jnp.where(mask[:, None, None], s_BxKxGxQxC, MASK_VALUE)
  p_sink = None
  if aux["sinks"] is None:
    p = jax.nn.softmax(s_BxKxGxQxC, axis=-1)
  else:   # the sink as one more column of the softmax
    sink = aux["sinks"][None, :, :, None]
    m = jnp.maximum(jnp.max(s_BxKxGxQxC, axis=-1), sink)
    e = jnp.exp(s_BxKxGxQxC - m[..., None])
    e_sink = jnp.exp(sink - m)
    z = jnp.sum(e, axis=-1) + e_sink
    p, p_sink = e / z[..., None], e_sink / z
  if mask is not None and (aux["kv_valid"] is not None or aux["q_seg"] is not None or st.window):
    seen = jnp.any(mask, axis=-1)[:, None, None, :]   # rows with no key
    p = jnp.where(seen[..., None], p, 0.0)
    p_sink = None if p_sink is None else jnp.where(seen, p_sink, 1.0)
  return p, p_sink


def _forward(st: _Static, q: Array, k: Array, v: Array, aux: dict) -> tuple[Array, list]:
  """Head-major q (B, K, G, L, D) pre-scaled, k/v (B, K, S, D) -> o like q, and the probabilities."""
  l, s = q.shape[3], k.shape[2]
  outs, probs = [], []
  for r0, r1, lo, hi in _chunks(st, l, s):
    q_i = q[:, :, :, r0:r1]
    if hi == lo:  # this chunk sees no key at all
      outs.append(jnp.zeros(q_i.shape, q.dtype))
      probs.append(None)
      continue
    p, p_sink = _probs(st, q_i, k[:, :, lo:hi], r0, r1, lo, hi, aux)
    o_i = jnp.einsum("bkgqc,bkcd->bkgqd", p.astype(v.dtype), v[:, :, lo:hi],
                     preferred_element_type=jnp.float32)
    outs.append(o_i.astype(q.dtype))
    probs.append((p, p_sink))
  return jnp.concatenate(outs, axis=3) if len(outs) > 1 else outs[0], probs


def _backward(st: _Static, q: Array, k: Array, v: Array, o: Array, probs: list, do: Array):
  l, s = q.shape[3], k.shape[2]
  delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)  # (B, K, G, L)
  dk = jnp.zeros(k.shape, jnp.float32)
  dv = jnp.zeros(v.shape, jnp.float32)
  dqs, dsinks = [], None
  for (r0, r1, lo, hi), pp in zip(_chunks(st, l, s), probs):
    if pp is None:
      dqs.append(jnp.zeros(q[:, :, :, r0:r1].shape, jnp.float32))
      continue
    p, p_sink = pp
    do_i, q_i = do[:, :, :, r0:r1], q[:, :, :, r0:r1]
    if p_sink is not None:   # d sink = -sum over rows of p_sink * rowsum(dO * O)
      d = -jnp.sum(p_sink * delta[:, :, :, r0:r1], axis=(0, 3))
      dsinks = d if dsinks is None else dsinks + d
    dv_c = jnp.einsum("bkgqc,bkgqd->bkcd", p.astype(do.dtype), do_i, preferred_element_type=jnp.float32)
    dp = jnp.einsum("bkgqd,bkcd->bkgqc", do_i, v[:, :, lo:hi], preferred_element_type=jnp.float32)
    ds = p * (dp - delta[:, :, :, r0:r1, None])
    if st.softcap:   # through the cap: recompute the chunk's scores for 1 - tanh^2
      ds = ds * _scores(st, q_i, k[:, :, lo:hi])[1]
    dqs.append(jnp.einsum("bkgqc,bkcd->bkgqd", ds.astype(k.dtype), k[:, :, lo:hi],
                          preferred_element_type=jnp.float32))
    dk_c = jnp.einsum("bkgqc,bkgqd->bkcd", ds.astype(q.dtype), q_i, preferred_element_type=jnp.float32)
    if lo == 0 and hi == s:
      dk, dv = dk + dk_c, dv + dv_c
    else:
      dk = jax.lax.dynamic_update_slice_in_dim(dk, dk[:, :, lo:hi] + dk_c, lo, axis=2)
      dv = jax.lax.dynamic_update_slice_in_dim(dv, dv[:, :, lo:hi] + dv_c, lo, axis=2)
  dq = jnp.concatenate(dqs, axis=3) if len(dqs) > 1 else dqs[0]
  return dq, dk, dv, dsinks


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunked(st: _Static, q: Array, k: Array, v: Array, sinks: Array | None, aux: dict) -> Array:
  return _forward(st, q, k, v, {**aux, "sinks": sinks})[0]


def _chunked_fwd(st: _Static, q: Array, k: Array, v: Array, sinks: Array | None, aux: dict):
  o, probs = _forward(st, q, k, v, {**aux, "sinks": sinks})
  return o, (q, k, v, sinks, aux, o, probs)


def _chunked_bwd(st: _Static, res, do: Array):
  q, k, v, sinks, aux, o, probs = res
  dq, dk, dv, dsinks = _backward(st, q, k, v, o, probs, do)
  if sinks is not None:
    dsinks = jnp.zeros_like(sinks) if dsinks is None else dsinks.astype(sinks.dtype)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dsinks, zero_cotangents(aux)


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def chunked_attention(q_BxLxHxD: Array, k_BxSxKxD: Array, v_BxSxKxD: Array, *, causal: bool = True,
                      window: int = 0, q_offset: int = 0, alibi_slopes_H: Array | None = None,
                      kv_valid_BxS: Array | None = None, q_segment_ids_BxL: Array | None = None,
                      kv_segment_ids_BxS: Array | None = None, scale: float | None = None,
                      chunk: int = 64, softcap: float = 0.0, sinks_H: Array | None = None) -> Array:
  """Exact attention in static query chunks; returns (B, L, H, D). GQA/MQA: K divides H, K/V are
  never repeated. `q_offset` must be a Python int (the chunk ranges are static). No gradient flows to
  ALiBi slopes."""
  b, l, h, d = q_BxLxHxD.shape
  kh = k_BxSxKxD.shape[2]
  if k_BxSxKxD.shape != v_BxSxKxD.shape or k_BxSxKxD.shape[-1] != d or h % kh:
    raise ValueError(f"bad shapes q {q_BxLxHxD.shape}, k {k_BxSxKxD.shape}, v {v_BxSxKxD.shape}")
  if window < 0 or chunk <= 0:
    raise ValueError(f"window must be >= 0 and chunk > 0, got window={window}, chunk={chunk}")
  if not isinstance(q_offset, (int, np.integer)):
    raise ValueError("chunked_attention needs a static (Python int) q_offset; use ops.blockwise for "
                     "a traced one")
  if q_segment_ids_BxL is None and kv_segment_ids_BxS is not None:
    raise ValueError("kv_segment_ids_BxS given without q_segment_ids_BxL")
  g = h // kh
  scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
  st = _Static(causal=bool(causal), window=int(window), q_offset=int(q_offset), chunk=int(chunk),
               softcap=float(softcap))
  aux = {"slopes": None, "kv_valid": None, "q_seg": None, "kv_seg": None}
  if alibi_slopes_H is not None:
    aux["slopes"] = jnp.asarray(alibi_slopes_H, jnp.float32).reshape(kh, g)
  if kv_valid_BxS is not None:
    aux["kv_valid"] = kv_valid_BxS.astype(bool)
  if q_segment_ids_BxL is not None:
    kv_seg = q_segment_ids_BxL if kv_segment_ids_BxS is None else kv_segment_ids_BxS
    aux["q_seg"], aux["kv_seg"] = q_segment_ids_BxL.astype(jnp.int32), kv_seg.astype(jnp.int32)
  dt = q_BxLxHxD.dtype
  # head-major, so every chunk product is a plain batched matmul over (B, K)
  q_BxLxKxGxD = (q_BxLxHxD * jnp.asarray(scale, dt)).reshape(b, l, kh, g, d)
  q_BxKxGxLxD = jnp.transpose(q_BxLxKxGxD, (0, 2, 3, 1, 4))
  k_BxKxSxD = jnp.transpose(k_BxSxKxD, (0, 2, 1, 3))
  v_BxKxSxD = jnp.transpose(v_BxSxKxD, (0, 2, 1, 3))
  sinks = None if sinks_H is None else sinks_H.astype(jnp.float32).reshape(kh, g)
  o_BxKxGxLxD = _chunked(st, q_BxKxGxLxD, k_BxKxSxD, v_BxKxSxD, sinks, aux)
  return jnp.transpose(o_BxKxGxLxD, (0, 3, 1, 2, 4)).reshape(b, l, h, d)
