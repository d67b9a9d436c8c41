"""Chunked attention (static query chunks, causal tiles skipped, hand-written VJP) equals dense
dot_product_attention: outputs and q/k/v gradients, every case of the blockwise suite (fully masked
rows: tests/test_blockwise.py, for both).

Tolerance: float32, atol = rtol = 1e-5, against the dense reference with the equivalent mask/bias.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_blockwise import BANDS, CASES, _inputs, assert_matches_reference, case_and_reference, visibility

from tformer_jax.ops import masks
from tformer_jax.ops.attention import dot_product_attention
from tformer_jax.ops.chunked_attention import chunk_key_range, chunked_attention

TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk", [16, 7])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_dense(name, chunk):
  (q, k, v, ct), op_kw, ref = case_and_reference(*CASES[name])
  chk = lambda q, k, v: chunked_attention(q, k, v, **op_kw, chunk=chunk)  # noqa: E731
  assert_matches_reference(chk, ref, q, k, v, ct)


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


@pytest.mark.parametrize("causal,window,q_offset", BANDS)
def test_chunk_key_ranges_are_tight(causal, window, q_offset):
  c, l, s = 8, 40, 60
  vis = visibility(l, s, causal, window, q_offset)
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
