"""Expert parallelism (ops/moe_parallel.py through Backend.moe_ffn) on the 8 fake CPU devices: the model's
logits, loss, aux losses and gradients equal one device's; the exchange really happens (an all-to-all in
the compiled step); the dropless buffer's overflow is counted; megablox (interpret) equals ragged_dot;
per-device matmul FLOPs of the layer are the formula's share; 10 `tformer-train` steps on (data=2,
expert=4) give the single-device losses; the runtime picks the exchange from the target platform."""
import json
import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from tformer_jax import aot, backends, config as config_lib
from tformer_jax.config import ConfigError, ModelConfig, MoEConfig
from tformer_jax.nn import Transformer
from tformer_jax.nn.moe import MoEFFN, collect_aux_loss
from tformer_jax.ops import moe as moe_ops, moe_parallel
from tformer_jax.parallel import mesh as mesh_lib, rules as rules_lib

from train_utils import REPO, env

TOL = 1e-5
EP = backends.Backend(moe_exchange="all_to_all")
MESHES = {"expert8": ((8,), ("expert",), "dp"), "data2_expert4": ((2, 4), ("data", "expert"), "dp"),
          "fsdp2_expert4": ((2, 4), ("fsdp", "expert"), "fsdp")}


def _mesh(shape, axes):
  return jax.make_mesh(shape, axes, axis_types=(AxisType.Auto,) * len(axes))


def _model_cfg(dispatch: str) -> ModelConfig:
  return ModelConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=4, num_kv_heads=2, max_len=16,
                     position="rope", norm="rmsnorm", activation="swiglu", tie_embeddings=False,
                     moe=MoEConfig(num_experts=8, top_k=2, d_ff=48, dispatch=dispatch, capacity_factor=1.0,
                                   aux_loss_coef=0.01, z_loss_coef=0.001))


def _loss_fn(model):
  def loss(params, tokens):
    logits, mut = model.apply({"params": params}, tokens[:, :-1], mutable=["aux_loss", "moe_metrics"])
    nll = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1))
    aux = collect_aux_loss(mut)
    return nll + aux, (logits, aux)
  return jax.value_and_grad(loss, has_aux=True)


@pytest.fixture(scope="module")
def setups():
  out = {}
  tokens = jax.random.randint(jax.random.key(1), (8, 17), 0, 64)
  for dispatch in ("dropless", "capacity"):
    model = Transformer(_model_cfg(dispatch))
    variables = jax.jit(model.init)(jax.random.key(0), tokens[:, :-1])
    params = nn.unbox(variables["params"])
    ref = jax.jit(_loss_fn(model))(params, tokens)
    out[dispatch] = (model, variables, params, tokens, ref)
  return out


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_model_on_expert_meshes_matches_one_device(setups, mesh_name, dispatch):
  model, variables, params, tokens, ref = setups[dispatch]
  shape, axes, preset = MESHES[mesh_name]
  mesh = _mesh(shape, axes)
  rules = rules_lib.get_rules(preset, axes)
  shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(variables), mesh, rules)["params"]
  specs = {jax.tree_util.keystr(k): v.spec for k, v in jax.tree_util.tree_leaves_with_path(shardings)}
  assert all(v[0] == "expert" for k, v in specs.items() if "w_gate" in k)
  params_sh = jax.device_put(params, shardings)
  tokens_sh = jax.device_put(tokens, mesh_lib.batch_sharding(mesh))
  with backends.use(EP):
    step = jax.jit(mesh_lib.traced_under(_loss_fn(model), mesh, rules)).lower(params_sh, tokens_sh).compile()
    (loss, (logits, aux)), grads = step(params_sh, tokens_sh)
    text = step.as_text()
  assert "all-to-all" in text                             # rows really travel between devices
  (ref_loss, (ref_logits, ref_aux)), ref_grads = ref
  np.testing.assert_allclose(logits, ref_logits, atol=TOL, rtol=TOL)
  np.testing.assert_allclose(loss, ref_loss, atol=TOL, rtol=TOL)
  np.testing.assert_allclose(aux, ref_aux, atol=TOL, rtol=TOL)
  for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(g, r, atol=TOL, rtol=TOL, err_msg=jax.tree_util.keystr(path))


