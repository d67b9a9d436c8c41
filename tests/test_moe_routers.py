"""The MoE variants of DeepSeek-V3, Qwen3-MoE and GPT-OSS (model.moe.router, shared experts, dense first
layers, expert biases, the clamped SwiGLU) and auxiliary-loss-free balancing: each router against numpy
and a hand computation (a group limit and a correction bias that change the chosen experts), GPT-OSS's
experts through every dispatch and expert parallel against numpy, shared experts and dense first layers
by name and shape, scanned == unrolled with dense first layers, the bias update's direction and value
from the step's loads, 8 devices (data, fsdp, expert) == 1 over 5 steps for a DeepSeek-V3-shaped tiny
model with its bias updates, and a kill -9 resumed bitwise with them."""
import dataclasses
import signal
import subprocess
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from test_parallel import build
from test_train import _wait_for_step, run

from tformer_jax import backends, config as config_lib
from tformer_jax.config import ConfigError, ModelConfig, MoEConfig
from tformer_jax.data import pipeline
from tformer_jax.nn import Transformer
from tformer_jax.nn.moe import MoEFFN
from tformer_jax.nn.stacking import dense_of, stack_layers, unstack_layers
from tformer_jax.ops import moe as moe_ops, moe_parallel
from tformer_jax.parallel import mesh as mesh_lib
from tformer_jax.train import state as state_lib
from tformer_jax.train.metrics import read_metrics

from train_utils import env, tiny_config, train_cmd


