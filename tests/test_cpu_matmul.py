"""The C++ CPU matmul (ops.cpu_kernel.matmul_cpu) and its one use, the weight gradients of
nn.common.project under model.weight_grad_impl='cpu_kernel' / 'auto'.

Tolerances: float32 against a float64 product, 1e-5 relative to the largest entry; model gradients
against the XLA path, 1e-5 (only the summation order differs). Skipped only without a C++ compiler.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from test_cpu_kernel import pytestmark  # noqa: F401  (skip without a C++ compiler)
from test_long_context import _assert_same, _cfg, _init, _logits_and_grads, _tokens

from tformer_jax.config import ConfigError, validate_model
from tformer_jax.nn.attention import resolve_attention_impl
from tformer_jax.nn.common import project, resolve_weight_grad_impl
from tformer_jax.ops.cpu_kernel import matmul_cpu

SHAPES = [(37, 53, 19), (5, 300, 200), (200, 64, 3), (1, 1, 1), (16, 0, 8), (512, 96, 384)]


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)])
def test_matches_float64_product(m, k, n, ta, tb):
  r = np.random.default_rng(m * 7 + n)
  a = r.standard_normal((k, m) if ta else (m, k)).astype(np.float32)
  b = r.standard_normal((n, k) if tb else (k, n)).astype(np.float32)
  ref = (a.T if ta else a).astype(np.float64) @ (b.T if tb else b).astype(np.float64)
  got = np.asarray(jax.jit(lambda a, b: matmul_cpu(a, b, transpose_a=ta, transpose_b=tb))(a, b))
  assert got.shape == (m, n)
  np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * max(1.0, np.abs(ref).max()))


def test_gradient_matches_xla_dot():
  r = np.random.default_rng(0)
  a, b = r.standard_normal((33, 20)).astype(np.float32), r.standard_normal((17, 20)).astype(np.float32)
  loss = lambda mm: lambda a, b: jnp.sum(jnp.sin(mm(a, b)))  # noqa: E731
  got = jax.grad(loss(lambda a, b: matmul_cpu(a, b, transpose_a=True, transpose_b=True)),
                 argnums=(0, 1))(a.T, b)
  want = jax.grad(loss(lambda a, b: a.T @ b.T), argnums=(0, 1))(a.T, b)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("a_shape,b_shape,dtype,kw,match", [
    ((4,), (4, 2), jnp.float32, {}, "2-D"),
    ((3, 4), (4, 2), jnp.bfloat16, {}, "float32 only"),
    ((3, 4), (5, 2), jnp.float32, {}, r"contracting dimensions differ \(4 vs 5\)"),
    ((3, 4), (4, 2), jnp.float32, dict(transpose_a=True), r"contracting dimensions differ \(3 vs 4\)"),
])
def test_bad_arguments_are_clear_errors(a_shape, b_shape, dtype, kw, match):
  with pytest.raises(ValueError, match=match):
    matmul_cpu(jnp.ones(a_shape, dtype), jnp.ones(b_shape, dtype), **kw)


@pytest.mark.parametrize("spec,x_shape,w_shape", [
    ("bld,dhk->blhk", (2, 9, 12), (12, 3, 5)),
    ("blhk,hkd->bld", (2, 9, 3, 5), (3, 5, 12)),
    ("bld,df->blf", (3, 7, 12), (12, 40)),
])
def test_project_weight_grad_kernel_equals_xla(spec, x_shape, w_shape):
  r = np.random.default_rng(1)
  x, w = (jnp.asarray(r.standard_normal(s), jnp.float32) for s in (x_shape, w_shape))

  def grads(impl, x, w):
    return jax.jit(jax.grad(lambda x, w: jnp.sum(jnp.tanh(project(spec, x, w, impl))),
                            argnums=(0, 1)))(x, w)

  hlo = jax.jit(jax.grad(lambda w: jnp.sum(project(spec, x, w, "cpu_kernel")))).lower(w).as_text()
  assert "tfj_matmul" in hlo   # the kernel really computes dw here
  for g, want in zip(grads("cpu_kernel", x, w), grads("xla", x, w)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(want), atol=1e-5, rtol=1e-5)
  # half precision is not the kernel's: the same call falls back to XLA's dot
  xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
  for g, want in zip(grads("cpu_kernel", xb, wb), grads("xla", xb, wb)):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(want, np.float32))


def test_model_gradients_equal_with_the_kernel():
  """A GQA/SwiGLU model and a GELU one with biases: logits and every parameter gradient match."""
  for kw in (dict(), dict(activation="gelu", mlp_bias=True, qkv_bias=True, position="learned")):
    ref = _cfg(**kw)
    params, tokens = _init(ref), _tokens(2)
    _assert_same(_logits_and_grads(dataclasses.replace(ref, weight_grad_impl="cpu_kernel"),
                                   params, tokens),
                 _logits_and_grads(ref, params, tokens))


def test_auto_uses_the_kernels_only_on_one_device_in_float32():
  auto = _cfg(weight_grad_impl="auto", attention_impl="auto", position="alibi", num_kv_heads=0)
  assert resolve_weight_grad_impl(auto) == "cpu_kernel"
  assert resolve_attention_impl(auto) == "chunked_cpu"
  assert resolve_weight_grad_impl(dataclasses.replace(auto, dtype="bfloat16")) == "xla"
  assert resolve_weight_grad_impl(dataclasses.replace(auto, weight_grad_impl="xla")) == "xla"
  mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2])
  with jax.set_mesh(mesh):   # a custom call is not partitioned: sharded runs keep XLA's ops
    assert resolve_weight_grad_impl(auto) == "xla"
    assert resolve_attention_impl(auto) == "chunked"
  one = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])
  with jax.set_mesh(one):
    assert resolve_weight_grad_impl(auto) == "cpu_kernel"


@pytest.mark.parametrize("kw", [dict(weight_grad_impl="cpu_kernel", dtype="bfloat16"),
                                dict(weight_grad_impl="fast")])
def test_config_rejects(kw):
  with pytest.raises(ConfigError, match="weight_grad_impl"):
    validate_model(dataclasses.replace(_cfg(), **kw))
