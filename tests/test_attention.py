"""Reference attention: the article's hand example, masks, GQA grouping, parity with jax.nn."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tformer_jax.ops import attention as A, masks as M


def test_article_hand_example():
  # First article, 2.3: Q = K = [[1,0],[0,1],[1,1]], V = [[1,2],[3,4],[5,6]], d_k = 2.
  q = jnp.array([[1., 0.], [0., 1.], [1., 1.]])[None, :, None, :]
  v = jnp.array([[1., 2.], [3., 4.], [5., 6.]])[None, :, None, :]
  out, w = A.dot_product_attention(q, q, v, return_weights=True)
  row0 = np.asarray(w[0, 0, 0])
  logits = np.array([1, 0, 1]) / math.sqrt(2)  # [0.707, 0, 0.707]
  expected = np.exp(logits) / np.exp(logits).sum()
  np.testing.assert_allclose(row0, expected, atol=1e-6)
  np.testing.assert_allclose(row0, [0.401, 0.198, 0.401], atol=1e-3)  # the article rounds to .39/.22/.39
  np.testing.assert_allclose(np.asarray(out[0, 0, 0]), expected @ np.array([[1, 2], [3, 4], [5, 6]]), atol=1e-5)


def _rand(shape, seed):
  return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32)


def test_rows_sum_to_one_and_padding_gets_zero_weight():
  q, k = _rand((2, 5, 4, 8), 0), _rand((2, 6, 2, 8), 1)
  lengths = jnp.array([6, 3])
  mask = M.padding_mask_from_lengths(lengths, 6)
  w = A.attention_weights(q, k, mask=mask)
  np.testing.assert_allclose(np.asarray(w.sum(-1)), 1.0, atol=1e-6)
  assert float(jnp.abs(w[1, :, :, 3:]).max()) == 0.0


def test_fully_masked_row_has_no_nan():
  q, k, v = _rand((1, 4, 2, 8), 0), _rand((1, 4, 2, 8), 1), _rand((1, 4, 2, 8), 2)
  mask = jnp.zeros((1, 1, 4, 4), bool).at[..., 1:, :].set(M.causal_mask(4)[0, 0, 1:])
  out, w = A.dot_product_attention(q, k, v, mask=mask, return_weights=True)
  assert np.isfinite(np.asarray(out)).all()
  np.testing.assert_array_equal(np.asarray(w[0, :, 0]), 0.0)
  np.testing.assert_array_equal(np.asarray(out[0, 0]), 0.0)
  g = jax.grad(lambda q: A.dot_product_attention(q, k, v, mask=mask).sum())(q)
  assert np.isfinite(np.asarray(g)).all()


def test_gqa_equals_repeated_kv_mha():
  q, k, v = _rand((2, 5, 8, 16), 0), _rand((2, 7, 2, 16), 1), _rand((2, 7, 2, 16), 2)
  mask = M.combine_masks(M.causal_mask(5, 7, offset=2), M.padding_mask_from_lengths(jnp.array([7, 5]), 7))
  out = A.dot_product_attention(q, k, v, mask=mask)
  ref = A.dot_product_attention(q, jnp.repeat(k, 4, axis=2), jnp.repeat(v, 4, axis=2), mask=mask)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-6)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("masked", [False, True])
def test_reference_equals_jax_nn(kv_heads, masked):
  q, k, v = _rand((2, 6, 4, 8), 0), _rand((2, 6, kv_heads, 8), 1), _rand((2, 6, kv_heads, 8), 2)
  mask = None
  if masked:
    mask = M.combine_masks(M.causal_mask(6), M.padding_mask_from_lengths(jnp.array([6, 4]), 6))
  bias = _rand((1, 4, 6, 6), 3)
  ref = A.dot_product_attention(q, k, v, mask=mask, bias=bias)
  xla = A.dot_product_attention(q, k, v, mask=mask, bias=bias, impl="xla")
  direct = jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask, implementation="xla")
  np.testing.assert_allclose(np.asarray(ref), np.asarray(xla), atol=1e-5)
  np.testing.assert_allclose(np.asarray(ref), np.asarray(direct), atol=1e-5)


def test_softmax_in_float32_for_bf16_inputs():
  q, k, v = (_rand((1, 8, 2, 16), i).astype(jnp.bfloat16) for i in range(3))
  w = A.attention_weights(q, k, mask=M.causal_mask(8))
  assert w.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(w.sum(-1)), 1.0, atol=1e-6)
  out = A.dot_product_attention(q, k, v)
  assert out.dtype == jnp.bfloat16


def test_segment_mask_and_errors():
  seg = jnp.array([[1, 1, 2, 2, 0]])
  m = M.segment_mask(seg)[0, 0]
  assert bool(m[0, 1]) and not bool(m[0, 2]) and not bool(m[4, 4])
  with pytest.raises(ValueError, match="not divisible"):
    A.dot_product_attention(_rand((1, 2, 3, 4), 0), _rand((1, 2, 2, 4), 1), _rand((1, 2, 2, 4), 2))
  with pytest.raises(ValueError, match="unknown attention impl"):
    A.dot_product_attention(_rand((1, 2, 2, 4), 0), _rand((1, 2, 2, 4), 1), _rand((1, 2, 2, 4), 2), impl="x")
