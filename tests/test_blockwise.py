"""Blockwise (flash) attention equals dense dot_product_attention: outputs and q/k/v gradients.

Tolerance: float32, atol = rtol = 1e-5, against the dense reference with the equivalent mask/bias.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tformer_jax.ops import masks, positions
from tformer_jax.ops.attention import dot_product_attention
from tformer_jax.ops.blockwise import _kv_block_range, _q_block_range, _Static, blockwise_attention

TOL = dict(atol=1e-5, rtol=1e-5)


def _inputs(b, l, s, h, kh, d, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  q = jax.random.normal(ks[0], (b, l, h, d), jnp.float32)
  k = jax.random.normal(ks[1], (b, s, kh, d), jnp.float32)
  v = jax.random.normal(ks[2], (b, s, kh, d), jnp.float32)
  ct = jax.random.normal(ks[3], (b, l, h, d), jnp.float32)
  return q, k, v, ct


def _dense_mask_bias(b, l, s, h, *, causal, window, q_offset, alibi, kv_valid, q_seg, kv_seg):
  q_pos = q_offset + jnp.arange(l)
  k_pos = jnp.arange(s)
  mask = jnp.ones((1, 1, l, s), bool)
  if causal:
    mask = mask & masks.causal_mask(l, s, offset=q_offset)
    if window:
      mask = mask & masks.sliding_window_mask(l, s, window=window, offset=q_offset)
  elif window:
    mask = mask & (jnp.abs(q_pos[:, None] - k_pos[None, :]) < window)[None, None]
  if kv_valid is not None:
    mask = mask & masks.padding_mask(kv_valid)
  if q_seg is not None:
    mask = mask & masks.segment_mask(q_seg, kv_seg)
  bias = None
  if alibi:
    bias = positions.alibi_bias(positions.alibi_slopes(h), q_pos[None], k_pos[None], causal=causal)
  return mask, bias


CASES = {
    # name: (b, l, s, h, kh, d, kwargs); blocks default to (16, 16)
    "noncausal_gqa": (2, 37, 53, 8, 2, 16, dict(causal=False)),
    "causal_gqa_ragged": (2, 45, 45, 8, 2, 16, dict(causal=True, blocks=(16, 8))),
    "causal_mqa_padding": (2, 40, 40, 8, 1, 8, dict(causal=True, padding=True)),
    "alibi_causal_segments": (2, 45, 45, 8, 2, 16, dict(causal=True, alibi=True, segments=True)),
    "alibi_noncausal": (1, 29, 41, 4, 2, 16, dict(causal=False, alibi=True, blocks=(8, 16))),
    "window": (2, 70, 70, 8, 2, 16, dict(causal=True, window=19)),
    "window_noncausal": (1, 53, 53, 4, 2, 16, dict(causal=False, window=11)),
    "q_offset": (2, 21, 70, 8, 2, 16, dict(causal=True, q_offset=49, alibi=True, padding=True)),
    "q_offset_window": (1, 13, 64, 4, 1, 16, dict(causal=True, q_offset=51, window=17, blocks=(8, 8))),
    "decode_step": (2, 1, 30, 4, 2, 8, dict(causal=True, q_offset=29, padding=True)),
}


def case_and_reference(b, l, s, h, kh, d, kw):
  """((q, k, v, ct), the op's keyword arguments, the dense reference fn) for one CASES entry."""
  q, k, v, ct = _inputs(b, l, s, h, kh, d)
  causal, window, q_offset = kw["causal"], kw.get("window", 0), kw.get("q_offset", 0)
  rng = np.random.default_rng(1)
  kv_valid = q_seg = kv_seg = None
  if kw.get("padding"):
    lengths = rng.integers(s // 2, s + 1, size=b)
    kv_valid = jnp.asarray(np.arange(s)[None, :] < lengths[:, None])
  if kw.get("segments"):
    seg = np.sort(rng.integers(1, 4, size=(b, l)), axis=1)
    seg[:, -5:] = 0  # trailing padding segment
    q_seg = kv_seg = jnp.asarray(seg, jnp.int32)
  mask, bias = _dense_mask_bias(b, l, s, h, causal=causal, window=window, q_offset=q_offset,
                                alibi=kw.get("alibi", False), kv_valid=kv_valid, q_seg=q_seg, kv_seg=kv_seg)
  op_kw = dict(causal=causal, window=window, q_offset=q_offset,
               alibi_slopes_H=positions.alibi_slopes(h) if kw.get("alibi") else None,
               kv_valid_BxS=kv_valid, q_segment_ids_BxL=q_seg, kv_segment_ids_BxS=kv_seg)
  return (q, k, v, ct), op_kw, lambda q, k, v: dot_product_attention(q, k, v, mask=mask, bias=bias)


def assert_matches_reference(fn, ref, q, k, v, ct):
  """fn's output and q/k/v gradients (for cotangent ct) equal ref's, finite, within TOL."""
  def out_and_grads(f):
    o, vjp = jax.vjp(f, q, k, v)
    return (o,) + vjp(ct)

  want = jax.jit(lambda: out_and_grads(ref))()
  got = jax.jit(lambda: out_and_grads(fn))()
  for name, w, g in zip(("out", "dq", "dk", "dv"), want, got):
    assert np.all(np.isfinite(np.asarray(g))), name
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), err_msg=name, **TOL)
  return got


