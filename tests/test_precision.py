"""Precision policies, dynamic loss scaling (fp16) and the non-finite update guard."""
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tformer_jax.config import ModelConfig
from tformer_jax.train import precision as P


def test_policies_and_bf16_casts():
  assert P.model_dtype("float32") == "float32"
  assert P.model_dtype("bf16") == "bfloat16"
  assert P.model_dtype("fp16") == "float16"
  pol = P.get_policy("bf16")
  assert not pol.loss_scaling and P.get_policy("fp16").loss_scaling
  m = dataclasses.replace(ModelConfig(), **pol.model_overrides())
  assert (m.dtype, m.param_dtype) == ("bfloat16", "float32")
  tree = {"w": jnp.ones((2, 2)), "ids": jnp.arange(3), "flag": jnp.array(True)}
  cast = pol.cast_to_compute(tree)
  assert cast["w"].dtype == jnp.bfloat16
  assert cast["ids"].dtype == tree["ids"].dtype and cast["flag"].dtype == jnp.bool_
  assert pol.cast_to_param(cast)["w"].dtype == jnp.float32
  with pytest.raises(ValueError, match="train.precision"):
    P.get_policy("int8")


def test_bf16_policy_model_computes_in_bf16_with_f32_params():
  pol = P.get_policy("bf16")
  layer = nn.Dense(4, dtype=jnp.dtype(pol.compute_dtype), param_dtype=jnp.dtype(pol.param_dtype))
  x = jnp.ones((2, 3), jnp.float32)
  params = layer.init(jax.random.key(0), x)
  assert params["params"]["kernel"].dtype == jnp.float32
  y = layer.apply(params, x)
  assert y.dtype == jnp.bfloat16
  grads = jax.grad(lambda p: jnp.sum(layer.apply(p, x).astype(jnp.float32)))(params)
  assert grads["params"]["kernel"].dtype == jnp.float32


def test_all_finite_and_select_tree():
  good = {"a": jnp.ones((3,)), "n": jnp.arange(2), "b": (jnp.zeros(()),)}
  assert bool(P.all_finite(good))
  assert bool(P.all_finite({}))
  assert not bool(P.all_finite({**good, "c": jnp.array([1.0, jnp.inf])}))
  assert not bool(P.all_finite({**good, "c": jnp.array([jnp.nan], jnp.float16)}))
  new = {"w": jnp.full((2,), 2.0), "i": jnp.int32(5)}
  old = {"w": jnp.full((2,), 1.0), "i": jnp.int32(1)}
  sel = jax.jit(P.select_tree)
  np.testing.assert_array_equal(sel(jnp.array(True), new, old)["w"], new["w"])
  out = sel(jnp.array(False), new, old)
  np.testing.assert_array_equal(out["w"], old["w"])
  assert int(out["i"]) == 1 and out["i"].dtype == jnp.int32


def test_loss_scale_adjust_rules():
  ls = P.DynamicLossScale.create(initial_scale=8.0, period=3, min_scale=2.0, max_scale=32.0)
  adjust = jax.jit(lambda s, f: s.adjust(f))
  ok, bad = jnp.array(True), jnp.array(False)
  s = adjust(adjust(ls, ok), ok)
  assert float(s.scale) == 8.0 and int(s.good_steps) == 2
  s = adjust(s, ok)                                   # third good step doubles
  assert float(s.scale) == 16.0 and int(s.good_steps) == 0
  for _ in range(6):
    s = adjust(s, ok)
  assert float(s.scale) == 32.0                       # 64 clamped to max_scale
  s = adjust(adjust(s, ok), bad)                      # overflow halves and resets the counter
  assert float(s.scale) == 16.0 and int(s.good_steps) == 0
  for _ in range(4):
    s = adjust(s, bad)
  assert float(s.scale) == 2.0                        # clamped to min_scale
  assert s.period == 3 and s.max_scale == 32.0        # static fields survive jit
  with pytest.raises(ValueError):
    P.DynamicLossScale.create(initial_scale=0.5, min_scale=1.0)


def test_noop_loss_scale():
  ls = P.get_policy("bf16").initial_loss_scale()
  assert isinstance(ls, P.NoOpLossScale)
  g = {"w": jnp.ones((2,))}
  assert ls.unscale_grads(g) is g and float(ls.scale_loss(jnp.float32(3.0))) == 3.0
  assert jax.jit(lambda s: s.adjust(jnp.array(False)))(ls) == ls


def _fp16_step_fn():
  """A jitted fp16 train step with loss scaling and the non-finite guard (the loop's pattern)."""
  tx = optax.sgd(0.1)

  def loss_fn(params):
    # fp16 compute from float32 params: loss = (100 w)^2 = 1e4 at w = 1 (finite in fp16).
    w16 = params["w"].astype(jnp.float16)
    return jnp.sum((w16 * 100.0) ** 2)

  @jax.jit
  def step(params, opt_state, ls):
    loss, grads = jax.value_and_grad(lambda p: ls.scale_loss(loss_fn(p)))(params)
    grads = ls.unscale_grads(grads)
    loss = loss.astype(jnp.float32) / ls.scale
    finite = P.all_finite((loss, grads))
    updates, new_opt = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    params, opt_state = P.select_tree(finite, (new_params, new_opt), (params, opt_state))
    return params, opt_state, ls.adjust(finite), finite, grads

  return tx, step


def test_fp16_overflow_skips_update_and_halves_scale():
  tx, step = _fp16_step_fn()
  params = {"w": jnp.ones((1,), jnp.float32)}
  opt_state = tx.init(params)
  # 1e4 * 2^15 overflows float16 (max 65504): the step must be skipped.
  ls = P.get_policy("fp16").initial_loss_scale(initial_scale=2.0 ** 15, period=2)
  p1, o1, ls1, finite, _ = step(params, opt_state, ls)
  assert not bool(finite)
  np.testing.assert_array_equal(p1["w"], params["w"])
  assert float(ls1.scale) == 2.0 ** 14 and int(ls1.good_steps) == 0
  # Keep halving until finite: scaled grad 2e4 * s must stay below 65504, i.e. s <= 2.
  scales = [float(ls1.scale)]
  p, o, s = p1, o1, ls1
  while True:
    p, o, s, finite, grads = step(p, o, s)
    if bool(finite):
      break
    np.testing.assert_array_equal(p["w"], params["w"])
    scales.append(float(s.scale))
  assert scales[-1] == 2.0
  # The applied update used the correctly unscaled gradient d/dw (100 w)^2 = 2e4.
  np.testing.assert_allclose(grads["w"], [2e4], rtol=1e-3)
  np.testing.assert_allclose(p["w"], [1.0 - 0.1 * 2e4], rtol=1e-3)
  assert int(s.good_steps) == 1 and float(s.scale) == 2.0


def test_fp16_scale_doubles_after_good_steps():
  tx, step = _fp16_step_fn()
  params = {"w": jnp.full((1,), 1e-3, jnp.float32)}     # small loss: no overflow at scale <= 8
  opt_state = tx.init(params)
  s = P.DynamicLossScale.create(initial_scale=1.0, period=3)
  history = []
  for _ in range(9):
    _, _, s, finite, _ = step(params, opt_state, s)     # same params each step; only s evolves
    assert bool(finite)
    history.append(float(s.scale))
  assert history == [1.0, 1.0, 2.0, 2.0, 2.0, 4.0, 4.0, 4.0, 8.0]
