"""ops.norms (closed-form backward) equals autodiff through the textbook formulas: outputs and the
gradients w.r.t. x, scale and bias, float32, atol = rtol = 1e-5; also under jit + vmap and remat."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tformer_jax.ops.norms import layer_norm, rms_norm

TOL = dict(atol=1e-5, rtol=1e-5)


def _ln_ref(x, scale, bias, eps):
  mean = jnp.mean(x, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
  y = (x - mean) / jnp.sqrt(var + eps) * scale
  return y if bias is None else y + bias


def _rms_ref(x, scale, eps):
  return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _inputs(shape, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  d = shape[-1]
  x = 3.0 * jax.random.normal(ks[0], shape) + 1.5  # off-centre, not unit scale
  scale = 1.0 + 0.3 * jax.random.normal(ks[1], (d,))
  bias = 0.2 * jax.random.normal(ks[2], (d,))
  ct = jax.random.normal(ks[3], shape)
  return x, scale, bias, ct


def _check(fn, ref, args, ct):
  got, vjp_got = jax.vjp(fn, *args)
  want, vjp_want = jax.vjp(ref, *args)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL)
  for g, w in zip(vjp_got(ct), vjp_want(ct)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), **TOL)


@pytest.mark.parametrize("shape", [(2, 5, 16), (7, 384), (3, 1, 2, 33)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_layer_norm_matches_autodiff(shape, with_bias):
  x, scale, bias, ct = _inputs(shape)
  if with_bias:
    _check(lambda x, s, b: layer_norm(x, s, b, 1e-5), lambda x, s, b: _ln_ref(x, s, b, 1e-5),
           (x, scale, bias), ct)
  else:
    _check(lambda x, s: layer_norm(x, s, None, 1e-5), lambda x, s: _ln_ref(x, s, None, 1e-5),
           (x, scale), ct)


@pytest.mark.parametrize("shape", [(2, 5, 16), (7, 384)])
def test_rms_norm_matches_autodiff(shape):
  x, scale, _, ct = _inputs(shape, seed=1)
  _check(lambda x, s: rms_norm(x, s, 1e-6), lambda x, s: _rms_ref(x, s, 1e-6), (x, scale), ct)


def test_under_jit_vmap_and_remat():
  x, scale, bias, ct = _inputs((4, 6, 32), seed=2)
  f = jax.jit(jax.vmap(jax.checkpoint(lambda x: layer_norm(x, scale, bias))))
  np.testing.assert_allclose(np.asarray(f(x)), np.asarray(_ln_ref(x, scale, bias, 1e-5)), **TOL)
  g = jax.grad(lambda x: jnp.sum(f(x) * ct))(x)
  want = jax.grad(lambda x: jnp.sum(_ln_ref(x, scale, bias, 1e-5) * ct))(x)
  np.testing.assert_allclose(np.asarray(g), np.asarray(want), **TOL)


def test_constant_rows_are_finite():
  """A row with zero variance: rstd = 1/sqrt(eps), output = bias, gradients finite."""
  x = jnp.ones((2, 8)) * 3.0
  scale, bias = jnp.ones((8,)), jnp.arange(8.0)
  y, vjp = jax.vjp(lambda x: layer_norm(x, scale, bias), x)
  np.testing.assert_allclose(np.asarray(y), np.broadcast_to(np.arange(8.0), (2, 8)), atol=1e-6)
  assert np.all(np.isfinite(np.asarray(vjp(jnp.ones((2, 8)))[0])))
