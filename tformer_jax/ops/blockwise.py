"""Blockwise (FlashAttention-style) attention in pure JAX: O(L) memory forward and backward.

Queries and keys are cut into tiles of `block_q` x `block_k`. The forward walks, for each query block,
only the key blocks that intersect its visible band (causal and/or sliding window), keeping a running
max and sum in float32 (online softmax), so the L x S logits never exist. The backward is a
`jax.custom_vjp` (FlashAttention-2): it saves only the output and the row logsumexp, and recomputes
each tile's probabilities, again skipping blocks outside the band. With a window w the cost is
O(L * w) instead of O(L * S).

Semantics match `ops.attention.dot_product_attention` with the equivalent dense mask and bias:
query i sits at absolute position p = q_offset + i, key j at position j.
  causal:            j <= p             window > 0 adds  j > p - window
  not causal:        every j            window > 0 means |p - j| < window
  ALiBi:             bias = -slope_h * (p - j)   (|p - j| when not causal)
  soft cap c > 0:    scores c * tanh(score / c) before any bias (Gemma 2)
  sinks:             one logit per head in every row's softmax denominator (GPT-OSS): the running max
                     and sum start at the sink instead of empty, and its gradient is
                     -sum over rows of exp(sink - lse) * rowsum(dO * O)
  kv_valid / segments: key j is visible only if valid, and (with segment ids) only within the same
  segment, segment id 0 being padding (as `masks.segment_mask`).
A query row that sees no key returns zeros (and zero gradients), never NaN.
"""
from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from tformer_jax.ops.masks import band

Array = jnp.ndarray

# Same finite "minus infinity" as ops.attention; a row whose running max is still exactly this value
# has seen no visible key.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


class _Static(NamedTuple):
  causal: bool
  window: int
  scale: float
  block_q: int
  block_k: int
  softcap: float = 0.0


def _ceil_div(a: int, b: int) -> int:
  return -(-a // b)


def _pad_axis(x: Array, axis: int, new_len: int, value: Any = 0) -> Array:
  pad = new_len - x.shape[axis]
  if pad == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths, constant_values=value)


def _kv_block_range(i: Array, st: _Static, q_offset: Array, nk: int) -> tuple[Array, Array]:
  """[lo, hi) key blocks that can be visible from query block i."""
  p_min = q_offset + i * st.block_q
  p_max = p_min + st.block_q - 1
  lo, hi = jnp.int32(0), jnp.int32(nk)
  if st.causal:
    hi = jnp.floor_divide(p_max, st.block_k) + 1
    if st.window > 0:
      lo = jnp.floor_divide(p_min - st.window + 1, st.block_k)
  elif st.window > 0:
    lo = jnp.floor_divide(p_min - st.window + 1, st.block_k)
    hi = jnp.floor_divide(p_max + st.window - 1, st.block_k) + 1
  lo = jnp.clip(lo, 0, nk).astype(jnp.int32)
  hi = jnp.clip(hi, lo, nk).astype(jnp.int32)
  return lo, hi


def _q_block_range(j: Array, st: _Static, q_offset: Array, nq: int) -> tuple[Array, Array]:
  """[lo, hi) query blocks that can see key block j."""
  k_min = j * st.block_k
  k_max = k_min + st.block_k - 1
  lo, hi = jnp.int32(0), jnp.int32(nq)
  if st.causal:  # p >= k_min, and with a window p <= k_max + window - 1
    lo = jnp.floor_divide(k_min - q_offset, st.block_q)
    if st.window > 0:
      hi = jnp.floor_divide(k_max + st.window - 1 - q_offset, st.block_q) + 1
  elif st.window > 0:  # k_min - window < p < k_max + window
    lo = jnp.floor_divide(k_min - st.window + 1 - q_offset, st.block_q)
    hi = jnp.floor_divide(k_max + st.window - 1 - q_offset, st.block_q) + 1
  lo = jnp.clip(lo, 0, nq).astype(jnp.int32)
  hi = jnp.clip(hi, lo, nq).astype(jnp.int32)
  return lo, hi


