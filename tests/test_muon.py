"""optim.name=muon (train/optim.py, optax.contrib's Muon): the update of one matrix against a hand-written
Newton-Schulz, each weight's matrix axes from its logical names (attention (embed, heads, kv) and
(heads, kv, embed), a stack of experts), which parameters get Muon and which AdamW (by path, the default
experiment and a MoE model), the state sharded like the params on a (data, fsdp, tensor) mesh and equal to
one device over 5 steps, and a kill -9 resumed bitwise."""
import signal
import subprocess

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_parallel import MESH_222, _spec, build, direct_losses
from test_train import _wait_for_step, run

from tformer_jax.config import default_config, load_config_file
from tformer_jax.nn import Transformer
from tformer_jax.train import optim
from tformer_jax.train.metrics import read_metrics

from train_utils import REPO, env, tiny_config, train_cmd

NS = (3.4445, -4.7750, 2.0315)   # Keller Jordan's quintic coefficients (optax's default)


def newton_schulz(m: np.ndarray, steps: int = 5) -> np.ndarray:
  """The reference, written out in float64: X = M / ||M||_F (the wide orientation), then
  X <- a X + (b A + c A^2) X with A = X X^T, `steps` times."""
  x = np.asarray(m, np.float64)
  tall = x.shape[0] > x.shape[1]
  x = x.T if tall else x
  x = x / (np.linalg.norm(x) + 1e-8)
  a, b, c = NS
  for _ in range(steps):
    g = x @ x.T
    x = a * x + (b * g + c * g @ g) @ x
  return x.T if tall else x


def _muon_cfg(**kw):
  c = default_config().optim
  c.name, c.schedule, c.warmup_steps, c.clip_norm, c.weight_decay, c.peak_lr = "muon", "constant", 0, 0.0, 0.0, 0.1
  for k, v in kw.items():
    c[k] = v
  return c


