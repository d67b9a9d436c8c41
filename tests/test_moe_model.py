"""MoE inside the whole model: trains through the real train step (unrolled every=2 and scanned every=1)
with the aux losses in the loss and the MoE metrics logged (metrics.jsonl through the loop), capacity
dispatch with ample capacity equals dropless, and expert parallelism on a ('data', 'expert') = (2, 4)
mesh of 8 fake devices equals one device (rtol 1e-5)."""
import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from tformer_jax.config import ModelConfig, MoEConfig, validate_model
from tformer_jax.nn import Transformer
from tformer_jax.parallel import mesh as mesh_lib, rules as rules_lib
from tformer_jax.train import optim, precision, state as state_lib, step as step_lib
from tformer_jax.train.loop import train
from tformer_jax.train.metrics import read_metrics

from train_utils import tiny_config

MOE_KEYS = ("moe/load_max", "moe/load_min", "moe/load_ratio", "moe/dropped_fraction",
            "moe/router_entropy", "moe/load_balance", "moe/z_loss")


def _model_cfg(**moe) -> ModelConfig:
  m = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, max_len=32,
                  position="rope", norm="rmsnorm", activation="swiglu", d_ff=48,
                  moe=MoEConfig(**{"num_experts": 4, "top_k": 2, **moe}))
  validate_model(m)
  return m


def _optim_cfg(steps: int = 10):
  c = tiny_config(steps=steps, **{"optim.warmup_steps": 1, "optim.peak_lr": 1e-2})
  return c.optim


def _batch(b: int = 4, l: int = 16, seed: int = 1) -> dict:
  tok = jax.random.randint(jax.random.PRNGKey(seed), (b, l + 1), 0, 64)
  return {"inputs": tok[:, :-1], "targets": tok[:, 1:]}


def _setup(m: ModelConfig, steps: int = 10):
  model = Transformer(m)
  ocfg = _optim_cfg(steps)
  tx, schedule = optim.make_optimizer(ocfg, steps)
  init = state_lib.init_fn(model, tx, precision.get_policy("float32").initial_loss_scale(), 16)
  return model, init, step_lib.make_train_step(model, tx, schedule, ocfg)


def test_unrolled_moe_every2_trains_with_aux_loss_and_metrics():
  m = _model_cfg(every=2)
  model, init, train_step = _setup(m)
  init_state = jax.jit(lambda r: state_lib.unbox_plain(init(r)))
  state = init_state(jax.random.PRNGKey(0))
  assert "mlp" in state.params["layers_0"] and "moe" in state.params["layers_1"]  # dense, then MoE
  step = jax.jit(train_step)
  batch = _batch()
  losses = []
  for _ in range(4):
    state, metrics = step(state, batch)
    met = {k: float(v) for k, v in metrics.items()}
    losses.append(met["loss"])
    for k in MOE_KEYS:
      assert math.isfinite(met[k]), (k, met)
    # the loss includes the coefficient-weighted aux losses, and they are what the metrics report
    assert met["aux_loss"] > 0
    assert met["aux_loss"] == pytest.approx(met["moe/load_balance"] + met["moe/z_loss"], rel=1e-5)
    assert met["loss"] == pytest.approx(met["nll"] + met["aux_loss"], rel=1e-5)
    assert 0.0 <= met["moe/load_min"] <= 1 / 4 <= met["moe/load_max"] <= 1.0
    assert met["moe/load_ratio"] == pytest.approx(met["moe/load_max"] / met["moe/load_min"], rel=1e-5)
    assert met["moe/dropped_fraction"] == 0.0  # dropless
    assert 0.0 < met["moe/router_entropy"] <= math.log(4) + 1e-6
  assert losses[-1] < losses[0]
  # the router learns: its gradient reached the params (they moved from init)
  fresh = init_state(jax.random.PRNGKey(0))
  moved = state.params["layers_1"]["moe"]["router"] - fresh.params["layers_1"]["moe"]["router"]
  assert float(jnp.max(jnp.abs(moved))) > 0