def _tile_logits(q_BxKxGxQxD: Array, k_BxKxCxD: Array, i: Array, j: Array, aux: dict,
                 st: _Static) -> tuple[Array, Array | None]:
  """Masked, biased logits (B, K, G, Q, C) in float32 for query block i and key block j, and with a
  soft cap the derivative of the capped scores by the raw ones, 1 - tanh^2 (else None).

  q is already multiplied by the softmax scale."""
  bq, bk = st.block_q, st.block_k
  s = jnp.einsum("bkgqd,bkcd->bkgqc", q_BxKxGxQxD, k_BxKxCxD, preferred_element_type=jnp.float32)
  s = s.astype(jnp.float32)
  dcap = None
  if st.softcap:
    t = jnp.tanh(s / st.softcap)
    s, dcap = st.softcap * t, 1.0 - t * t
  q_pos = aux["q_offset"] + i * bq + jnp.arange(bq, dtype=jnp.int32)
  k_pos = j * bk + jnp.arange(bk, dtype=jnp.int32)
  dist_QxC = q_pos[:, None] - k_pos[None, :]
  if aux["slopes"] is not None:
    kh, g = s.shape[1], s.shape[2]
    slopes_KxG = aux["slopes"].astype(jnp.float32).reshape(kh, g)
    d = dist_QxC if st.causal else jnp.abs(dist_QxC)
    s = s - slopes_KxG[None, :, :, None, None] * d.astype(jnp.float32)[None, None, None]
  mask = band(dist_QxC, causal=st.causal, window=st.window)
  if mask is not None:
    mask = mask[None]  # (1, Q, C)
  if aux["kv_valid"] is not None:
    valid_BxC = jax.lax.dynamic_slice_in_dim(aux["kv_valid"], j * bk, bk, axis=1)
    m = valid_BxC[:, None, :]
    mask = m if mask is None else mask & m
  if aux["q_seg"] is not None:
    qs_BxQ = jax.lax.dynamic_slice_in_dim(aux["q_seg"], i * bq, bq, axis=1)
    ks_BxC = jax.lax.dynamic_slice_in_dim(aux["kv_seg"], j * bk, bk, axis=1)
    m = (qs_BxQ[:, :, None] == ks_BxC[:, None, :]) & (ks_BxC[:, None, :] != 0)
    mask = m if mask is None else mask & m
  if mask is not None:
    s = jnp.where(mask[:, None, None], s, MASK_VALUE)
  return s, dcap


def _sink_state(aux: dict, shape: tuple[int, ...]) -> tuple[Array, Array]:
  """The online softmax's starting (max, sum) of a (B, K, G, Q) row block: empty, or the sink's logit
  with its exp(0) = 1 already counted."""
  if aux.get("sinks") is None:
    return jnp.full(shape, MASK_VALUE, jnp.float32), jnp.zeros(shape, jnp.float32)
  sink = jnp.broadcast_to(aux["sinks"][None, :, :, None], shape)
  return sink, jnp.ones(shape, jnp.float32)


def _forward(st: _Static, q: Array, k: Array, v: Array, aux: dict) -> tuple[Array, Array]:
  """Head-major q (B, K, G, Lp, D) pre-scaled; k, v (B, K, Sp, D). Returns o like q, lse (B, K, G, Lp)."""
  b, kh, g, lp, d = q.shape
  sp = k.shape[2]
  bq, bk = st.block_q, st.block_k
  nq, nk = lp // bq, sp // bk

  def q_block(i, carry):
    o_buf, lse_buf = carry
    q_i = jax.lax.dynamic_slice_in_dim(q, i * bq, bq, axis=3)

    def kv_block(j, state):
      m_prev, l_prev, acc = state
      k_j = jax.lax.dynamic_slice_in_dim(k, j * bk, bk, axis=2)
      v_j = jax.lax.dynamic_slice_in_dim(v, j * bk, bk, axis=2)
      s, _ = _tile_logits(q_i, k_j, i, j, aux, st)
      m_new = jnp.maximum(m_prev, jnp.max(s, axis=-1))
      p = jnp.exp(s - m_new[..., None])
      alpha = jnp.exp(m_prev - m_new)
      l_new = alpha * l_prev + jnp.sum(p, axis=-1)
      pv = jnp.einsum("bkgqc,bkcd->bkgqd", p.astype(v.dtype), v_j, preferred_element_type=jnp.float32)
      return m_new, l_new, acc * alpha[..., None] + pv

    lo, hi = _kv_block_range(i, st, aux["q_offset"], nk)
    init = (*_sink_state(aux, (b, kh, g, bq)), jnp.zeros((b, kh, g, bq, d), jnp.float32))
    m, l, acc = jax.lax.fori_loop(lo, hi, kv_block, init)
    seen = m > MASK_VALUE  # False: no visible key (and no sink) in this row
    l_safe = jnp.where(seen, l, 1.0)
    o_i = jnp.where(seen[..., None], acc / l_safe[..., None], 0.0)
    lse_i = jnp.where(seen, m + jnp.log(l_safe), jnp.inf)
    o_buf = jax.lax.dynamic_update_slice_in_dim(o_buf, o_i.astype(o_buf.dtype), i * bq, axis=3)
    lse_buf = jax.lax.dynamic_update_slice_in_dim(lse_buf, lse_i, i * bq, axis=3)
    return o_buf, lse_buf

  init = (jnp.zeros((b, kh, g, lp, d), v.dtype), jnp.zeros((b, kh, g, lp), jnp.float32))
  return jax.lax.fori_loop(0, nq, q_block, init)


