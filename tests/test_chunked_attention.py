"""Chunked attention (static query chunks, causal tiles skipped, hand-written VJP) equals dense
dot_product_attention: outputs and q/k/v gradients, every case of the blockwise suite.

Tolerance: float32, atol = rtol = 1e-5, against the dense reference with the equivalent mask/bias.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_blockwise import CASES, _dense_mask_bias, _inputs

from tformer_jax.ops import masks, positions
from tformer_jax.ops.attention import dot_product_attention
from tformer_jax.ops.chunked_attention import chunk_key_range, chunked_attention

TOL = dict(atol=1e-5, rtol=1e-5)


def _case_inputs(b, l, s, h, kh, d, kw):
  rng = np.random.default_rng(1)
  kv_valid = q_seg = kv_seg = None
  if kw.get("padding"):
    lengths = rng.integers(s // 2, s + 1, size=b)
    kv_valid = jnp.asarray(np.arange(s)[None, :] < lengths[:, None])
  if kw.get("segments"):
    seg = np.sort(rng.integers(1, 4, size=(b, l)), axis=1)
    seg[:, -5:] = 0  # trailing padding segment
    q_seg = kv_seg = jnp.asarray(seg, jnp.int32)
  return kv_valid, q_seg, kv_seg


@pytest.mark.parametrize("chunk", [16, 7])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_dense(name, chunk):
  b, l, s, h, kh, d, kw = CASES[name]
  q, k, v, ct = _inputs(b, l, s, h, kh, d)
  causal, window, q_offset = kw["causal"], kw.get("window", 0), kw.get("q_offset", 0)
  kv_valid, q_seg, kv_seg = _case_inputs(b, l, s, h, kh, d, kw)
  mask, bias = _dense_mask_bias(b, l, s, h, causal=causal, window=window, q_offset=q_offset,
                                alibi=kw.get("alibi", False), kv_valid=kv_valid, q_seg=q_seg, kv_seg=kv_seg)
  slopes = positions.alibi_slopes(h) if kw.get("alibi") else None

  def ref(q, k, v):
    return dot_product_attention(q, k, v, mask=mask, bias=bias)

  def chk(q, k, v):
    return chunked_attention(q, k, v, causal=causal, window=window, q_offset=q_offset,
                             alibi_slopes_H=slopes, kv_valid_BxS=kv_valid, q_segment_ids_BxL=q_seg,
                             kv_segment_ids_BxS=kv_seg, chunk=chunk)

  def out_and_grads(f):
    o, vjp = jax.vjp(f, q, k, v)
    return (o,) + vjp(ct)

  want = jax.jit(lambda: out_and_grads(ref))()
  got = jax.jit(lambda: out_and_grads(chk))()
  for nm, w, g in zip(("out", "dq", "dk", "dv"), want, got):
    assert np.all(np.isfinite(np.asarray(g))), nm
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), err_msg=nm, **TOL)


def test_fully_masked_rows_are_zero_not_nan():
  b, l, h, kh, d = 2, 20, 4, 2, 8
  q, k, v, ct = _inputs(b, l, l, h, kh, d)
  kv_valid = jnp.zeros((b, l), bool).at[0, 10:].set(True)  # batch 1 sees nothing; batch 0 rows < 10 too

  def f(q, k, v):
    return chunked_attention(q, k, v, causal=True, kv_valid_BxS=kv_valid, chunk=8)

  o, vjp = jax.vjp(jax.jit(f), q, k, v)
  dq, dk, dv = vjp(ct)
  for x in (o, dq, dk, dv):
    assert np.all(np.isfinite(np.asarray(x)))
  np.testing.assert_array_equal(np.asarray(o[1]), 0.0)
  np.testing.assert_array_equal(np.asarray(o[0, :10]), 0.0)
  np.testing.assert_array_equal(np.asarray(dq[1]), 0.0)
  np.testing.assert_array_equal(np.asarray(dk[1]), 0.0)


def test_causal_chunks_skip_masked_tiles():
  """The compiled forward+backward does the chunked work, not the dense one: XLA's FLOP count for
  L=256, chunk 64 is 10/16 of the one-chunk (dense) count within 3% (the rest is softmax/elementwise),
  and the dense count is the 6 matmuls of attention without recompute (within 30%)."""
  b, l, h, d = 2, 256, 2, 32
  q, k, v, ct = _inputs(b, l, l, h, h, d)

  def flops(chunk):
    def f(q, k, v):
      o, vjp = jax.vjp(lambda q, k, v: chunked_attention(q, k, v, causal=True, chunk=chunk), q, k, v)
      return vjp(ct)
    ca = jax.jit(f).lower(q, k, v).compile().cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    return float(ca["flops"])

  dense = 6 * 2 * b * h * l * l * d  # fwd QK^T, PV; bwd dV, dP, dQ, dK; no recompute
  ratio = flops(64) / flops(256)
  assert abs(ratio - 10 / 16) < 0.03, ratio
  assert dense <= flops(256) < 1.3 * dense


@pytest.mark.parametrize("causal,window,q_offset", [(True, 0, 0), (True, 7, 0), (True, 7, 13),
                                                    (False, 9, 5), (False, 0, 0), (True, 40, 3)])
def test_chunk_key_ranges_are_tight(causal, window, q_offset):
  c, l, s = 8, 40, 60
  p = q_offset + np.arange(l)[:, None]
  j = np.arange(s)[None, :]
  vis = np.ones((l, s), bool)
  if causal:
    vis &= j <= p
    if window:
      vis &= j > p - window
  elif window:
    vis &= np.abs(p - j) < window
  for i in range(l // c):
    lo, hi = chunk_key_range(i, c, l, s, causal=causal, window=window, q_offset=q_offset)
    cols = np.nonzero(vis[i * c:(i + 1) * c].any(axis=0))[0]
    assert (lo, hi) == ((cols.min(), cols.max() + 1) if cols.size else (lo, lo)), (i, lo, hi)


def test_bad_arguments_are_clear_errors():
  q, k, v, _ = _inputs(1, 8, 8, 2, 1, 4)
  with pytest.raises(ValueError, match="static"):
    jax.jit(lambda off: chunked_attention(q, k, v, q_offset=off))(jnp.int32(3))
  with pytest.raises(ValueError, match="chunk > 0"):
    chunked_attention(q, k, v, chunk=0)
  with pytest.raises(ValueError, match="bad shapes"):
    chunked_attention(q, k[:, :, :, :2], v, chunk=4)
  ref = dot_product_attention(q, k, v, mask=masks.causal_mask(8))
  np.testing.assert_allclose(np.asarray(chunked_attention(q, k, v, chunk=3)), np.asarray(ref), **TOL)