def _np_sigmoid_route(logits, bias, k, n_group, topk_group, norm, scale):
  """DeepSeek-V3's router in float64 numpy (transformers' DeepseekV3TopkRouter, written out)."""
  s = 1.0 / (1.0 + np.exp(-np.asarray(logits, np.float64)))
  choice = s + np.asarray(bias, np.float64)
  t, e = s.shape
  if n_group > 1:
    g = choice.reshape(t, n_group, e // n_group)
    group_score = np.sort(g, axis=-1)[..., -2:].sum(-1)
    best = np.argsort(-group_score, axis=-1, kind="stable")[:, :topk_group]
    keep = np.zeros((t, n_group), bool)
    keep[np.arange(t)[:, None], best] = True
    choice = np.where(np.repeat(keep, e // n_group, axis=-1), choice, -np.inf)
  idx = np.argsort(-choice, axis=-1, kind="stable")[:, :k]
  w = np.take_along_axis(s, idx, -1)
  if norm:
    w = w / (w.sum(-1, keepdims=True) + 1e-20)
  return w * scale, idx


def test_sigmoid_router_by_hand_the_group_limit_and_the_bias_choose():
  """E=4 in groups {0,1}, {2,3}; scores 0.9, 0.1, 0.6, 0.55. Without a group limit the top-2 is {0, 2};
  one group (topk_group=1) of the higher top-2 sum (1.15 > 1.0) gives {2, 3}; a +0.2 bias on expert 0
  tips the group sums (1.2 > 1.15) and gives {0, 1}, weighted by the unbiased scores."""
  s = np.array([[0.9, 0.1, 0.6, 0.55]])
  logits = jnp.asarray(np.log(s / (1 - s)), jnp.float32)
  w, e, _ = moe_ops.route_sigmoid(logits, None, top_k=2)
  assert sorted(np.asarray(e)[0].tolist()) == [0, 2]
  w, e, _ = moe_ops.route_sigmoid(logits, None, top_k=2, n_group=2, topk_group=1, routed_scaling_factor=2.5)
  assert np.asarray(e)[0].tolist() == [2, 3]
  np.testing.assert_allclose(np.asarray(w)[0], [2.5 * 0.6 / 1.15, 2.5 * 0.55 / 1.15], rtol=1e-6)
  bias = jnp.array([0.2, 0.0, 0.0, 0.0])
  w, e, _ = moe_ops.route_sigmoid(logits, bias, top_k=2, n_group=2, topk_group=1)
  assert np.asarray(e)[0].tolist() == [0, 1]
  np.testing.assert_allclose(np.asarray(w)[0], [0.9, 0.1], rtol=1e-6)    # 0.9 / 1.0, 0.1 / 1.0: unbiased
  w, _, _ = moe_ops.route_sigmoid(logits, bias, top_k=2, n_group=2, topk_group=1, renormalize=False)
  np.testing.assert_allclose(np.asarray(w)[0], [0.9, 0.1], rtol=1e-6)


@pytest.mark.parametrize("norm", [True, False])
def test_sigmoid_router_matches_numpy_and_the_group_limit_changes_choices(norm):
  t, e, k = 64, 16, 4
  logits = 2.0 * jax.random.normal(jax.random.key(0), (t, e))
  bias = 0.1 * jax.random.normal(jax.random.key(1), (e,))
  w, idx, probs = moe_ops.route_sigmoid(logits, bias, top_k=k, n_group=4, topk_group=2, renormalize=norm,
                                        routed_scaling_factor=2.5)
  w_ref, idx_ref = _np_sigmoid_route(logits, bias, k, 4, 2, norm, 2.5)
  np.testing.assert_array_equal(np.asarray(idx), idx_ref)
  np.testing.assert_allclose(np.asarray(w), w_ref, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(np.asarray(probs).sum(-1), 1.0, rtol=1e-6)
  _, free = _np_sigmoid_route(logits, bias, k, 0, 0, norm, 2.5)
  changed = np.mean([set(a) != set(b) for a, b in zip(idx_ref, free)])
  assert changed > 0.2, changed                           # the group limit decides for many tokens
  _, unbiased = _np_sigmoid_route(logits, np.zeros(e), k, 4, 2, norm, 2.5)
  assert np.any(unbiased != idx_ref)                      # so does the correction bias


def test_softmax_topk_and_softmax_routers_match_numpy():
  t, e, k = 32, 8, 2
  logits = np.asarray(3.0 * jax.random.normal(jax.random.key(2), (t, e)), np.float64)
  w, idx, probs = moe_ops.route_by("softmax_topk", jnp.asarray(logits, jnp.float32), top_k=k)
  top = np.argsort(-logits, -1)[:, :k]                    # GPT-OSS: top-k logits, softmax over the k
  v = np.take_along_axis(logits, top, -1)
  w_ref = np.exp(v - v.max(-1, keepdims=True))
  w_ref /= w_ref.sum(-1, keepdims=True)
  np.testing.assert_array_equal(np.asarray(idx), top)
  np.testing.assert_allclose(np.asarray(w), w_ref, rtol=1e-5)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  np.testing.assert_allclose(np.asarray(probs), p, rtol=1e-5)
  for norm in (True, False):                              # Qwen3-MoE: norm_topk_prob
    w, idx, _ = moe_ops.route_by("softmax", jnp.asarray(logits, jnp.float32), top_k=k, renormalize=norm)
    raw = np.take_along_axis(p, top, -1)
    np.testing.assert_array_equal(np.asarray(idx), top)
    np.testing.assert_allclose(np.asarray(w), raw / raw.sum(-1, keepdims=True) if norm else raw, rtol=1e-5)


def _gpt_oss_experts(t=48, d=16, f=24, e=8, k=2, seed=3):
  ks = jax.random.split(jax.random.key(seed), 8)
  x = jax.random.normal(ks[0], (t, d))
  w, ex, _ = moe_ops.route_softmax_topk(2.0 * jax.random.normal(ks[1], (t, e)), top_k=k)
  prm = {"w_gate": 0.6 * jax.random.normal(ks[2], (e, d, f)), "w_up": 0.6 * jax.random.normal(ks[3], (e, d, f)),
         "w_down": 0.2 * jax.random.normal(ks[4], (e, f, d)), "b_gate": 0.5 * jax.random.normal(ks[5], (e, f)),
         "b_up": 0.5 * jax.random.normal(ks[6], (e, f)), "b_down": 0.5 * jax.random.normal(ks[7], (e, d))}
  return x, prm, w, ex


def _np_gpt_oss(x, prm, w, ex, limit, alpha=1.702):
  """transformers' GptOssExperts per token (gate and up de-interleaved), float64."""
  x, w, ex = (np.asarray(a, np.float64) for a in (x, w, ex))
  p = {n: np.asarray(v, np.float64) for n, v in prm.items()}
  y = np.zeros_like(x)
  clamped = 0
  for t in range(x.shape[0]):
    for j in range(ex.shape[1]):
      i = int(ex[t, j])
      gate = x[t] @ p["w_gate"][i] + p["b_gate"][i]
      up = x[t] @ p["w_up"][i] + p["b_up"][i]
      clamped += np.sum(gate > limit) + np.sum(np.abs(up) > limit)
      gate, up = np.minimum(gate, limit), np.clip(up, -limit, limit)
      h = (up + 1) * gate / (1 + np.exp(-alpha * gate))
      y[t] += w[t, j] * (h @ p["w_down"][i] + p["b_down"][i])
  return y, clamped


def test_gpt_oss_experts_every_dispatch_and_expert_parallel_match_numpy():
  """The clamped SwiGLU with expert biases: dropless, capacity (einsum, scatter), the naive reference and
  expert parallel on 4 devices all give transformers' formula (the clamp really active)."""
  x, prm, w, ex = _gpt_oss_experts()
  limit = 1.0
  ref, clamped = _np_gpt_oss(x, prm, w, ex, limit)
  assert clamped > 100
  kw = dict(activation="swiglu", swiglu_limit=limit)
  outs = {"dropless": moe_ops.moe_ffn_dropless(x, prm, w, ex, **kw),
          "naive": moe_ops.moe_ffn_naive(x, prm, w, ex, **kw)}
  for impl in ("einsum", "scatter"):
    y, dropped = moe_ops.moe_ffn_capacity(x, prm, w, ex, capacity=x.shape[0], impl=impl, **kw)
    assert float(dropped) == 0.0
    outs[impl] = y
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:4]), ("expert",), axis_types=(AxisType.Auto,))
  outs["expert_parallel"], _ = jax.jit(lambda *a: moe_parallel.moe_ffn_expert_parallel(
      *a, mesh=mesh, **kw))(x, prm, w, ex)
  for name, y in outs.items():
    np.testing.assert_allclose(np.asarray(y), ref, rtol=2e-5, atol=2e-5, err_msg=name)


def _cfg(**moe) -> ModelConfig:
  base = dict(num_experts=8, top_k=2, d_ff=16, router="sigmoid", n_group=4, topk_group=2,
              routed_scaling_factor=2.5, num_shared_experts=1, first_k_dense=1)
  base.update(moe)
  return ModelConfig(vocab_size=64, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2, max_len=16,
                     position="rope", norm="rmsnorm", activation="swiglu", d_ff=40, tie_embeddings=False,
                     moe=MoEConfig(**base))


def _shapes(tree):
  return jax.tree.map(lambda x: tuple(x.shape), nn.unbox(tree))


def _param_shapes(cfg, tok):
  return _shapes(jax.eval_shape(Transformer(cfg).init, jax.random.key(0), tok)["params"])


def test_shared_experts_and_dense_first_layers_names_and_shapes():
  tok = jnp.zeros((2, 8), jnp.int32)
  cfg = _cfg(num_shared_experts=2, shared_d_ff=12, expert_bias=True)
  p = _param_shapes(cfg, tok)
  assert p["layers_0"]["mlp"] == {"wi": (32, 40), "wg": (32, 40), "wo": (40, 32)}   # the model's d_ff
  assert "moe" not in p["layers_0"]
  for i in (1, 2):
    assert p[f"layers_{i}"]["moe"] == {
        "router": (32, 8), "correction_bias": (8,), "w_gate": (8, 32, 16), "w_up": (8, 32, 16),
        "w_down": (8, 16, 32), "b_gate": (8, 16), "b_up": (8, 16), "b_down": (8, 32),
        "shared_w_gate": (32, 24), "shared_w_up": (32, 24), "shared_w_down": (24, 32)}
  s = _param_shapes(dataclasses.replace(cfg, scan_layers=True), tok)
  assert s["dense_layers"]["mlp"]["wi"] == (1, 32, 40) and "moe" not in s["dense_layers"]
  assert s["layers"]["moe"]["correction_bias"] == (2, 8) and s["layers"]["moe"]["shared_w_down"] == (2, 24, 32)
  assert "layers_0" not in s and "mlp" not in s["layers"]
  # the older boolean is one shared expert of the expert width; GPT-OSS's router has a bias, no correction
  old = _param_shapes(_cfg(num_shared_experts=0, shared_expert=True, router="softmax_topk", n_group=0,
                           topk_group=0), tok)["layers_1"]["moe"]
  assert old["shared_w_gate"] == (32, 16) and old["router_bias"] == (8,) and "correction_bias" not in old


def test_shared_experts_add_one_wide_mlp():
  """The layer's output minus the same layer with the shared weights zeroed is the SwiGLU MLP of the
  shared weights (numpy): N shared experts of width F_s are one MLP of width N * F_s."""
  cfg = _cfg(num_shared_experts=2, shared_d_ff=12, first_k_dense=0)
  mod = MoEFFN(cfg)
  x = jax.random.normal(jax.random.key(4), (2, 8, 32))
  params = nn.unbox(mod.init(jax.random.key(5), x)["params"])
  y = mod.apply({"params": params}, x)
  zeroed = {k: (jnp.zeros_like(v) if k.startswith("shared_") else v) for k, v in params.items()}
  y0 = mod.apply({"params": zeroed}, x)
  xs = np.asarray(x, np.float64).reshape(-1, 32)
  g, u = xs @ np.asarray(params["shared_w_gate"]), xs @ np.asarray(params["shared_w_up"])
  ref = (g / (1 + np.exp(-g)) * u) @ np.asarray(params["shared_w_down"])
  np.testing.assert_allclose(np.asarray(y - y0).reshape(-1, 32), ref, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("pattern", ["", "LG"])
def test_dense_first_layers_scanned_equal_unrolled(pattern):
  """Unrolled layers_0..4 stacked into 'dense_layers' + 'layers' (with a layer pattern: per block, the
  leftover layer after the cycles) give the scanned model's logits; unstacking gives them back."""
  extra = dict(layer_pattern=pattern, window=4) if pattern else {}
  moe = dict(first_k_dense=2 if pattern else 1, expert_bias=True)
  unrolled = dataclasses.replace(_cfg(**moe), num_layers=5, **extra)
  scanned = dataclasses.replace(unrolled, scan_layers=True)
  tok = jax.random.randint(jax.random.key(6), (2, 12), 0, 64)
  params = nn.unbox(jax.jit(Transformer(unrolled).init)(jax.random.key(7), tok)["params"])
  # non-zero correction biases, so that a mixed-up layer would route differently
  params = jax.tree_util.tree_map_with_path(
      lambda p, x: x + 0.05 * jax.random.normal(jax.random.key(len(str(p))), x.shape)
      if "correction_bias" in jax.tree_util.keystr(p) else x, params)
  stacked = stack_layers(params, 5, unrolled.cycle, unrolled.moe.first_k_dense)
  assert _shapes(stacked) == _param_shapes(scanned, tok)
  assert dense_of(stacked) == unrolled.moe.first_k_dense
  ref = jax.jit(Transformer(unrolled).apply)({"params": params}, tok)
  out = jax.jit(Transformer(scanned).apply)({"params": stacked}, tok)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)
  back = unstack_layers(stacked, 5, unrolled.cycle)
  assert jax.tree.all(jax.tree.map(np.array_equal, back, params))


@pytest.mark.parametrize("field,value,match", [
    ("bias_update_rate", 1e-3, "sigmoid router"), ("n_group", 3, "groups of at least 2"),
    ("first_k_dense", 3, "below num_layers"), ("num_shared_experts", 2, "contradicts"),
    ("swiglu_limit", 7.0, "clamps SwiGLU"), ("router", "bogus", "router")])
def test_bad_moe_fields_are_one_line_errors(field, value, match):
  cfg = config_lib.default_config()
  cfg.model.vocab_size, cfg.model.num_layers = 64, 3
  cfg.model.moe.num_experts, cfg.model.moe.top_k = 8, 2
  if field == "n_group":
    cfg.model.moe.router, cfg.model.moe.topk_group = "sigmoid", 1
  if field == "num_shared_experts":
    cfg.model.moe.shared_expert = True
  cfg.model.moe[field] = value
  with pytest.raises(ConfigError, match=match):
    config_lib.validate(cfg)


def test_bias_update_rule_by_hand():
  bias = jnp.array([0.0, 0.1, -0.1, 0.0])
  new = moe_ops.bias_update(bias, jnp.array([0.5, 0.25, 0.25, 0.0]), 0.01)    # mean 0.25
  np.testing.assert_array_equal(np.asarray(new), np.asarray(bias + jnp.array([-0.01, 0.0, 0.0, 0.01])))
  stacked = moe_ops.bias_update(jnp.zeros((2, 4)), jnp.array([[4, 0, 0, 0], [1, 1, 1, 1.0]]), 1.0)
  np.testing.assert_array_equal(np.asarray(stacked), [[-1, 1, 1, 1], [0, 0, 0, 0]])


DS = {"model.activation": "swiglu", "model.num_layers": 3, "model.num_kv_heads": 2,
      "model.moe.num_experts": 8, "model.moe.top_k": 2, "model.moe.d_ff": 32, "model.moe.router": "sigmoid",
      "model.moe.n_group": 4, "model.moe.topk_group": 2, "model.moe.routed_scaling_factor": 2.5,
      "model.moe.num_shared_experts": 1, "model.moe.first_k_dense": 1, "model.moe.bias_update_rate": 0.01,
      "model.moe.aux_loss_coef": 0.0, "model.scan_layers": True}


def _run_steps(cfg, steps: int, backend=None):
  """`steps` sharded train steps (test_parallel.build): (losses, the correction biases before and after
  each step, metrics, (first params, first batch), model, final state)."""
  with backends.use(backend or backends.Backend()):
    ds, mesh, rules, model, _, shardings, init, step = build(cfg)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
      state = state_lib.create_state(init, jax.random.PRNGKey(cfg.train.seed), shardings)
    it = pipeline.train_iterator(ds, cfg.data)
    batch_sh = mesh_lib.batch_sharding(mesh)
    losses, biases, metrics, first = [], [jax.device_get(state.params["layers"]["moe"]["correction_bias"])], [], None
    for _ in range(steps):
      batch = {k: jax.device_put(np.asarray(v), batch_sh) for k, v in next(it).items()}
      first = first or (jax.device_get(state.params), jax.device_get(batch))
      state, m = step(state, batch)
      losses.append(float(m["loss"]))
      biases.append(jax.device_get(state.params["layers"]["moe"]["correction_bias"]))
      metrics.append(jax.device_get(m))
  return losses, biases, metrics, first, model, state


def test_bias_moves_against_the_steps_loads_outside_the_optimizer():
  """After one step each layer's bias is exactly old + rate * sign(mean load - load), the loads being the
  layer's routing choices on the whole batch (recomputed here from the old params); the per-layer
  load statistics are logged."""
  cfg = tiny_config(steps=2, **DS, **{"mesh.num_devices": 1})
  _, biases, metrics, (params0, batch0), model, _ = _run_steps(cfg, 1)
  _, mut = model.apply({"params": params0}, batch0["inputs"], mutable=["moe_metrics"])
  load = np.asarray(mut["moe_metrics"]["layers"]["moe"]["load"][0])     # (2 MoE layers, 8)
  assert load.shape == (2, 8) and np.all(load.max(-1) > 1 / 8)
  want = np.asarray(biases[0]) + np.float32(0.01) * np.sign(load.mean(-1, keepdims=True) - load).astype(np.float32)
  np.testing.assert_array_equal(biases[1], want)
  assert np.all(biases[1][load == load.max(-1, keepdims=True)] < 0)   # the busiest expert is pushed down
  m = metrics[0]
  for i in (1, 2):
    np.testing.assert_allclose(m[f"moe/layer_{i}/load_max_mean"], 8 * load[i - 1].max(), rtol=1e-6)
    assert m[f"moe/layer_{i}/dropped_fraction"] == 0.0
  assert "moe/layer_0/load_max_mean" not in m           # the dense first layer


def test_deepseek_shaped_moe_on_data_fsdp_expert_equals_one_device_over_5_steps():
  """(data 2, fsdp 2, expert 2) expert parallel: the losses and every step's correction biases equal one
  device's (the loads are the global batch's, whatever the layout)."""
  one, b_one, _, _, _, _ = _run_steps(tiny_config(steps=5, **DS, **{"mesh.num_devices": 1}), 5)
  cfg = tiny_config(steps=5, **DS, **{"mesh.axes": ("data", "fsdp", "expert"), "mesh.shape": (2, 2, 2),
                                       "mesh.rules": "fsdp"})
  ep = backends.Backend(moe_exchange="all_to_all")
  sharded, b_sh, _, _, _, state = _run_steps(cfg, 5, ep)
  assert state.params["layers"]["moe"]["w_gate"].sharding.spec[1] == "expert"
  np.testing.assert_allclose(sharded, one, rtol=1e-5)
  for a, b in zip(b_one, b_sh):
    np.testing.assert_allclose(a, b, atol=1e-7)
  assert not np.array_equal(b_one[-1], b_one[0])        # the biases did move
  assert one[-1] < one[0]


@pytest.mark.slow
def test_bias_updates_survive_kill_9_and_resume_bitwise(tmp_path):
  flags = [f"--config.{k}={v}" for k, v in DS.items() if k != "model.scan_layers"]
  flags += ["--config.train.steps=10", "--config.train.ckpt_every=4", "--config.train.eval_every=10"]
  ref = run(train_cmd(tmp_path / "ref", *flags))
  assert ref.returncode == 0, ref.stderr[-3000:]
  crash = tmp_path / "crash"
  proc = subprocess.Popen(train_cmd(crash, *flags), env=env(), stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
  _wait_for_step(crash, 5, proc)
  t0 = time.time()   # step 4's asynchronous save finished (a loaded machine may lag), then the kill
  while not (crash / "checkpoints" / "4").is_dir() and proc.poll() is None and time.time() - t0 < 120:
    time.sleep(0.1)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  resumed = run(train_cmd(crash, *flags))
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "resumed from step" in resumed.stderr
  from tformer_jax.checkpoint import restore_params
  a, b = restore_params(tmp_path / "ref")[1], restore_params(crash)[1]
  assert np.any(np.asarray(a["layers_1"]["moe"]["correction_bias"]) != 0)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  losses = lambda d: {r["step"]: r["loss"] for r in read_metrics(d) if "loss" in r}  # noqa: E731
  l_ref, l_res = losses(tmp_path / "ref"), losses(crash)
  assert all(l_ref[s] == l_res[s] for s in range(5, 11))


def test_layer_norm_statistics_name_dense_first_layers_alike_scanned_or_unrolled():
  """train.stats' per-module squared norms: a scanned 'dense_layers' + 'layers' stack gives the unrolled
  model's layers_<i> names and values (the MoE stack numbered after the dense layers)."""
  from tformer_jax.train import stats
  cfg = _cfg()
  p = nn.unbox(jax.jit(Transformer(cfg).init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"])
  a, b = stats.group_sq_norms(p), stats.group_sq_norms(stack_layers(p, 3, 1, 1))
  assert sorted(a) == sorted(b) and "layers_0/mlp" in a and "layers_2/moe" in a
  for k in a:
    np.testing.assert_allclose(float(b[k]), float(a[k]), rtol=1e-5, err_msg=k)