def _run_case(b, l, s, h, kh, d, kw):
  (q, k, v, ct), op_kw, ref = case_and_reference(b, l, s, h, kh, d, kw)
  bq, bk = kw.get("blocks", (16, 16))
  blk = lambda q, k, v: blockwise_attention(q, k, v, **op_kw, block_q=bq, block_k=bk)  # noqa: E731
  return assert_matches_reference(blk, ref, q, k, v, ct)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_dense(name):
  b, l, s, h, kh, d, kw = CASES[name]
  _run_case(b, l, s, h, kh, d, kw)


@pytest.mark.parametrize("impl", ["blockwise", "chunked"])
def test_fully_masked_rows_are_zero_not_nan(impl):
  from tformer_jax.ops.chunked_attention import chunked_attention
  b, l, h, kh, d = 2, 20, 4, 2, 8
  q, k, v, ct = _inputs(b, l, l, h, kh, d)
  kv_valid = jnp.zeros((b, l), bool).at[0, 10:].set(True)  # batch 1 sees nothing; batch 0 rows < 10 too

  def f(q, k, v):
    if impl == "chunked":
      return chunked_attention(q, k, v, causal=True, kv_valid_BxS=kv_valid, chunk=8)
    return blockwise_attention(q, k, v, causal=True, kv_valid_BxS=kv_valid, block_q=8, block_k=8)

  o, vjp = jax.vjp(jax.jit(f), q, k, v)
  dq, dk, dv = vjp(ct)
  for x in (o, dq, dk, dv):
    assert np.all(np.isfinite(np.asarray(x)))
  np.testing.assert_array_equal(np.asarray(o[1]), 0.0)
  np.testing.assert_array_equal(np.asarray(o[0, :10]), 0.0)
  np.testing.assert_array_equal(np.asarray(dq[1]), 0.0)
  np.testing.assert_array_equal(np.asarray(dk[1]), 0.0)
  ref = dot_product_attention(q, k, v, mask=masks.causal_mask(l) & masks.padding_mask(kv_valid))
  np.testing.assert_allclose(np.asarray(o), np.asarray(ref), **TOL)


def test_traced_q_offset_under_jit():
  b, l, s, h, kh, d = 1, 8, 40, 4, 2, 8
  q, k, v, _ = _inputs(b, l, s, h, kh, d)
  f = jax.jit(lambda off: blockwise_attention(q, k, v, causal=True, q_offset=off, block_q=8, block_k=8))
  for off in (0, 17, 32):  # one compilation, three offsets
    ref = dot_product_attention(q, k, v, mask=masks.causal_mask(l, s, offset=off))
    np.testing.assert_allclose(np.asarray(f(jnp.int32(off))), np.asarray(ref), **TOL)


def visibility(l, s, causal, window, q_offset):
  """(l, s) bool: which key each query sees (query i at position q_offset + i)."""
  p = q_offset + np.arange(l)[:, None]
  j = np.arange(s)[None, :]
  vis = np.ones((l, s), bool)
  if causal:
    vis &= j <= p
    if window:
      vis &= j > p - window
  elif window:
    vis &= np.abs(p - j) < window
  return vis


BANDS = [(True, 0, 0), (True, 7, 0), (True, 7, 13), (False, 9, 5), (False, 0, 0), (True, 40, 3)]


@pytest.mark.parametrize("causal,window,q_offset", BANDS)
def test_block_ranges_cover_band_tightly(causal, window, q_offset):
  bq, bk, l, s = 8, 4, 40, 60
  st = _Static(causal=causal, window=window, scale=1.0, block_q=bq, block_k=bk)
  nq, nk = l // bq, s // bk
  vis = visibility(l, s, causal, window, q_offset)
  blocks = vis.reshape(nq, bq, nk, bk).any(axis=(1, 3))
  for i in range(nq):
    lo, hi = (int(x) for x in _kv_block_range(jnp.int32(i), st, jnp.int32(q_offset), nk))
    want = np.nonzero(blocks[i])[0]
    assert (lo, hi) == ((want.min(), want.max() + 1) if want.size else (lo, lo)), (i, lo, hi)
  for jb in range(nk):
    lo, hi = (int(x) for x in _q_block_range(jnp.int32(jb), st, jnp.int32(q_offset), nq))
    want = np.nonzero(blocks[:, jb])[0]
    if want.size:
      assert (lo, hi) == (want.min(), want.max() + 1), (jb, lo, hi)
    else:
      assert lo == hi
  if window and causal:  # O(L * w): each query block visits only ~ (bq + w) / bk key blocks
    visits = sum(int(np.subtract(*_kv_block_range(jnp.int32(i), st, jnp.int32(q_offset), nk)[::-1]))
                 for i in range(nq))
    assert visits <= nq * (-(-(bq + window) // bk) + 1)


def test_benchmark_smoke(tmp_path):
  from tformer_jax.bench.attention import main

  out = tmp_path / "bench.json"
  res = main(["--seq", "64,96", "--heads", "2", "--head-dim", "8", "--block", "32", "--repeats", "1",
              "--json", str(out)])
  rows = {(r["impl"], r["seq"]): r for r in res["results"]}
  assert set(rows) == {(i, s) for i in ("reference", "blockwise") for s in (64, 96)}
  for r in rows.values():
    assert r["time_s"] is not None and r["time_s"] > 0
    assert r["temp_bytes"] is not None and r["peak_bytes"] >= r["temp_bytes"]
  assert out.read_text().strip().startswith("{")
  assert "memory_ratio_at_96" in res["targets"]
