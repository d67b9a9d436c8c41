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
    optim.make_optimizer(_cfg(name="rmsprop"), 10)


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


# -- optax schedules keep the hand-written curves; decay by role; the optimizers; MultiSteps -------------


def _reference_schedule(peak, kind, min_ratio, warm, total):
  """The schedule as tformer_jax computed it by hand before it used optax (numpy, float64)."""
  def lr(step):
    if warm and step < warm:
      return peak * step / warm
    if kind == "cosine":
      progress = min(max((step - warm) / max(total - warm, 1), 0.0), 1.0)
      return min_ratio * peak + (peak - min_ratio * peak) * 0.5 * (1.0 + np.cos(np.pi * progress))
    if kind == "rsqrt":
      w = max(warm, 1)
      return peak * np.sqrt(w / max(step, w))
    return peak
  return lr


@pytest.mark.parametrize("kind", ["cosine", "rsqrt", "constant"])
@pytest.mark.parametrize("warm", [0, 1, 37])
def test_optax_schedules_match_the_hand_written_curves(kind, warm):
  total = 300
  s = optim.make_schedule(_cfg(peak_lr=3e-4, warmup_steps=warm, schedule=kind, min_lr_ratio=0.1), total)
  ref = _reference_schedule(3e-4, kind, 0.1, warm, total)
  steps = np.arange(0, 2 * total)
  got = np.asarray(jax.jit(jax.vmap(s))(jnp.asarray(steps)))
  np.testing.assert_allclose(got, [ref(int(t)) for t in steps], rtol=2e-5, atol=1e-11)


def _preset_params(path):
  import importlib.util

  from tformer_jax.config import ModelConfig, resolved
  from tformer_jax.nn import Transformer
  spec = importlib.util.spec_from_file_location("preset", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  m = ModelConfig.from_config(resolved(mod.get_config()).model)
  shapes = jax.eval_shape(Transformer(m).init, jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))["params"]
  return nn.unbox(shapes)


PRESETS = sorted(str(p) for p in __import__("pathlib").Path(__file__).resolve().parents[1].glob("configs/**/*.py")
                 if p.name != "__init__.py")


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.split("configs/")[1])
def test_decay_mask_by_role_on_every_preset(preset):
  params = _preset_params(preset)
  roles_seen = set()
  for decay_embeddings in (True, False):
    mask = optim.decay_mask(params, decay_embeddings=decay_embeddings)
    for (path, x), (_, decayed) in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                                       jax.tree_util.tree_flatten_with_path(mask)[0]):
      name = str(path[-1].key)
      role = optim.param_role(path, strict=True)
      roles_seen.add(role)
      if (name in ("scale", "bias") or (len(name) == 2 and name[0] == "b")   # norms and every bias
          or name.endswith("_bias") or name.startswith("b_")):              # (MoE: router, correction, experts)
        assert role in ("norm", "bias") and not decayed, (preset, path)
      elif name.endswith("embed") or name == "rel_bias":
        assert role == "embedding" and decayed == decay_embeddings, (preset, path)
      else:
        assert role == "kernel" and decayed and x.ndim >= 2, (preset, path)
  assert {"kernel", "embedding", "norm"} <= roles_seen


def test_qkv_biases_are_not_decayed_and_unknown_names_are_refused():
  from tformer_jax.config import ModelConfig
  from tformer_jax.nn import Transformer
  cfg = ModelConfig(vocab_size=32, d_model=16, num_layers=1, num_heads=2, max_len=8, qkv_bias=True)
  params = nn.unbox(Transformer(cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))["params"])
  attn = params["layers_0"]["attn"]
  assert attn["bq"].ndim == 2                          # (heads, head_dim): the rank rule decayed it
  mask = optim.decay_mask(params)["layers_0"]["attn"]
  assert not (mask["bq"] or mask["bk"] or mask["bv"]) and mask["wq"]
  with pytest.raises(ValueError, match="no weight-decay role for the name 'mystery'"):
    optim.param_role((jax.tree_util.DictKey("mystery"),), strict=True)
  # a user's own names fall back to the rank
  assert jax.tree.map(bool, optim.decay_mask({"mystery": jnp.zeros((2, 2)), "b": jnp.zeros(2)})) == {
      "mystery": True, "b": False}