def _backward(st: _Static, q: Array, k: Array, v: Array, aux: dict, o: Array, lse: Array,
              do: Array) -> tuple[Array, Array, Array, Array | None]:
  """FlashAttention-2 backward, head-major like `_forward`. Returns float32 dq (w.r.t. the scaled q),
  dk, dv, and the sinks' (K, G) gradient (None without sinks)."""
  b, kh, g, lp, d = q.shape
  sp = k.shape[2]
  bq, bk = st.block_q, st.block_k
  nq, nk = lp // bq, sp // bk
  delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)  # (B, K, G, Lp) like lse

  def kv_block(j, dq_buf):
    k_j = jax.lax.dynamic_slice_in_dim(k, j * bk, bk, axis=2)
    v_j = jax.lax.dynamic_slice_in_dim(v, j * bk, bk, axis=2)

    def q_block(i, carry):
      dq_acc, dk_j, dv_j = carry
      q_i = jax.lax.dynamic_slice_in_dim(q, i * bq, bq, axis=3)
      do_i = jax.lax.dynamic_slice_in_dim(do, i * bq, bq, axis=3)
      lse_i = jax.lax.dynamic_slice_in_dim(lse, i * bq, bq, axis=3)
      delta_i = jax.lax.dynamic_slice_in_dim(delta, i * bq, bq, axis=3)
      s, dcap = _tile_logits(q_i, k_j, i, j, aux, st)
      p = jnp.exp(s - lse_i[..., None])  # masked entries and fully masked rows (lse = inf) give 0
      dv_j = dv_j + jnp.einsum("bkgqc,bkgqd->bkcd", p.astype(do.dtype), do_i,
                               preferred_element_type=jnp.float32)
      dp = jnp.einsum("bkgqd,bkcd->bkgqc", do_i, v_j, preferred_element_type=jnp.float32)
      ds = p * (dp - delta_i[..., None])
      if dcap is not None:
        ds = ds * dcap
      dk_j = dk_j + jnp.einsum("bkgqc,bkgqd->bkcd", ds.astype(q.dtype), q_i,
                               preferred_element_type=jnp.float32)
      dq_i = jnp.einsum("bkgqc,bkcd->bkgqd", ds.astype(k.dtype), k_j, preferred_element_type=jnp.float32)
      dq_old = jax.lax.dynamic_slice_in_dim(dq_acc, i * bq, bq, axis=3)
      dq_acc = jax.lax.dynamic_update_slice_in_dim(dq_acc, dq_old + dq_i, i * bq, axis=3)
      return dq_acc, dk_j, dv_j

    lo, hi = _q_block_range(j, st, aux["q_offset"], nq)
    zeros_kv = jnp.zeros((b, kh, bk, d), jnp.float32)
    dq_buf, dk_j, dv_j = jax.lax.fori_loop(lo, hi, q_block, (dq_buf, zeros_kv, zeros_kv))
    return dq_buf, dk_j, dv_j

  def kv_step(j, carry):
    dq_buf, dk_buf, dv_buf = carry
    dq_buf, dk_j, dv_j = kv_block(j, dq_buf)
    dk_buf = jax.lax.dynamic_update_slice_in_dim(dk_buf, dk_j, j * bk, axis=2)
    dv_buf = jax.lax.dynamic_update_slice_in_dim(dv_buf, dv_j, j * bk, axis=2)
    return dq_buf, dk_buf, dv_buf

  init = (jnp.zeros(q.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32),
          jnp.zeros(v.shape, jnp.float32))
  dq, dk, dv = jax.lax.fori_loop(0, nk, kv_step, init)
  return dq, dk, dv, sink_grad(aux.get("sinks"), lse, delta)


def sink_grad(sinks_KxG: Array | None, lse_BxKxGxL: Array, delta_BxKxGxL: Array) -> Array | None:
  """d loss / d sink (K, G): -sum over rows of p_sink * rowsum(dO * O), p_sink = exp(sink - lse)."""
  if sinks_KxG is None:
    return None
  p_sink = jnp.exp(sinks_KxG[None, :, :, None] - lse_BxKxGxL)
  return -jnp.sum(p_sink * delta_BxKxGxL, axis=(0, 3))


def _zero_cotangent(x: Array | None):
  if x is None:
    return None
  if jnp.issubdtype(x.dtype, jnp.floating):
    return jnp.zeros_like(x)
  return np.zeros(x.shape, dtype=jax.dtypes.float0)


