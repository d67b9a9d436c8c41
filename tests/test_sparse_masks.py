"""Sparse attention masks (sliding window, local band, global tokens, BigBird random blocks) against
brute-force Python constructions, and their effect through dot_product_attention (exact zero weights)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tformer_jax.ops import masks
from tformer_jax.ops.attention import attention_weights, dot_product_attention


def _brute(l, s, rule):
  return np.array([[bool(rule(i, j)) for j in range(s)] for i in range(l)])[None, None]


@pytest.mark.parametrize("l,s,window,offset", [(10, 10, 3, 0), (7, 19, 4, 12), (12, 12, 1, 0),
                                               (9, 9, 20, 0), (5, 30, 8, 25)])
def test_sliding_window(l, s, window, offset):
  got = np.asarray(masks.sliding_window_mask(l, s, window=window, offset=offset))
  want = _brute(l, s, lambda i, j: offset + i - window < j <= offset + i)
  np.testing.assert_array_equal(got, want)
  assert got.shape == (1, 1, l, s)
  if offset == 0 and window >= l:  # a window covering everything is plain causal
    np.testing.assert_array_equal(got, np.asarray(masks.causal_mask(l, s)))


@pytest.mark.parametrize("l,s,window", [(10, 10, 3), (6, 11, 2), (8, 8, 1), (5, 5, 9)])
def test_local_window(l, s, window):
  got = np.asarray(masks.local_window_mask(l, s, window=window))
  np.testing.assert_array_equal(got, _brute(l, s, lambda i, j: abs(i - j) < window))


@pytest.mark.parametrize("l,s,g", [(10, 10, 2), (6, 9, 0), (5, 5, 7)])
def test_global_tokens(l, s, g):
  got = np.asarray(masks.global_token_mask(l, s, num_global=g))
  np.testing.assert_array_equal(got, _brute(l, s, lambda i, j: i < g or j < g))
  # Longformer pattern: (local | global) & causal
  combo = np.asarray(masks.combine_masks(masks.local_window_mask(l, s, window=2) | got,
                                         masks.causal_mask(l, s)))
  want = _brute(l, s, lambda i, j: (abs(i - j) < 2 or i < g or j < g) and j <= i)
  np.testing.assert_array_equal(combo, want)


def _brute_random(l, s, block, r, seed):
  rng = np.random.default_rng(seed)
  nq, nk = -(-l // block), -(-s // block)
  out = np.zeros((l, s), bool)
  for qb in range(nq):
    for kb in rng.choice(nk, size=min(r, nk), replace=False):
      for i in range(qb * block, min((qb + 1) * block, l)):
        for j in range(kb * block, min((kb + 1) * block, s)):
          out[i, j] = True
  return out[None, None]


@pytest.mark.parametrize("l,s,block,r,seed", [(16, 16, 4, 2, 0), (13, 22, 4, 3, 7), (10, 10, 5, 9, 1),
                                              (8, 8, 3, 0, 0)])
def test_random_blocks_brute_force(l, s, block, r, seed):
  got = np.asarray(masks.random_block_mask(l, s, block_size=block, num_random_blocks=r, seed=seed))
  np.testing.assert_array_equal(got, _brute_random(l, s, block, r, seed))
  # block structure: every (query block, key block) tile is all-True or all-False, and each query
  # block sees exactly min(r, #key blocks) key blocks
  nq, nk = -(-l // block), -(-s // block)
  for qb in range(nq):
    seen = 0
    for kb in range(nk):
      tile = got[0, 0, qb * block:(qb + 1) * block, kb * block:(kb + 1) * block]
      assert tile.all() or not tile.any()
      seen += int(tile.all())
    assert seen == min(r, nk)


def test_random_blocks_are_seeded_and_deterministic():
  kw = dict(block_size=4, num_random_blocks=3)
  a = np.asarray(masks.random_block_mask(64, 64, seed=3, **kw))
  b = np.asarray(masks.random_block_mask(64, 64, seed=3, **kw))
  c = np.asarray(masks.random_block_mask(64, 64, seed=4, **kw))
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)
  # a compile-time constant: identical inside jit
  np.testing.assert_array_equal(np.asarray(jax.jit(lambda: masks.random_block_mask(64, 64, seed=3, **kw))()),
                                a)


def test_outside_window_gets_exactly_zero_weight():
  b, l, h, kh, d, window = 2, 12, 4, 2, 8, 3
  ks = jax.random.split(jax.random.PRNGKey(0), 3)
  q = jax.random.normal(ks[0], (b, l, h, d)) * 4.0
  k = jax.random.normal(ks[1], (b, l, kh, d)) * 4.0
  v = jax.random.normal(ks[2], (b, l, kh, d))
  mask = masks.sliding_window_mask(l, window=window)
  w = np.asarray(attention_weights(q, k, mask=mask))
  outside = ~np.asarray(mask)[0, 0]
  assert np.all(w[:, :, outside] == 0.0)  # exactly zero, not merely small
  np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-6)
  # the output equals softmax attention over the in-window keys only
  out = np.asarray(dot_product_attention(q, k, v, mask=mask))
  qn, kn, vn = (np.asarray(x, np.float64) for x in (q, k, v))
  for bb in range(b):
    for hh in range(h):
      for i in range(l):
        js = [j for j in range(l) if i - window < j <= i]
        logits = kn[bb, js, hh // (h // kh)] @ qn[bb, i, hh] / np.sqrt(d)
        p = np.exp(logits - logits.max())
        p /= p.sum()
        np.testing.assert_allclose(out[bb, i, hh], p @ vn[bb, js, hh // (h // kh)], atol=1e-5, rtol=1e-5)
  # moving a key outside every query's window leaves the outputs unchanged
  k2 = k.at[:, 0].set(100.0)
  out2 = np.asarray(dot_product_attention(q, k2, v, mask=mask))
  np.testing.assert_array_equal(out2[:, window:], out[:, window:])


def test_random_and_global_masks_through_attention():
  l, d = 16, 8
  mask = masks.random_block_mask(l, block_size=4, num_random_blocks=1, seed=0) | \
      masks.global_token_mask(l, num_global=1)
  q = jax.random.normal(jax.random.PRNGKey(1), (1, l, 2, d))
  k = jax.random.normal(jax.random.PRNGKey(2), (1, l, 2, d))
  w = np.asarray(attention_weights(q, k, mask=mask))
  m = np.broadcast_to(np.asarray(mask), w.shape)
  assert np.all(w[~m] == 0.0) and np.all(w[m] > 0.0)
  np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-6)
  assert jnp.all(jnp.isfinite(w))


@pytest.mark.parametrize("causal,num_global", [(False, 0), (False, 2), (True, 1)])
def test_visibility_random_blocks_equal_the_op(causal, num_global):
  """Visibility(random=RandomBlocks) = window | global | random_block_mask of the whole context (& causal),
  for a full window and for single decoding queries at traced cache slots."""
  n, block, r, seed, window = 24, 4, 2, 5, 3
  rb = masks.RandomBlocks(num=r, size=block, seed=seed, length=n)
  vis = masks.Visibility(causal=causal, window=window, num_global=num_global, random=rb)
  want = (np.asarray(masks.random_block_mask(n, n, block_size=block, num_random_blocks=r, seed=seed))
          | np.asarray(masks.local_window_mask(n, window=window)))
  if num_global:
    want = want | np.asarray(masks.global_token_mask(n, num_global=num_global))
  if causal:
    want = want & np.asarray(masks.causal_mask(n))
  np.testing.assert_array_equal(np.asarray(vis.mask(n, n)), want)
  row = jax.jit(lambda p: masks.Visibility(causal=causal, window=window, num_global=num_global, random=rb,
                                           q_offset=p).mask(1, n))
  for p in (0, 7, n - 1):
    np.testing.assert_array_equal(np.asarray(row(jnp.int32(p)))[0, 0, 0], want[0, 0, p])