@pytest.mark.parametrize("name,axes,shape,matrix", [
    ("wi", ("embed", "mlp"), (24, 40), lambda g: g),                                   # FFN in: (in, out)
    ("wq", ("embed", "heads", "kv"), (24, 4, 6), lambda g: g.reshape(24, 24)),          # reads 'embed'
    ("wo", ("heads", "kv", "embed"), (4, 6, 16), lambda g: g.reshape(24, 16)),          # writes 'embed'
])
def test_first_update_of_one_matrix_is_newton_schulz(name, axes, shape, matrix):
  """Step 1 with Nesterov momentum beta: mu_hat = (1 + beta / (1 + beta)) g; the update is
  -lr * 0.2 sqrt(max(in, out)) * NS(mu_hat) (Moonshot's RMS match), equal to the reference to 1e-5."""
  g = jax.random.normal(jax.random.PRNGKey(0), shape)
  params = {"layers_0": {"attn" if name != "wi" else "mlp": {name: jnp.zeros(shape)}}}
  path = "/".join(["layers_0", "attn" if name != "wi" else "mlp", name])
  tx, _ = optim.make_optimizer(_muon_cfg(), 10, param_axes={path: axes})
  state = tx.init(params)
  grads = jax.tree.map(lambda _: g, params)
  updates, _ = tx.update(grads, state, params)
  got = np.asarray(jax.tree.leaves(updates)[0])
  beta = 0.95
  m = matrix(np.asarray(g, np.float64)) * (1 + beta / (1 + beta))
  fan_in, fan_out = m.shape
  want = -0.1 * 0.2 * np.sqrt(max(fan_in, fan_out)) * newton_schulz(m)
  np.testing.assert_allclose(matrix(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_experts_are_a_batch_of_matrices():
  """(expert, embed, mlp): each expert's matrix orthogonalised on its own (MuonDimensionNumbers' batch)."""
  e, d, f = 3, 8, 12
  g = jax.random.normal(jax.random.PRNGKey(1), (e, d, f))
  params = {"layers_0": {"moe": {"w_up": jnp.zeros((e, d, f))}}}
  tx, _ = optim.make_optimizer(_muon_cfg(muon_rms=0.0), 10,
                               param_axes={"layers_0/moe/w_up": ("expert", "embed", "mlp")})
  updates, _ = tx.update({"layers_0": {"moe": {"w_up": g}}}, tx.init(params), params)
  got = np.asarray(updates["layers_0"]["moe"]["w_up"])
  scale = 1 + 0.95 / 1.95
  for i in range(e):   # muon_rms=0: width scaling sqrt(max(1, out / in))
    want = -0.1 * np.sqrt(max(1.0, f / d)) * newton_schulz(np.asarray(g[i], np.float64) * scale)
    np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def _split(cfg) -> tuple[list[str], list[str]]:
  """(Muon paths, AdamW paths) of cfg's model, from its boxed params' logical axes."""
  m = Transformer(__import__("tformer_jax").config.ModelConfig.from_config(cfg.model))
  boxed = jax.eval_shape(lambda r: m.init(r, jnp.zeros((1, 8), jnp.int32))["params"], jax.random.PRNGKey(0))
  labels = optim.muon_labels(boxed)
  flat = jax.tree_util.tree_flatten_with_path(labels, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))[0]
  by = {"muon": [], "adam": []}
  for path, lab in flat:
    by[lab.value if isinstance(lab, nn.meta.AxisMetadata) else lab].append(optim._path_key(path))
  return sorted(by["muon"]), sorted(by["adam"])


def test_which_parameters_get_muon_default_experiment_and_moe():
  c = default_config()
  c.model.vocab_size = 256
  muon, adam = _split(c)
  layer = lambda i: [f"layers_{i}/attn/{w}" for w in ("wk", "wo", "wq", "wv")] + [f"layers_{i}/mlp/{w}" for w in ("wi", "wo")]  # noqa: E731,E501
  assert muon == sorted(sum((layer(i) for i in range(4)), []))
  norms = lambda i: [f"layers_{i}/{n}/{p}" for n in ("ln1", "ln2") for p in ("bias", "scale")]  # noqa: E731
  assert adam == sorted(["embed", "pos_embed", "final_norm/bias", "final_norm/scale"]
                        + sum((norms(i) for i in range(4)), []))
  moe = load_config_file(REPO / "configs" / "mixtral_tiny.py")
  muon, adam = _split(moe)
  experts = lambda i: [f"layers_{i}/moe/{w}" for w in ("w_down", "w_gate", "w_up")]  # noqa: E731
  attn = lambda i: [f"layers_{i}/attn/{w}" for w in ("wk", "wo", "wq", "wv")]  # noqa: E731
  assert muon == sorted(sum((attn(i) + experts(i) for i in range(2)), []))
  assert adam == sorted(["embed", "head", "final_norm/scale"]
                        + sum(([f"layers_{i}/ln1/scale", f"layers_{i}/ln2/scale", f"layers_{i}/moe/router"]
                               for i in range(2)), []))


def test_scanned_layers_add_a_batch_axis():
  assert optim.muon_dims(("layers", "embed", "heads", "kv")) == optim.optax_contrib.MuonDimensionNumbers((1,), (2, 3))
  assert optim.muon_dims(("layers", "expert", "mlp", "embed")) == optim.optax_contrib.MuonDimensionNumbers((2,), (3,))
  with pytest.raises(ValueError, match="not a matrix"):
    optim.muon_dims(("layers", "embed"))


MUON = {"optim.name": "muon", "optim.peak_lr": 1e-2}


def test_muon_on_a_222_mesh_equals_one_device_over_5_steps():
  """fsdp_tp on (data 2, fsdp 2, tensor 2): the Muon momentum shards like its parameter, and 5 steps give
  the one-device losses (rtol 1e-5: the sharded Newton-Schulz sums in another order)."""
  one, _ = direct_losses(tiny_config(steps=5, **MUON, **{"mesh.num_devices": 1}), 5)
  cfg = tiny_config(steps=5, **MUON, **MESH_222, **{"mesh.rules": "fsdp_tp"})
  _, mesh, _, _, abstract, _, _, _ = build(cfg)
  inner = abstract.opt_state[1].inner_states   # chain(clip, partition): the partition's two parts
  mu = inner["muon"].inner_state[0].mu["layers_0"]["mlp"]["wi"]
  assert _spec(mu) == _spec(abstract.params["layers_0"]["mlp"]["wi"]) == ("fsdp", "tensor")
  nu = inner["adam"].inner_state[0].nu["embed"]
  assert _spec(nu) == _spec(abstract.params["embed"]) == ("tensor", "fsdp")
  sharded, _ = direct_losses(cfg, 5)
  np.testing.assert_allclose(sharded, one, rtol=1e-5)
  assert one[-1] < one[0]


@pytest.mark.slow
def test_muon_kill_9_and_resume_is_bitwise(tmp_path):
  flags = ["--config.optim.name=muon", "--config.optim.peak_lr=0.01", "--config.train.steps=16",
           "--config.train.ckpt_every=4", "--config.train.eval_every=16"]
  ref = run(train_cmd(tmp_path / "ref", *flags))
  assert ref.returncode == 0, ref.stderr[-3000:]
  crash = tmp_path / "crash"
  proc = subprocess.Popen(train_cmd(crash, *flags), env=env(), stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
  _wait_for_step(crash, 9, proc)   # past two saves (4, 8): the first is finished
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  resumed = run(train_cmd(crash, *flags))
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "resumed from step" in resumed.stderr
  from tformer_jax.checkpoint import restore_params
  for a, b in zip(jax.tree.leaves(restore_params(tmp_path / "ref")[1]), jax.tree.leaves(restore_params(crash)[1])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  losses = lambda d: {r["step"]: r["loss"] for r in read_metrics(d) if "loss" in r}  # noqa: E731
  l_ref, l_res = losses(tmp_path / "ref"), losses(crash)
  assert sorted(l_res) == list(range(1, 17))
  assert all(l_ref[s] == l_res[s] for s in range(9, 17))
