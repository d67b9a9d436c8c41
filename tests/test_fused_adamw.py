"""The C++ CPU AdamW (backends.cpu.kernels.adamw_update_cpu / adamw_apply_cpu; the xla_cpu backend's
optimizer, backends.cpu.xla_cpu.fused_adamw) equals the optax chain.

Kernel: 6 steps against optax.chain(clip_by_global_norm, adamw) + apply_updates, with steps that are
clipped and steps that are not; tolerance 1e-6 relative (float32 rounding of g * (clip / norm)
against optax's (g / norm) * clip, and the compiler's fused multiply-adds), with an absolute floor of
1e-6 of each array's largest entry (mu = 0.1 g + 0.9 mu cancels). Train step: 3 steps of a small
model with the xla_cpu backend's tx (optim.make_optimizer, C++ kernels on) against the reference
backend's (optax): same parameters (rtol 1e-5: the gradients themselves are the same computation),
the same optimizer-state tree and counts, a non-finite step skipped by both.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_cpu_kernel import pytestmark  # noqa: F401  (skip without a C++ compiler)

from tformer_jax import backends
from tformer_jax.backends.cpu.kernels import adamw_apply_cpu, adamw_scalars, adamw_update_cpu
from tformer_jax.config import ConfigError, default_config, validate
from tformer_jax.nn import Transformer
from tformer_jax.train import optim, precision, state as state_lib, step as step_lib

KERNELS = backends.XlaCpuBackend(cpu_kernels=True)
REFERENCE = backends.Backend()


@pytest.mark.parametrize("clip,wd", [(1.0, 0.1), (0.0, 0.0)])
def test_kernel_matches_optax(clip, wd):
  r = np.random.default_rng(0)
  p = jnp.asarray(r.standard_normal((300, 70)), jnp.float32)      # > one 32K block: 2 tasks
  parts = [optax.clip_by_global_norm(clip)] if clip else []
  tx = optax.chain(*parts, optax.adamw(3e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=wd))
  st, want, got, mu, nu = tx.init(p), p, p, jnp.zeros_like(p), jnp.zeros_like(p)
  step = jax.jit(lambda p, g, m, v, s, t: adamw_update_cpu(
      p, g, m, v, lr=3e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=wd, count=t, grad_scale=s))
  apply = jax.jit(lambda p, g, m, v, s, t: adamw_apply_cpu(p, g, m, v, adamw_scalars(
      lr=3e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=wd, count=t, grad_scale=s, finite=True)))
  for t in range(1, 7):
    g = jnp.asarray(r.standard_normal(p.shape), jnp.float32) * (0.003 if t % 2 else 1.0)
    u, st = tx.update(g, st, want)
    n = optax.tree.norm(g)
    scale = jnp.where(n < clip, 1.0, clip / n) if clip else 1.0
    # adamw_apply_cpu: optax's update itself (-lr * direction), from the same p, mu, nu
    upd, _, _ = apply(got, g, mu, nu, scale, t)
    np.testing.assert_allclose(np.asarray(upd), np.asarray(u), rtol=1e-6,
                               atol=1e-6 * np.abs(np.asarray(u)).max())
    want = optax.apply_updates(want, u)
    got, mu, nu = step(got, g, mu, nu, scale, t)
  adam = st[-1][0]
  for a, b in ((got, want), (mu, adam.mu), (nu, adam.nu)):
    b = np.asarray(b)
    np.testing.assert_allclose(np.asarray(a), b, rtol=1e-6, atol=1e-6 * np.abs(b).max())


def test_non_finite_step_keeps_everything():
  p, g = jnp.ones((5, 3)), jnp.full((5, 3), 0.5)
  m, v = jnp.full((5, 3), 0.1), jnp.full((5, 3), 0.2)
  out = jax.jit(lambda *a: adamw_update_cpu(*a, lr=1.0, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1,
                                            count=1, finite=False))(p, g, m, v)
  for o, i in zip(out, (p, m, v)):
    np.testing.assert_array_equal(np.asarray(o), np.asarray(i))
  scalars = adamw_scalars(lr=1.0, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, count=1, finite=False)
  upd, mu, nu = jax.jit(adamw_apply_cpu)(p, g, m, v, scalars)   # the update is zero
  np.testing.assert_array_equal(np.asarray(upd), np.zeros((5, 3), np.float32))
  for o, i in zip((mu, nu), (m, v)):
    np.testing.assert_array_equal(np.asarray(o), np.asarray(i))


def test_bad_arguments_are_clear_errors():
  with pytest.raises(ValueError, match="float32 arrays of one shape"):
    adamw_update_cpu(jnp.ones(3), jnp.ones(4), jnp.ones(3), jnp.ones(3), lr=1e-3, b1=0.9, b2=0.95,
                     eps=1e-8, weight_decay=0.0, count=1)


def _cfg(**optim):
  c = default_config()
  m = c.model
  m.vocab_size, m.d_model, m.num_layers, m.num_heads, m.max_len = 61, 32, 2, 4, 16
  m.qkv_bias = m.mlp_bias = True
  c.data.seq_len, c.data.batch_size = 16, 4
  c.optim.warmup_steps, c.optim.peak_lr = 1, 1e-2
  c.optim.update(optim)
  return c


def _run(c, backend, steps=3, nan_at=None):
  """`steps` train steps with `backend`'s optimizer; the model runs under the reference backend in
  both runs, so only the optimizer differs."""
  m = validate(c)
  model = Transformer(m)
  tx, schedule = optim.make_optimizer(c.optim, 10, backend)
  init = state_lib.init_fn(model, tx, precision.get_policy("float32").initial_loss_scale(), 16)
  state = jax.jit(lambda r: state_lib.unbox_plain(init(r)))(jax.random.PRNGKey(0))
  step = jax.jit(step_lib.make_train_step(model, tx, schedule, c.optim))
  toks = np.random.default_rng(1).integers(0, 61, (4, 17), dtype=np.int32)
  batch = {"inputs": jnp.asarray(toks[:, :-1]), "targets": jnp.asarray(toks[:, 1:])}
  for i in range(steps):
    b = dict(batch, loss_mask=jnp.full((4, 16), np.nan)) if i == nan_at else batch
    state, _ = step(state, b)
  hlo = step.lower(state, batch).as_text()
  return state, hlo


@pytest.mark.parametrize("optim_kw", [dict(), dict(clip_norm=0.0, grad_accum=2)])
def test_train_step_matches_optax(optim_kw):
  want, hlo_o = _run(_cfg(**optim_kw), REFERENCE, nan_at=1)
  got, hlo_k = _run(_cfg(**optim_kw), KERNELS, nan_at=1)
  assert "tfj_adamw" in hlo_k and "tfj_adamw" not in hlo_o
  assert jax.tree.structure(got.opt_state) == jax.tree.structure(want.opt_state)
  assert int(got.skipped) == int(want.skipped) == 1
  for path, a in jax.tree_util.tree_flatten_with_path((got.params, got.opt_state))[0]:
    b = jax.tree_util.tree_flatten_with_path((want.params, want.opt_state))[0]
    b = dict((jax.tree_util.keystr(k), v) for k, v in b)[jax.tree_util.keystr(path)]
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5,
                               atol=1e-5 * max(float(np.abs(np.asarray(b)).max()), 1e-6),
                               err_msg=jax.tree_util.keystr(path))


def test_auto_resolution():
  """runtime.cpu_kernels 'auto' (backends.resolve_runtime) gives the C++ AdamW to float32 parameters
  on one CPU device only; the fused update refuses other parameters clearly."""
  def fused(**kw):
    c = _cfg()
    mesh_devices = kw.pop("mesh_devices", 1)
    c.model.update(kw)
    b = backends.resolve_runtime(c, mesh_devices=mesh_devices, platform="cpu", quiet=True).backend
    tx, _ = optim.make_optimizer(c.optim, 10, b)
    return b.cpu_kernels, tx

  on, tx = fused()
  assert on
  params = {"w": jnp.ones((2, 2))}
  hlo = jax.jit(lambda p: tx.update(p, tx.init(p), p)).lower(params).as_text()
  assert "tfj_adamw" in hlo
  bf16 = {"w": jnp.ones((2, 2), jnp.bfloat16)}
  with pytest.raises(ValueError, match="float32 parameters"):
    tx.update(bf16, tx.init(bf16), bf16)
  for kw in (dict(param_dtype="bfloat16"), dict(mesh_devices=2)):
    on, tx = fused(**kw)
    assert not on, kw
    assert "tfj_adamw" not in jax.jit(lambda p, tx=tx: tx.update(p, tx.init(p), p)).lower(
        params).as_text()


@pytest.mark.parametrize("kw,field", [(dict(cpu_kernels="fast"), "runtime.cpu_kernels")])
def test_config_rejects(kw, field):
  c = _cfg()
  c.runtime.update(kw)
  with pytest.raises(ConfigError, match=field):
    validate(c)
  c = _cfg()
  c.runtime.cpu_kernels = "on"
  c.model.param_dtype = "bfloat16"
  with pytest.raises(ConfigError, match="runtime.cpu_kernels"):
    validate(c)
  c.runtime.cpu_kernels = "auto"
  assert dataclasses.is_dataclass(validate(c))
