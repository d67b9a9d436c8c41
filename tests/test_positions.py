"""Position ops: sinusoidal table, RoPE relative property and layouts, ALiBi slopes."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tformer_jax.ops import positions as P


def test_sinusoidal_table_formula_and_traced_version():
  t = np.asarray(P.sinusoidal_table(50, 16))
  pos, i = 7, 3
  assert t[pos, 2 * i] == pytest.approx(math.sin(pos / 10000 ** (2 * i / 16)), abs=1e-6)
  assert t[pos, 2 * i + 1] == pytest.approx(math.cos(pos / 10000 ** (2 * i / 16)), abs=1e-6)
  at = P.sinusoidal_at(jnp.arange(50)[None], 16)[0]
  np.testing.assert_allclose(np.asarray(at), t, atol=1e-5)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_rope_dot_product_depends_only_on_offset(layout, fraction):
  d = 16
  inv = P.rope_inv_freq(P.rotary_dim(d, fraction))
  q = jax.random.normal(jax.random.PRNGKey(0), (1, 1, 1, d))
  k = jax.random.normal(jax.random.PRNGKey(1), (1, 1, 1, d))

  def score(pq, pk):
    rq = P.apply_rope(q, jnp.array([[pq]]), inv, layout=layout)
    rk = P.apply_rope(k, jnp.array([[pk]]), inv, layout=layout)
    return float(jnp.sum(rq * rk))

  assert score(3, 1) == pytest.approx(score(103, 101), abs=1e-4)
  assert score(3, 1) != pytest.approx(score(3, 2), abs=1e-3)
  # norm preserved; the unrotated tail untouched
  r = P.apply_rope(q, jnp.array([[5]]), inv, layout=layout)
  np.testing.assert_allclose(float(jnp.linalg.norm(r)), float(jnp.linalg.norm(q)), rtol=1e-5)
  rot = P.rotary_dim(d, fraction)
  np.testing.assert_array_equal(np.asarray(r[..., rot:]), np.asarray(q[..., rot:]))


def test_rope_layouts_agree_up_to_channel_permutation():
  d = 8
  inv = P.rope_inv_freq(d)
  x = jax.random.normal(jax.random.PRNGKey(0), (1, 3, 1, d))
  pos = jnp.arange(3)[None]
  perm = np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)])  # interleaved -> half
  half = P.apply_rope(x[..., perm], pos, inv, layout="half")
  inter = P.apply_rope(x, pos, inv, layout="interleaved")[..., perm]
  np.testing.assert_allclose(np.asarray(half), np.asarray(inter), atol=1e-6)


def test_alibi_slopes():
  s8 = np.asarray(P.alibi_slopes(8))
  np.testing.assert_allclose(s8, [2 ** -(i + 1) for i in range(8)], rtol=1e-6)
  s6 = np.asarray(P.alibi_slopes(6))  # closest power of 2 is 4: slopes(4) + slopes(8)[0::2][:2]
  exp = [2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8, 2 ** -1, 2 ** -3]
  np.testing.assert_allclose(s6, exp, rtol=1e-6)
  assert len(np.asarray(P.alibi_slopes(12))) == 12
  b = P.alibi_bias(P.alibi_slopes(2), jnp.arange(3)[None], jnp.arange(3)[None])
  assert b.shape == (1, 2, 3, 3) and float(b[0, 0, 2, 0]) == pytest.approx(-2 * 0.0625)