def _routed(t=64, d=16, f=32, e=8, k=2, seed=0):
  ks = jax.random.split(jax.random.key(seed), 5)
  x = jax.random.normal(ks[0], (t, d))
  w, ex, _ = moe_ops.route(2.0 * jax.random.normal(ks[1], (t, e)), top_k=k)
  prm = {n: 0.2 * jax.random.normal(kk, (e, f, d) if n == "w_down" else (e, d, f))
         for n, kk in zip(("w_gate", "w_up", "w_down"), ks[2:])}
  return x, prm, w, ex


def _expected_dropped(ex, shards: int, p: int, rows: int, e: int) -> int:
  """The buffer rule in numpy: per receiver, sources in order, rows past `rows` dropped."""
  ex = np.asarray(ex).reshape(shards, -1)
  dev = ex // (e // p)
  total = 0
  for g in range(shards // p):
    for j in range(p):
      sent = [int(np.sum(dev[g * p + s] == j)) for s in range(p)]
      total += max(0, sum(sent) - rows)
  return total


def test_buffer_factor_counts_the_dropped_rows_and_the_worst_case_drops_none():
  x, prm, w, ex = _routed()
  mesh = _mesh((8,), ("expert",))
  ref = moe_ops.moe_ffn_dropless(x, prm, w, ex, activation="swiglu")
  run = lambda f: jax.jit(lambda *a: moe_parallel.moe_ffn_expert_parallel(  # noqa: E731
      *a, activation="swiglu", mesh=mesh, buffer_factor=f))(x, prm, w, ex)
  y, dropped = run(0.0)
  np.testing.assert_allclose(y, ref, atol=TOL, rtol=TOL)
  assert float(dropped) == 0.0
  rows = moe_parallel.receive_rows(64, 8, 2, 8, 8, buffer_factor=1.0)
  want = _expected_dropped(ex, 8, 8, rows, 8)
  assert want > 0
  y1, dropped1 = run(1.0)
  assert float(dropped1) == pytest.approx(want / ex.size)
  assert not np.allclose(y1, ref, atol=1e-3)             # the dropped rows are missing from y


def test_megablox_interpret_matches_ragged_dot_with_gradients():
  x, prm, w, ex = _routed(t=32, d=128, f=128, e=4, k=2)
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:4]), ("expert",), axis_types=(AxisType.Auto,))

  def f(gmm):
    def loss(x, prm):
      y, _ = moe_parallel.moe_ffn_expert_parallel(x, prm, w, ex, activation="swiglu", mesh=mesh,
                                                  gmm=gmm, interpret=True)
      return jnp.sum(y ** 2)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, prm)

  a, b = f("megablox"), f("ragged_dot")
  for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(u, v, atol=1e-4, rtol=1e-4)


