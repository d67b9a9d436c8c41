"""backends.cpu.xla_cpu.grad_fusion_barrier: an identity in values and gradients (also for NaN/inf
cotangents), whose backward really keeps its one-trip loop in the compiled XLA:CPU program, and a
Transformer under the xla_cpu backend (the barrier on every block's residual input) equals the same
backend with the barrier off (logits and parameter gradients, float32, 1e-6) and the reference
backend (no barrier, autodiff: the same within float32 summation order, 1e-6 of each gradient's
largest entry)."""
import dataclasses
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tformer_jax import backends
from tformer_jax.backends.cpu.xla_cpu import grad_fusion_barrier
from tformer_jax.config import ModelConfig, validate_model
from tformer_jax.nn import Transformer


def test_identity_in_value_and_gradient():
  x = jnp.linspace(-2.0, 3.0, 24).reshape(2, 3, 4)
  np.testing.assert_array_equal(np.asarray(grad_fusion_barrier(x)), np.asarray(x))
  f = lambda x: jnp.sum(jnp.sin(grad_fusion_barrier(x)) * x)  # noqa: E731
  g = lambda x: jnp.sum(jnp.sin(x) * x)  # noqa: E731
  np.testing.assert_allclose(np.asarray(jax.jit(jax.grad(f))(x)), np.asarray(jax.jit(jax.grad(g))(x)),
                             rtol=1e-6, atol=1e-6)  # fusion may reorder the float sums
  for bad in (jnp.nan, jnp.inf):  # the loop's trip count comes from the cotangent: still one trip
    ct = jnp.full(x.shape, bad).at[0, 0, 1].set(1.0)
    _, vjp = jax.vjp(grad_fusion_barrier, x)
    np.testing.assert_array_equal(np.asarray(jax.jit(vjp)(ct)[0]), np.asarray(ct))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the XLA:CPU program")
def test_compiled_backward_keeps_the_loop():
  f = jax.grad(lambda x: jnp.sum(jnp.tanh(grad_fusion_barrier(x * 2.0)) ** 2))
  hlo = jax.jit(f).lower(jnp.ones((8, 16))).compile().as_text()
  assert " while(" in hlo  # XLA neither folded nor hoisted it: the cotangent is materialised


def _loops(hlo: str) -> int:
  """The compiled program's lax.while_loop loops (op_name '.../while'), not the loops XLA:CPU makes of a
  scatter when its fusion emitters are off (tests/conftest.py; the embedding's gradient is one)."""
  return sum(1 for line in hlo.splitlines() if " while(" in line
             and (m := re.search(r'op_name="([^"]*)"', line)) and m.group(1).endswith("/while"))


@dataclasses.dataclass(frozen=True)
class _BarrierOff(backends.XlaCpuBackend):
  """The xla_cpu backend with everything but the residual barrier."""

  def residual(self, x_BxLxD):
    return x_BxLxD


@pytest.mark.parametrize("extra", [{}, {"scan_layers": True}])
def test_model_same_with_and_without_barrier(extra):
  base = ModelConfig(vocab_size=50, d_model=32, num_layers=3, num_heads=4, max_len=16,
                     position="learned", norm="layernorm", activation="gelu_tanh", **extra)
  validate_model(base)
  # reference attention and no C++ kernels, so that only the named differences remain
  on = backends.XlaCpuBackend(attention_impl="reference", cpu_kernels=False)
  off = _BarrierOff(attention_impl="reference", cpu_kernels=False)
  ref = backends.Backend(attention_impl="reference")
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 16), 0, 50)
  params = nn.unbox(Transformer(base).init(jax.random.PRNGKey(0), tokens)["params"])
  w = jax.random.normal(jax.random.PRNGKey(2), (2, 16, 50))

  def run(backend):
    def f(p):
      logits = Transformer(base).apply({"params": p}, tokens)
      return jnp.sum(logits * w), logits
    with backends.use(backend):   # a fresh f per backend: traced under it
      step = jax.jit(jax.value_and_grad(f, has_aux=True))
      (_, logits), grads = step(params)
      hlo = step.lower(params).compile().as_text()
    return logits, grads, hlo

  (la, ga, hlo_on), (lb, gb, hlo_off), (lr, gr, _) = run(on), run(off), run(ref)
  if jax.default_backend() == "cpu":   # the xla_cpu backend really puts the loop in the backward
    assert _loops(hlo_on) >= 1
    if not extra:
      assert _loops(hlo_off) == 0 and _loops(hlo_on) == base.num_layers   # one barrier a block
  np.testing.assert_allclose(np.asarray(la), np.asarray(lb), rtol=1e-6, atol=1e-6)
  for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)
  # xla_cpu against the reference backend: its project / norm VJPs sum in another order
  np.testing.assert_allclose(np.asarray(la), np.asarray(lr), rtol=1e-6, atol=1e-6)
  for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gr)):
    y = np.asarray(y)
    np.testing.assert_allclose(np.asarray(x), y, rtol=1e-5, atol=1e-6 * max(1.0, np.abs(y).max()))
