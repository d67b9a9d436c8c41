"""Context parallelism (a 'context' mesh axis splits each sequence) on the 8 fake CPU devices.

Invariants: a model's logits and parameter gradients on meshes (data=2, context=4) and (context=8),
strategies 'all_gather' and 'ring', equal one device's within 1e-5 (float32; GQA, RoPE at global
positions, a sliding window, packed documents); 30 training steps through the real CLI equal the
single-device losses within 1e-4; a long forward takes less memory per device on (context=8) than
on one device (XLA's compiled memory analysis); an unused mesh axis is a one-line ConfigError.
"""
import json
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from jax.sharding import AxisType

from tformer_jax import backends
from tformer_jax.config import ConfigError, ModelConfig
from tformer_jax.nn.transformer import Transformer
from tformer_jax.parallel import mesh as mesh_lib, rules as rules_lib

from train_utils import REPO, env, run, tiny_config

TOL = dict(atol=1e-5, rtol=1e-5)
CFG = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, max_len=64,
                  position="rope", norm="rmsnorm", activation="swiglu", window=24)


def _mesh(shape, axes):
  return jax.make_mesh(shape, axes, axis_types=(AxisType.Auto,) * len(axes))


def _batch():
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 65), 0, 64)
  seg = jnp.asarray(np.stack([np.repeat([1, 2, 3], [20, 30, 14]), np.repeat([1, 2], [40, 24])]), jnp.int32)
  pos = jnp.asarray(np.concatenate([np.arange(20), np.arange(30), np.arange(14)]))[None].repeat(2, 0)
  return tokens, seg, pos


def _logits_and_grads(backend, mesh=None):
  model = Transformer(CFG)
  tokens, seg, pos = _batch()
  params = model.init(jax.random.PRNGKey(0), tokens[:, :-1])["params"]

  def loss_fn(p):
    logits = model.apply({"params": p}, tokens[:, :-1], segment_ids_BxL=seg, positions_BxL=pos)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean(), logits

  fn = jax.value_and_grad(loss_fn, has_aux=True)
  with backends.use(backend):
    if mesh is None:
      return jax.jit(fn)(params)
    rules = rules_lib.get_rules("dp", mesh.axis_names)
    with jax.set_mesh(mesh):
      return jax.jit(mesh_lib.traced_under(fn, mesh, rules))(params)


@pytest.fixture(scope="module")
def one_device():
  return _logits_and_grads(backends.Backend(attention_impl="blockwise", block_q=8, block_k=8))


@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
@pytest.mark.parametrize("shape,axes", [((2, 4), ("data", "context")), ((8,), ("context",))],
                         ids=["data2_context4", "context8"])
def test_context_parallel_matches_one_device(one_device, strategy, shape, axes):
  backend = backends.Backend(attention_impl="blockwise", block_q=8, block_k=8, context_strategy=strategy)
  (loss, logits), grads = _logits_and_grads(backend, _mesh(shape, axes))
  (ref_loss, ref_logits), ref_grads = one_device
  np.testing.assert_allclose(logits, ref_logits, **TOL)
  np.testing.assert_allclose(loss, ref_loss, **TOL)
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(g, r, **TOL)


def test_long_forward_takes_less_memory_per_device_on_a_context_axis():
  l = 32768
  cfg = ModelConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=2, num_kv_heads=1, max_len=l,
                    position="rope", norm="rmsnorm")
  model = Transformer(cfg)
  params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 128), jnp.int32)))["params"]
  tokens = jax.ShapeDtypeStruct((1, l), jnp.int32)
  fwd = lambda p, t: model.apply({"params": p}, t)  # noqa: E731
  backend = backends.Backend(attention_impl="blockwise", block_q=512, block_k=512)

  def peak(mesh):
    with backends.use(backend):
      if mesh is None:
        c = jax.jit(fwd).lower(params, tokens).compile()
      else:
        rules = rules_lib.get_rules("dp", mesh.axis_names)
        with jax.set_mesh(mesh):
          c = jax.jit(mesh_lib.traced_under(fwd, mesh, rules)).lower(params, tokens).compile()
    m = c.memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes

  one, eight = peak(None), peak(_mesh((8,), ("context",)))
  assert eight < one / 4, (one, eight)   # logits (the largest buffer) and activations are split 8 ways


def test_mesh_axis_no_rule_uses_is_a_one_line_error():
  cfg = tiny_config(steps=1, **{"mesh.axes": ("data", "context"), "mesh.shape": (2, 4)})
  cfg.mesh = ml_collections.ConfigDict(dict(cfg.mesh) | {"rules": (("batch", "data"),)})  # no 'length' rule
  with pytest.raises(ConfigError, match="axis 'context' \\(size 4\\) is used by no rule") as e:
    mesh_lib.check_layout(cfg, mesh_lib.make_mesh(cfg.mesh))
  assert "\n" not in str(e.value)
  ok = tiny_config(steps=1, **{"mesh.axes": ("data", "context"), "mesh.shape": (2, 4)})
  mesh_lib.check_layout(ok, mesh_lib.make_mesh(ok.mesh))   # the presets map 'length' to 'context'


def _cli_losses(workdir, *flags):
  cmd = [sys.executable, str(REPO / "scripts" / "train.py"), f"--config={REPO / 'configs' / 'llama_tiny.py'}",
         f"--workdir={workdir}", "--config.train.steps=30", "--config.data.seq_len=64",
         "--config.data.batch_size=4", "--config.model.d_model=64", "--config.model.num_layers=2",
         "--config.model.max_len=64", "--config.train.log_every=1", "--config.train.eval_every=30",
         "--config.train.eval_batches=1", "--config.train.sample_tokens=0", "--config.train.loggers=jsonl",
         "--config.optim.warmup_steps=5", "--config.runtime.attention=blockwise",
         "--config.runtime.attention_block_q=16",
         "--config.runtime.attention_block_k=16", *flags]
  e = env()
  e["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  r = run(cmd, timeout=600, env=e)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
  return {row["step"]: row["loss"] for row in rows if "loss" in row}


@pytest.mark.slow
def test_thirty_cli_steps_on_a_context_mesh_match_one_device(tmp_path):
  one = _cli_losses(tmp_path / "one", "--config.mesh.num_devices=1")
  ring = _cli_losses(tmp_path / "ring", "--config.mesh.axes=('data','context')", "--config.mesh.shape=(2,4)",
                     "--config.mesh.context_strategy=ring")
  assert sorted(one) == sorted(ring) == list(range(1, 31))
  np.testing.assert_allclose([ring[s] for s in one], [one[s] for s in one], atol=1e-4, rtol=0)


def test_decoding_ignores_the_context_axis():
  """A KV-cache step (one query at a traced offset) takes the ordinary path under a context mesh."""
  mesh = _mesh((8,), ("context",))
  q = jnp.ones((1, 1, 4, 8))
  kv = jnp.ones((1, 16, 2, 8))
  from tformer_jax.ops.masks import Visibility
  vis = Visibility(q_offset=jnp.int32(5))
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules_lib.get_rules("dp", mesh.axis_names)):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      out = backends.Backend(attention_impl="blockwise").attention(q, kv, kv, vis)[0]
  np.testing.assert_allclose(out, jnp.ones((1, 1, 4, 8)), **TOL)