@pytest.mark.slow
def test_scanned_moe_every1_through_the_loop_logs_metrics(tmp_path):
  """The real loop (data, jit with shardings, metrics.jsonl) with a scanned MoE model."""
  cfg = tiny_config(steps=4, **{"model.scan_layers": True, "model.moe.num_experts": 4,
                                "model.moe.every": 1, "model.activation": "swiglu",
                                "train.eval_every": 4, "train.ckpt_every": 4})
  final = train(cfg, tmp_path)
  assert final["step"] == 4 and math.isfinite(final["val_loss"])
  logs = [r for r in read_metrics(tmp_path) if "loss" in r]
  assert len(logs) == 4
  for k in MOE_KEYS + ("aux_loss",):
    assert all(math.isfinite(r[k]) for r in logs), k
  assert all(r["moe/load_ratio"] >= 1.0 and r["aux_loss"] > 0 for r in logs)
  assert logs[-1]["loss"] == pytest.approx(logs[-1]["nll"] + logs[-1]["aux_loss"], rel=1e-5)


def test_capacity_with_ample_capacity_equals_dropless():
  drop = _model_cfg(dispatch="dropless", every=1)
  # capacity_factor = E gives C = T slots per expert: nothing can be dropped
  cap = dataclasses.replace(drop, moe=dataclasses.replace(drop.moe, dispatch="capacity",
                                                          capacity_factor=4.0))
  tokens = _batch(l=23)["inputs"]
  params = nn.unbox(jax.jit(Transformer(drop).init)(jax.random.PRNGKey(0), tokens)["params"])
  # and a tight capacity really drops tokens (the comparison is not vacuous)
  tight = dataclasses.replace(drop, moe=dataclasses.replace(drop.moe, dispatch="capacity",
                                                            capacity_factor=0.5))

  @jax.jit
  def run(p, t):
    out = {}
    for name, m in (("dropless", drop), ("capacity", cap), ("tight", tight)):
      logits, mut = Transformer(m).apply({"params": p}, t, mutable=["aux_loss", "moe_metrics"])
      out[name] = (logits, step_lib.moe_log_metrics(mut)["dropped_fraction"])
    return out

  outs = jax.device_get(run(params, tokens))
  assert outs["dropless"][1] == 0.0 and outs["capacity"][1] == 0.0 and outs["tight"][1] > 0.2
  np.testing.assert_allclose(outs["capacity"][0], outs["dropless"][0], rtol=1e-5, atol=1e-5)
  assert np.max(np.abs(outs["tight"][0] - outs["dropless"][0])) > 1e-3


def test_expert_parallel_mesh_matches_one_device():
  """Dropless (the Mixtral path); capacity dispatch under expert sharding is covered per layer in
  test_moe.py."""
  assert jax.device_count() >= 8
  m = _model_cfg(num_experts=8, every=1, dispatch="dropless")
  m = dataclasses.replace(m, scan_layers=True)
  model, init, train_step = _setup(m)
  batches = [_batch(seed=s) for s in (1, 2)]

  # one device
  state = jax.jit(lambda r: state_lib.unbox_plain(init(r)))(jax.random.PRNGKey(0))
  start = jax.device_get(state)
  step = jax.jit(train_step)
  ref = []
  for b in batches:
    state, met = step(state, b)
    ref.append(met)
  ref_params = jax.device_get(state.params)

  # ('data', 'expert') = (2, 4): experts split 4 ways, the batch 2 ways
  mesh_cfg = ml_collections.ConfigDict(dict(shape=(2, 4), axes=("data", "expert")))
  mesh = mesh_lib.make_mesh(mesh_cfg)
  rules = rules_lib.get_rules("dp", mesh.axis_names)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    _, shardings = state_lib.state_shardings(init, jax.random.PRNGKey(0), mesh, rules)
    spec = shardings.params["layers"]["moe"]["w_gate"].spec
    assert "expert" in jax.tree.leaves(tuple(spec)), spec
    sharded = jax.device_put(start, shardings)
    bsh = mesh_lib.batch_sharding(mesh)
    pstep = jax.jit(train_step, in_shardings=(shardings, bsh), out_shardings=(shardings, None))
    got = []
    for b in batches:
      sharded, met = pstep(sharded, jax.device_put(b, bsh))
      got.append(met)
  w = sharded.params["layers"]["moe"]["w_gate"]
  assert len({s.device for s in w.addressable_shards}) == 8 and w.addressable_shards[0].data.shape[1] == 2
  for a, b in zip(ref, got):
    for k in ("loss", "aux_loss", "grad_norm", "moe/load_ratio", "moe/router_entropy"):
      np.testing.assert_allclose(float(b[k]), float(a[k]), rtol=1e-5, err_msg=k)
  flat = jax.tree_util.tree_flatten_with_path(ref_params)[0]
  for (path, x), y in zip(flat, jax.tree.leaves(jax.device_get(sharded.params))):
    np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))