@pytest.mark.parametrize("name", optim.OPTIMIZERS)
def test_every_optimizer_trains_and_respects_the_decay_mask(name):
  params = _init(False)
  x = jax.random.randint(jax.random.PRNGKey(1), (4, 3), 0, 11)
  target = jax.random.normal(jax.random.PRNGKey(2), (4, 3, 5))

  def loss(p):
    return jnp.mean((_Tiny().apply({"params": p}, x) - target) ** 2)

  lr = {"adamw": 1e-2, "adafactor": 0.3, "lion": 1e-3, "sgd": 0.1, "muon": 1e-2}[name]   # adafactor: by params RMS
  # muon: flax's own 'kernel' is no hidden matrix of ours (MUON_NAMES): AdamW's part of Muon trains it all
  # here (tests/test_muon.py has the matrices)
  axes = {"param_axes": optim.logical_axes(_init(True))} if name == "muon" else {}
  tx, _ = optim.make_optimizer(_cfg(name=name, peak_lr=lr, warmup_steps=0, schedule="constant",
                                    weight_decay=0.1), total_steps=50, **axes)
  state, p, first = tx.init(params), params, float(loss(params))
  step = jax.jit(lambda p, s: (lambda g: tx.update(g, s, p))(jax.grad(loss)(p)))
  for _ in range(30):
    updates, state = step(p, state)
    p = optax.apply_updates(p, updates)
  assert float(loss(p)) < 0.9 * first
  # decay alone (zero gradients) moves decayed leaves only
  updates, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
  assert not np.any(np.asarray(updates["ln"]["bias"])) and not np.any(np.asarray(updates["dense"]["bias"]))
  assert np.any(np.asarray(updates["dense"]["kernel"]))


def test_accumulation_equals_optax_multisteps_with_equal_token_counts():
  params = _init(False)
  xs = jax.random.randint(jax.random.PRNGKey(3), (4, 3), 0, 11)
  ys = jax.random.normal(jax.random.PRNGKey(4), (4, 3, 5))

  def loss_sum(p, mb, rng):
    del rng
    err = (_Tiny().apply({"params": p}, mb["x"]) - mb["y"]) ** 2
    return jnp.sum(err), (jnp.asarray(err.size, jnp.float32), {})

  tx, _ = optim.make_optimizer(_cfg(peak_lr=1e-2, warmup_steps=0, schedule="constant"), total_steps=10)
  (_, _), grads = optim.accumulate_gradients(jax.value_and_grad(loss_sum, has_aux=True), params,
                                             {"x": xs, "y": ys}, None, 2)
  ours = optax.apply_updates(params, tx.update(grads, tx.init(params), params)[0])
  multi = optax.MultiSteps(optim.make_optimizer(_cfg(peak_lr=1e-2, warmup_steps=0, schedule="constant"),
                                                total_steps=10)[0], every_k_schedule=2)
  state, p = multi.init(params), params
  for i in range(2):                                   # the same strided micro-batches, one per call
    mb = {"x": xs[i::2], "y": ys[i::2]}
    g = jax.grad(lambda q, mb=mb: loss_sum(q, mb, None)[0] / mb["y"].size)(params)
    upd, state = multi.update(g, state, p)
    p = optax.apply_updates(p, upd)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), ours, p)


def test_adafactor_trains_through_the_loop(tmp_path):
  """Adafactor's factored moments are not param-shaped: the sharded state must still build."""
  from tformer_jax.train.loop import train
  from tformer_jax.train.metrics import read_metrics

  from train_utils import tiny_config
  train(tiny_config(steps=3, **{"optim.name": "adafactor", "optim.peak_lr": 1e-2}), tmp_path)
  losses = [m["loss"] for m in read_metrics(tmp_path) if "loss" in m]
  assert len(losses) == 3 and all(np.isfinite(losses))


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_every_moe_parameter_has_a_role(activation):
  """Plain and gated experts, with a shared expert: every name is in PARAM_ROLES (strict)."""
  from tformer_jax.config import ModelConfig, MoEConfig
  from tformer_jax.nn import Transformer
  cfg = ModelConfig(vocab_size=32, d_model=16, num_layers=1, num_heads=2, max_len=8, activation=activation,
                    moe=MoEConfig(num_experts=2, top_k=1, shared_expert=True))
  p = nn.unbox(jax.eval_shape(Transformer(cfg).init, jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))["params"])
  flat = jax.tree_util.tree_flatten_with_path(p)[0]
  roles = {str(path[-1].key): optim.param_role(path, strict=True) for path, _ in flat}
  shared_in = "shared_w_in" if activation == "gelu" else "shared_w_up"
  assert {k for k, r in roles.items() if r == "kernel"} >= {"router", shared_in}