def test_moe_layer_flops_per_device_are_the_formula_share():
  """One expert per device on 8 devices, a balanced-load buffer: <= 1.15x the layer's formula / 8."""
  t, d, f, e, k = 1024, 64, 128, 8, 2
  cfg = ModelConfig(d_model=d, activation="swiglu", moe=MoEConfig(num_experts=e, top_k=k, d_ff=f,
                                                                  ep_buffer_factor=1.0))
  mod = MoEFFN(cfg)
  x = jnp.zeros((8, t // 8, d))
  variables = jax.jit(mod.init)(jax.random.key(0), x)
  mesh = _mesh((8,), ("expert",))
  rules = rules_lib.get_rules((("batch", "expert"), ("expert", "expert")), mesh.axis_names)
  shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(variables), mesh, rules)
  v = jax.device_put(nn.unbox(variables), nn.unbox(shardings))
  x = jax.device_put(x, jax.NamedSharding(mesh, P("expert")))
  with backends.use(EP):
    fwd = jax.jit(mesh_lib.traced_under(lambda v, x: mod.apply(v, x, mutable=["aux_loss", "moe_metrics"])[0],
                                        mesh, rules))
    text = fwd.lower(v, x).compile().as_text()
  formula = 2 * t * d * e + 2 * t * k * 3 * d * f
  per_device = aot.hlo_matmul_flops(text)
  assert per_device <= 1.15 * formula / 8, (per_device, formula / 8)
  assert per_device >= 0.9 * formula / 8


def test_runtime_picks_the_exchange_from_the_target_platform():
  cfg = config_lib.load_config_file(REPO / "configs" / "mixtral_tiny.py")
  tpu = backends.resolve_runtime(cfg, platform="tpu", quiet=True)
  # megablox on a TPU: XLA:TPU's ragged_dot weight gradient runs every local expert over every row
  assert (tpu.backend.moe_exchange, tpu.backend.moe_gmm) == ("ragged", "megablox") and not tpu.backend.moe_interpret
  assert tpu.as_dict()["moe_exchange"] == "ragged" and any("ragged" in r for r in tpu.reasons)
  cpu = backends.resolve_runtime(cfg, platform="cpu", quiet=True)
  assert cpu.backend.moe_exchange == "all_to_all"
  cfg.runtime.moe_gmm = "megablox"
  assert backends.resolve_runtime(cfg, platform="cpu", quiet=True).backend.moe_interpret
  cfg.runtime.moe_exchange = "ragged"
  with pytest.raises(ConfigError, match="runtime.moe_exchange: 'ragged'"):
    backends.resolve_runtime(cfg, platform="cpu", quiet=True)
  cfg.runtime.moe_exchange = "bogus"
  with pytest.raises(ConfigError, match="runtime.moe_exchange"):
    config_lib.validate(cfg)


STEPS = 10   # past the 5 warmup steps: 5 updates at the peak rate after them; each step's loss is compared


def _train(workdir, devices: int, *flags: str) -> dict[int, float]:
  e = env(devices)
  cmd = [sys.executable, str(REPO / "scripts" / "train.py"), f"--config={REPO / 'configs' / 'mixtral_tiny.py'}",
         f"--workdir={workdir}", "--config.data.seq_len=32", "--config.data.batch_size=8",
         f"--config.train.steps={STEPS}", "--config.train.log_every=1", f"--config.train.eval_every={STEPS}",
         "--config.train.eval_batches=1", f"--config.train.ckpt_every={STEPS}", "--config.runtime.cpu_kernels=off",
         "--config.optim.warmup_steps=5", *flags]
  r = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=e)
  assert r.returncode == 0, r.stderr[-3000:]
  rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  return {row["step"]: row["loss"] for row in rows if "loss" in row}, r.stderr


@pytest.mark.slow
def test_mixtral_tiny_trains_the_same_on_data2_expert4(tmp_path):
  one, _ = _train(tmp_path / "one", 1)
  ep, _ = _train(tmp_path / "ep", 8, "--config.mesh.axes=('data','expert')", "--config.mesh.shape=(2,4)")
  assert json.loads((tmp_path / "ep" / "runtime.json").read_text())["moe_exchange"] == "all_to_all"
  assert sorted(one) == sorted(ep) and len(one) == STEPS
  for step in one:
    assert abs(one[step] - ep[step]) <= 1e-4, (step, one[step], ep[step])


def test_emulated_ragged_all_to_all_follows_the_documented_example():
  """jax.lax.ragged_all_to_all's docstring example (axis of size 2), through the dense emulation."""
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:2]), ("x",), axis_types=(AxisType.Auto,))
  args = [np.array(a, np.int32) for a in (
      [[1], [2], [2], [3], [4], [0]], [[0]] * 8, [0, 1, 0, 1], [1, 2, 1, 1], [0, 0, 1, 2], [1, 1, 2, 1])]
  fn = jax.shard_map(lambda *a: moe_parallel.emulated_ragged_all_to_all(*a, axis_name="x", chunk=2),
                     mesh=mesh, in_specs=(P("x"),) * 6, out_specs=P("x"))
  out = jax.jit(fn)(*args)
  np.testing.assert_array_equal(np.asarray(out)[:, 0], [1, 3, 0, 0, 2, 2, 4, 0])
