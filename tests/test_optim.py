"""Schedules, the weight-decay mask, AdamW wiring, gradient accumulation and clip-norm metrics."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tformer_jax.config import default_config
from tformer_jax.train import optim


def _cfg(**kw):
  c = default_config().optim
  c.update(kw)
  return c


def _lrs(schedule, steps):
  return np.array([float(schedule(s)) for s in steps])


def test_cosine_schedule_key_steps():
  s = optim.make_schedule(_cfg(peak_lr=1e-3, warmup_steps=10, min_lr_ratio=0.1), total_steps=110)
  got = _lrs(s, [0, 5, 10, 60, 110, 500])
  # 0, mid-warmup, end of warmup, middle of cosine = (peak + floor) / 2, end = floor, past end = floor.
  np.testing.assert_allclose(got, [0.0, 5e-4, 1e-3, 5.5e-4, 1e-4, 1e-4], rtol=1e-5, atol=1e-9)
  # Monotone decay after warmup, jit-friendly with a traced step.
  dec = _lrs(s, range(10, 111))
  assert np.all(np.diff(dec) <= 1e-9)
  np.testing.assert_allclose(float(jax.jit(s)(jnp.int32(60))), 5.5e-4, rtol=1e-5)


def test_warmup_fraction_overrides_steps():
  c = _cfg(peak_lr=2.0, warmup_steps=100, warmup_fraction=0.1, schedule="constant")
  assert optim.warmup_steps(c, 200) == 20
  s = optim.make_schedule(c, total_steps=200)
  np.testing.assert_allclose(_lrs(s, [0, 10, 20, 150]), [0.0, 1.0, 2.0, 2.0], rtol=1e-6)


def test_rsqrt_and_constant():
  s = optim.make_schedule(_cfg(peak_lr=1.0, warmup_steps=16, schedule="rsqrt"), total_steps=1000)
  np.testing.assert_allclose(_lrs(s, [0, 8, 16, 64, 1600]), [0.0, 0.5, 1.0, 0.5, 0.1], rtol=1e-6)
  s0 = optim.make_schedule(_cfg(peak_lr=1.0, warmup_steps=0, schedule="rsqrt"), total_steps=1000)
  np.testing.assert_allclose(_lrs(s0, [0, 1, 4]), [1.0, 1.0, 0.5], rtol=1e-6)
  c = optim.make_schedule(_cfg(peak_lr=3e-4, warmup_steps=0, schedule="constant"), total_steps=10)
  np.testing.assert_allclose(_lrs(c, [0, 5, 100]), [3e-4] * 3, rtol=1e-6)
  with pytest.raises(ValueError, match="optim.schedule"):
    optim.make_schedule(_cfg(schedule="linear"), 10)


class _StackedNorm(nn.Module):
  """A scan_layers-style stacked norm scale: rank 2 but named 'scale', so never decayed."""

  @nn.compact
  def __call__(self, x):
    return x * self.param("scale", nn.initializers.ones, (2, x.shape[-1]))[0]


class _Tiny(nn.Module):
  boxed: bool = False

  @nn.compact
  def __call__(self, tok_BxL):
    init = nn.initializers.normal(0.02)
    if self.boxed:
      emb_init = nn.with_logical_partitioning(init, ("vocab", "embed"))
      k_init = nn.with_logical_partitioning(init, ("embed", "mlp"))
    else:
      emb_init, k_init = init, init
    x = nn.Embed(11, 6, embedding_init=emb_init, name="embed")(tok_BxL)
    x = nn.LayerNorm(name="ln")(x)
    x = nn.Dense(5, kernel_init=k_init, name="dense")(x)
    return _StackedNorm(name="stacked")(x)


def _init(boxed):
  return _Tiny(boxed).init(jax.random.key(0), jnp.zeros((2, 3), jnp.int32))["params"]


def test_decay_mask_on_flax_params():
  params = _init(False)
  mask = optim.decay_mask(params)
  assert params["stacked"]["scale"].ndim == 2
  assert jax.tree.map(bool, mask) == {
      "embed": {"embedding": True}, "ln": {"scale": False, "bias": False},
      "dense": {"kernel": True, "bias": False}, "stacked": {"scale": False}}


def test_decay_mask_on_boxed_params():
  params = _init(True)
  assert isinstance(params["dense"]["kernel"], nn.Partitioned)
  mask = optim.decay_mask(params)
  assert jax.tree.structure(mask) == jax.tree.structure(params)
  assert isinstance(mask["dense"]["kernel"], nn.Partitioned)
  assert mask["dense"]["kernel"].value and mask["embed"]["embedding"].value
  assert not mask["dense"]["bias"] and not mask["ln"]["scale"]
  # The optimizer runs on boxed trees too.
  tx, _ = optim.make_optimizer(_cfg(), total_steps=10)
  state = tx.init(params)
  grads = jax.tree.map(jnp.ones_like, params)
  updates, _ = tx.update(grads, state, params)
  assert jax.tree.structure(updates) == jax.tree.structure(params)


def test_weight_decay_only_on_masked_leaves():
  params = _init(False)
  tx, _ = optim.make_optimizer(
      _cfg(peak_lr=0.1, warmup_steps=0, schedule="constant", weight_decay=0.5, clip_norm=0.0), 10)
  zeros = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(zeros, tx.init(params), params)
  new = optax.apply_updates(params, updates)
  np.testing.assert_allclose(new["dense"]["kernel"], params["dense"]["kernel"] * (1 - 0.05), rtol=1e-6)
  np.testing.assert_allclose(new["embed"]["embedding"], params["embed"]["embedding"] * 0.95, rtol=1e-6)
  for path in (("ln", "scale"), ("ln", "bias"), ("dense", "bias")):
    np.testing.assert_array_equal(new[path[0]][path[1]], params[path[0]][path[1]])
  np.testing.assert_array_equal(new["stacked"]["scale"], params["stacked"]["scale"])


def test_optimizer_uses_schedule_at_update_count():
  params = {"w": jnp.ones((3,))}
  tx, schedule = optim.make_optimizer(
      _cfg(peak_lr=1.0, warmup_steps=4, schedule="constant", weight_decay=0.0, clip_norm=0.0), 10)
  state = tx.init(params)
  grads = {"w": jnp.full((3,), 0.5)}
  for s in range(3):
    updates, state = tx.update(grads, state, params)
    # Adam with a constant gradient: the normalised step is 1, so the update is -lr(s).
    np.testing.assert_allclose(updates["w"], -float(schedule(s)), rtol=1e-5, atol=1e-7)
  with pytest.raises(ValueError, match="optim.name"):
    optim.make_optimizer(_cfg(name="sgd"), 10)


def test_grad_norms_match_optax_clipping():
  grads = {"a": jnp.array([3.0]), "b": jnp.array([[4.0]])}
  norm, clipped = optim.grad_norms(grads, 1.0)
  clipped_grads, _ = optax.clip_by_global_norm(1.0).update(grads, optax.EmptyState())
  np.testing.assert_allclose([float(norm), float(clipped)], [5.0, 1.0], rtol=1e-6)
  np.testing.assert_allclose(float(optax.tree.norm(clipped_grads)), float(clipped), rtol=1e-6)
  np.testing.assert_allclose([float(x) for x in optim.grad_norms(grads, 10.0)], [5.0, 5.0])
  np.testing.assert_allclose([float(x) for x in optim.grad_norms(grads, 0.0)], [5.0, 5.0])


def _linear_problem():
  k1, k2, k3, k4 = jax.random.split(jax.random.key(1), 4)
  params = {"w": jax.random.normal(k1, (4, 3)), "b": jax.random.normal(k2, (3,))}
  batch = {"x": jax.random.normal(k3, (8, 4)), "y": jax.random.normal(k4, (8, 3))}
  return params, batch


def _sq_err_B(params, batch):
  pred = batch["x"] @ params["w"] + params["b"]
  return jnp.sum((pred - batch["y"]) ** 2, axis=-1)


def test_accumulation_equals_full_batch():
  params, batch = _linear_problem()

  def mean_loss(p):
    return jnp.mean(_sq_err_B(p, batch))

  loss_ref, grads_ref = jax.value_and_grad(mean_loss)(params)

  def sum_form(p, mb, rng):
    err = _sq_err_B(p, mb)
    return jnp.sum(err), (jnp.float32(err.shape[0]), {"max_err": jnp.max(err)})

  fn = jax.value_and_grad(sum_form, has_aux=True)
  acc = jax.jit(optim.accumulate_gradients, static_argnums=(0, 4))
  (loss, aux), grads = acc(fn, params, batch, jax.random.key(0), 4)
  np.testing.assert_allclose(loss, loss_ref, rtol=1e-6)
  for k in grads:
    np.testing.assert_allclose(grads[k], grads_ref[k], rtol=1e-6, atol=1e-6)
  assert aux["max_err"].shape == ()
  # num_micro=1 is one call on the whole batch.
  (loss1, _), grads1 = optim.accumulate_gradients(fn, params, batch, None, 1)
  np.testing.assert_allclose(loss1, loss_ref, rtol=1e-6)
  np.testing.assert_allclose(grads1["w"], grads_ref["w"], rtol=1e-6, atol=1e-6)


def test_accumulation_weights_by_mask_count():
  params, batch = _linear_problem()
  # Unequal real-token counts per micro-batch (strided split: micro i = rows i, i+4).
  batch["m"] = jnp.array([1, 1, 0, 1, 1, 0, 0, 1], jnp.float32)

  def masked_mean(p):
    return jnp.sum(_sq_err_B(p, batch) * batch["m"]) / jnp.sum(batch["m"])

  loss_ref, grads_ref = jax.value_and_grad(masked_mean)(params)

  def sum_form(p, mb, rng):
    return jnp.sum(_sq_err_B(p, mb) * mb["m"]), (jnp.sum(mb["m"]), {})

  (loss, _), grads = optim.accumulate_gradients(
      jax.value_and_grad(sum_form, has_aux=True), params, batch, None, 4)
  np.testing.assert_allclose(loss, loss_ref, rtol=1e-6)
  np.testing.assert_allclose(grads["w"], grads_ref["w"], rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(grads["b"], grads_ref["b"], rtol=1e-6, atol=1e-6)


def test_accumulation_micro_batches_and_rngs():
  batch = {"x": jnp.arange(8.0)}
  micro = optim.split_micro_batches(batch, 4)
  np.testing.assert_array_equal(micro["x"], [[0, 4], [1, 5], [2, 6], [3, 7]])
  with pytest.raises(ValueError, match="divisible"):
    optim.split_micro_batches(batch, 3)

  def fn(p, mb, rng):
    # Returns the rng's first random number as aux so each micro-batch's rng is visible.
    u = jax.random.uniform(rng)
    return (jnp.sum(mb["x"] * p), (jnp.float32(1.0), {"u": u})), p

  rng = jax.random.key(3)
  (_, aux), _ = optim.accumulate_gradients(fn, jnp.float32(1.0), batch, rng, 4)
  want = np.mean([float(jax.random.uniform(jax.random.fold_in(rng, i))) for i in range(4)])
  np.testing.assert_allclose(aux["u"], want, rtol=1e-6)
