"""ops.norms: the plain LayerNorm/RMSNorm (`layer_norm`, `rms_norm`, `normalize`: ordinary autodiff,
the reference backend's) and the closed-form backward (`norm_closed_form_vjp`, the xla_cpu
backend's) equal autodiff through the textbook formulas, and the closed form equals autodiff of the
plain one: outputs and the gradients w.r.t. x, scale and bias, float32, atol = rtol = 1e-5; also
under jit + vmap and remat."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tformer_jax.ops.norms import layer_norm, norm_closed_form_vjp, normalize, rms_norm

TOL = dict(atol=1e-5, rtol=1e-5)


def _ln_closed(x, scale, bias=None, eps=1e-5):
  return norm_closed_form_vjp(x, scale, bias, eps, True)


def _rms_closed(x, scale, eps=1e-6):
  return norm_closed_form_vjp(x, scale, None, eps, False)


# (layer_norm, rms_norm) of each implementation, with the signatures of ops.norms' plain ones
IMPLS = {"plain": (layer_norm, rms_norm), "closed_form": (_ln_closed, _rms_closed)}


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
  grads_got, grads_want = vjp_got(ct), vjp_want(ct)
  assert len(grads_got) == len(grads_want) == len(args)
  for g, w in zip(grads_got, grads_want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), **TOL)


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("shape", [(2, 5, 16), (7, 384), (3, 1, 2, 33)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_layer_norm_matches_autodiff(shape, with_bias, impl):
  ln = IMPLS[impl][0]
  x, scale, bias, ct = _inputs(shape)
  if with_bias:
    _check(lambda x, s, b: ln(x, s, b, 1e-5), lambda x, s, b: _ln_ref(x, s, b, 1e-5),
           (x, scale, bias), ct)
  else:
    _check(lambda x, s: ln(x, s, None, 1e-5), lambda x, s: _ln_ref(x, s, None, 1e-5),
           (x, scale), ct)


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("shape", [(2, 5, 16), (7, 384)])
def test_rms_norm_matches_autodiff(shape, impl):
  rms = IMPLS[impl][1]
  x, scale, _, ct = _inputs(shape, seed=1)
  _check(lambda x, s: rms(x, s, 1e-6), lambda x, s: _rms_ref(x, s, 1e-6), (x, scale), ct)


@pytest.mark.parametrize("center,with_bias", [(True, True), (True, False), (False, False)])
@pytest.mark.parametrize("shape", [(2, 5, 16), (3, 1, 2, 33)])
def test_closed_form_equals_autodiff_of_the_plain_norm(shape, center, with_bias):
  """What the xla_cpu backend's norm computes equals the reference backend's, values and gradients."""
  x, scale, bias, ct = _inputs(shape, seed=3)
  eps = 1e-5 if center else 1e-6
  if with_bias:
    _check(lambda x, s, b: norm_closed_form_vjp(x, s, b, eps, center),
           lambda x, s, b: normalize(x, s, b, eps, center), (x, scale, bias), ct)
  else:
    _check(lambda x, s: norm_closed_form_vjp(x, s, None, eps, center),
           lambda x, s: normalize(x, s, None, eps, center), (x, scale), ct)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_under_jit_vmap_and_remat(impl):
  ln = IMPLS[impl][0]
  x, scale, bias, ct = _inputs((4, 6, 32), seed=2)
  f = jax.jit(jax.vmap(jax.checkpoint(lambda x: ln(x, scale, bias))))
  np.testing.assert_allclose(np.asarray(f(x)), np.asarray(_ln_ref(x, scale, bias, 1e-5)), **TOL)
  g = jax.grad(lambda x: jnp.sum(f(x) * ct))(x)
  want = jax.grad(lambda x: jnp.sum(_ln_ref(x, scale, bias, 1e-5) * ct))(x)
  np.testing.assert_allclose(np.asarray(g), np.asarray(want), **TOL)


def test_plain_norms_support_forward_mode():
  """The plain forms are ordinary autodiff: jax.jvp works (the custom VJP of the closed form has none)."""
  x, scale, bias, ct = _inputs((3, 16), seed=4)
  for f, ref in ((lambda x: layer_norm(x, scale, bias), lambda x: _ln_ref(x, scale, bias, 1e-5)),
                 (lambda x: rms_norm(x, scale), lambda x: _rms_ref(x, scale, 1e-6))):
    got = jax.jvp(f, (x,), (ct,))
    want = jax.jvp(ref, (x,), (ct,))
    for a, b in zip(got, want):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_constant_rows_are_finite(impl):
  """A row with zero variance: rstd = 1/sqrt(eps), output = bias, gradients finite."""
  ln = IMPLS[impl][0]
  x = jnp.ones((2, 8)) * 3.0
  scale, bias = jnp.ones((8,)), jnp.arange(8.0)
  y, vjp = jax.vjp(lambda x: ln(x, scale, bias), x)
  np.testing.assert_allclose(np.asarray(y), np.broadcast_to(np.arange(8.0), (2, 8)), atol=1e-6)
  assert np.all(np.isfinite(np.asarray(vjp(jnp.ones((2, 8)))[0])))
