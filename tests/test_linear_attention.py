"""Linear attention: the O(L) forms equal the explicit quadratic formula (float32, atol = rtol = 1e-5)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tformer_jax.ops.linear_attention import feature_map, linear_attention, linear_attention_quadratic

TOL = dict(atol=1e-5, rtol=1e-5)


def _qkv(b, l, s, h, kh, d, e, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 3)
  return (jax.random.normal(ks[0], (b, l, h, d)), jax.random.normal(ks[1], (b, s, kh, d)),
          jax.random.normal(ks[2], (b, s, kh, e)))


def test_feature_map_is_elu_plus_one():
  x = jnp.linspace(-5.0, 5.0, 101)
  want = np.where(np.asarray(x) > 0, np.asarray(x) + 1.0, np.exp(np.asarray(x)))
  np.testing.assert_allclose(np.asarray(feature_map(x)), want, rtol=1e-6, atol=1e-7)
  assert float(feature_map(x).min()) > 0.0


def test_quadratic_matches_numpy_formula():
  q, k, v = _qkv(1, 9, 9, 2, 1, 4, 3)
  phi = lambda x: np.where(x > 0, x + 1.0, np.exp(x))  # noqa: E731
  pq, pk, vv = phi(np.asarray(q, np.float64)), phi(np.asarray(k, np.float64)), np.asarray(v, np.float64)
  for causal in (False, True):
    got = np.asarray(linear_attention_quadratic(q, k, v, causal=causal))
    for hh in range(2):
      a = pq[0, :, hh] @ pk[0, :, 0].T
      if causal:
        a = np.tril(a)
      want = (a @ vv[0, :, 0]) / a.sum(-1, keepdims=True)
      np.testing.assert_allclose(got[0, :, hh], want, **TOL)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("l,chunk,h,kh", [(50, 16, 4, 4), (64, 16, 8, 2), (37, 64, 4, 1), (23, 5, 6, 3)])
def test_matches_quadratic(causal, l, chunk, h, kh):
  q, k, v = _qkv(2, l, l, h, kh, 8, 12)
  got = jax.jit(lambda q, k, v: linear_attention(q, k, v, causal=causal, chunk_size=chunk))(q, k, v)
  want = linear_attention_quadratic(q, k, v, causal=causal)
  assert got.shape == (2, l, h, 12)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL)


def test_noncausal_cross_lengths_and_causality():
  q, k, v = _qkv(1, 7, 19, 4, 2, 8, 8)
  np.testing.assert_allclose(np.asarray(linear_attention(q, k, v, causal=False)),
                             np.asarray(linear_attention_quadratic(q, k, v, causal=False)), **TOL)
  # causal: changing a later token never changes earlier outputs
  q, k, v = _qkv(1, 30, 30, 2, 2, 8, 8)
  out = linear_attention(q, k, v, causal=True, chunk_size=8)
  out2 = linear_attention(q, k.at[:, 20:].add(3.0), v.at[:, 20:].add(3.0), causal=True, chunk_size=8)
  np.testing.assert_array_equal(np.asarray(out[:, :20]), np.asarray(out2[:, :20]))
  assert not np.allclose(np.asarray(out[:, 20:]), np.asarray(out2[:, 20:]))


def test_gradients_match_quadratic():
  q, k, v = _qkv(1, 21, 21, 4, 2, 8, 8)
  f = lambda fn: jax.grad(lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v))), argnums=(0, 1, 2))(q, k, v)  # noqa
  got = f(lambda q, k, v: linear_attention(q, k, v, causal=True, chunk_size=8))
  want = f(lambda q, k, v: linear_attention_quadratic(q, k, v, causal=True))
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), **TOL)


def test_masked_quadratic_form():
  """A visibility mask (padding + causal) zeroes A outside it; weights rows sum to 1; a query that sees
  no key gets 0; with only the causal mask it equals the causal O(L) form."""
  from tformer_jax.ops import masks
  q, k, v = _qkv(2, 11, 11, 4, 2, 8, 6)
  valid = jnp.arange(11)[None, :] >= jnp.asarray([[0], [3]])    # row 1: three left-padding keys
  mask = masks.combine_masks(masks.causal_mask(11), masks.padding_mask(valid))
  out, w = linear_attention_quadratic(q, k, v, causal=False, mask=mask, return_weights=True)
  phi = lambda x: np.where(x > 0, x + 1.0, np.exp(x))  # noqa: E731
  pq, pk, vv = (np.asarray(x, np.float64) for x in (phi(np.asarray(q)), phi(np.asarray(k)), v))
  m = np.asarray(mask)
  for b in range(2):
    for hh in range(4):
      a = (pq[b, :, hh] @ pk[b, :, hh // 2].T) * m[b, 0]
      den = a.sum(-1, keepdims=True)
      want = np.where(den > 0, (a @ vv[b, :, hh // 2]) / np.where(den > 0, den, 1.0), 0.0)
      np.testing.assert_allclose(np.asarray(out)[b, :, hh], want, **TOL)
  np.testing.assert_array_equal(np.asarray(out)[1, :3], 0.0)    # padding queries see nothing
  np.testing.assert_allclose(np.asarray(w).sum(-1)[0], 1.0, rtol=1e-6)
  assert np.all(np.asarray(w)[np.broadcast_to(~m, w.shape)] == 0.0)
  np.testing.assert_allclose(np.asarray(linear_attention_quadratic(q, k, v, causal=False, mask=masks.causal_mask(11))),
                             np.asarray(linear_attention(q, k, v, causal=True, chunk_size=4)), **TOL)