def zero_cotangents(aux: dict) -> dict:
  """Zero cotangents for a dict of non-differentiated mask/bias inputs (float0 for ints and bools,
  None kept): what a custom VJP returns for them."""
  return jax.tree.map(_zero_cotangent, aux, is_leaf=lambda x: x is None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(st: _Static, q: Array, k: Array, v: Array, sinks: Array | None, aux: dict) -> Array:
  return _forward(st, q, k, v, {**aux, "sinks": sinks})[0]


def _flash_fwd(st: _Static, q: Array, k: Array, v: Array, sinks: Array | None, aux: dict):
  o, lse = _forward(st, q, k, v, {**aux, "sinks": sinks})
  return o, (q, k, v, sinks, aux, o, lse)


def _flash_bwd(st: _Static, res, do: Array):
  q, k, v, sinks, aux, o, lse = res
  dq, dk, dv, dsinks = _backward(st, q, k, v, {**aux, "sinks": sinks}, o, lse, do)
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
          None if sinks is None else dsinks.astype(sinks.dtype), zero_cotangents(aux))


_flash.defvjp(_flash_fwd, _flash_bwd)


def blockwise_attention(q_BxLxHxD: Array, k_BxSxKxD: Array, v_BxSxKxD: Array, *, causal: bool = True,
                        window: int = 0, q_offset: int | Array = 0, alibi_slopes_H: Array | None = None,
                        kv_valid_BxS: Array | None = None, q_segment_ids_BxL: Array | None = None,
                        kv_segment_ids_BxS: Array | None = None, scale: float | None = None,
                        block_q: int = 128, block_k: int = 128, softcap: float = 0.0,
                        sinks_H: Array | None = None) -> Array:
  """Memory-efficient attention; returns (B, L, H, D). See the module docstring for the semantics.

  GQA/MQA: K divides H, K/V are never repeated. `q_offset` may be a traced scalar (cached decoding).
  kv_segment_ids_BxS defaults to q_segment_ids_BxL (self-attention). No gradient flows to ALiBi slopes.
  """
  b, l, h, d = q_BxLxHxD.shape
  s, kh = k_BxSxKxD.shape[1], k_BxSxKxD.shape[2]
  if k_BxSxKxD.shape != v_BxSxKxD.shape or k_BxSxKxD.shape[-1] != d or h % kh:
    raise ValueError(f"bad shapes q {q_BxLxHxD.shape}, k {k_BxSxKxD.shape}, v {v_BxSxKxD.shape}")
  if window < 0:
    raise ValueError(f"window must be >= 0, got {window}")
  g = h // kh
  scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
  bq, bk = max(1, min(block_q, l)), max(1, min(block_k, s))
  lp, sp = _ceil_div(l, bq) * bq, _ceil_div(s, bk) * bk
  st = _Static(causal=bool(causal), window=int(window), scale=scale, block_q=bq, block_k=bk,
               softcap=float(softcap))

  kv_valid = None if kv_valid_BxS is None else kv_valid_BxS.astype(bool)
  if sp != s:  # padded keys are invalid
    kv_valid = jnp.ones((b, s), bool) if kv_valid is None else kv_valid
    kv_valid = _pad_axis(kv_valid, 1, sp, False)
  q_seg = kv_seg = None
  if q_segment_ids_BxL is not None:
    kv_seg = q_segment_ids_BxL if kv_segment_ids_BxS is None else kv_segment_ids_BxS
    q_seg = _pad_axis(q_segment_ids_BxL.astype(jnp.int32), 1, lp, 0)
    kv_seg = _pad_axis(kv_seg.astype(jnp.int32), 1, sp, 0)
  elif kv_segment_ids_BxS is not None:
    raise ValueError("kv_segment_ids_BxS given without q_segment_ids_BxL")
  aux = {"q_offset": jnp.asarray(q_offset, jnp.int32), "slopes": alibi_slopes_H, "kv_valid": kv_valid,
         "q_seg": q_seg, "kv_seg": kv_seg}
  if alibi_slopes_H is not None:
    aux["slopes"] = jnp.asarray(alibi_slopes_H, jnp.float32).reshape(h)

  # head-major layouts, so every tile product is a plain batched matmul over (B, K)
  q = _pad_axis(q_BxLxHxD * jnp.asarray(scale, q_BxLxHxD.dtype), 1, lp).reshape(b, lp, kh, g, d)
  q_BxKxGxLxD = jnp.transpose(q, (0, 2, 3, 1, 4))
  k_BxKxSxD = jnp.transpose(_pad_axis(k_BxSxKxD, 1, sp), (0, 2, 1, 3))
  v_BxKxSxD = jnp.transpose(_pad_axis(v_BxSxKxD, 1, sp), (0, 2, 1, 3))
  sinks = None if sinks_H is None else sinks_H.astype(jnp.float32).reshape(kh, g)
  o_BxKxGxLxD = _flash(st, q_BxKxGxLxD, k_BxKxSxD, v_BxKxSxD, sinks, aux)
  return jnp.transpose(o_BxKxGxLxD, (0, 3, 1, 2, 4)).reshape(b, lp, h, d)[:, :l]
