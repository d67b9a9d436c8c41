"""Context parallelism (a 'context' mesh axis splits each sequence) on the 8 fake CPU devices.

Invariants: a model's logits (back in natural order) and parameter gradients on meshes (data=2,
context=4) and (context=8), strategies 'all_gather' (the sequence striped for load balance by the
step's `context_layout`, and contiguous) and 'ring', equal one device's within 1e-5 (float32; GQA,
RoPE at global positions, a sliding window, packed documents); splash on a striped context axis equals
the reference; 30 training steps through the real CLI (striped) equal the single-device losses within
1e-4; striping gives every shard the same visible causal tiles; a long forward takes less memory per
device on (context=8) than on one device (XLA's compiled memory analysis); an unused mesh axis is a
one-line ConfigError.
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
from tformer_jax.backends import splash as splash_lib
from tformer_jax.config import ConfigError, ModelConfig, validate
from tformer_jax.nn.transformer import Transformer
from tformer_jax.ops import context_parallel as cp_ops
from tformer_jax.ops.masks import Visibility
from tformer_jax.parallel import mesh as mesh_lib, rules as rules_lib
from tformer_jax.train import step as step_lib

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
  """Loss, logits (in natural order) and gradients of CFG on _batch(), the batch laid out as the
  train step lays it out (`step.context_layout`: striped over the context shards when it balances),
  and the number of context shards it was striped over (1: not striped)."""
  model = Transformer(CFG)
  tokens, seg, pos = _batch()
  params = model.init(jax.random.PRNGKey(0), tokens[:, :-1])["params"]
  stripes = []

  def loss_fn(p):
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": seg, "positions": pos}
    with step_lib.context_layout(model, batch) as b:
      stripes.append(backends.current().context_stripes)
      logits = model.apply({"params": p}, b["inputs"], segment_ids_BxL=b["segment_ids"], positions_BxL=b["positions"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, b["targets"]).mean()
    n = stripes[-1]
    return loss, cp_ops.unstripe(logits, n) if n > 1 else logits

  fn = jax.value_and_grad(loss_fn, has_aux=True)
  with backends.use(backend):
    if mesh is None:
      return jax.jit(fn)(params), max(1, stripes[-1])
    rules = rules_lib.get_rules("dp", mesh.axis_names)
    with jax.set_mesh(mesh):
      return jax.jit(mesh_lib.traced_under(fn, mesh, rules))(params), max(1, stripes[-1])


@pytest.fixture(scope="module")
def one_device():
  return _logits_and_grads(backends.Backend(attention_impl="blockwise", block_q=8, block_k=8))[0]


D2C4, C8 = ((2, 4), ("data", "context")), ((8,), ("context",))


@pytest.mark.parametrize("strategy,balance,mesh,stripes", [
    ("all_gather", True, D2C4, 4), ("all_gather", True, C8, 8), ("all_gather", False, C8, 1),
    ("ring", True, D2C4, 1), ("ring", True, C8, 1)],
    ids=["data2_context4-all_gather-striped", "context8-all_gather-striped", "context8-all_gather-contiguous",
         "data2_context4-ring", "context8-ring"])
def test_context_parallel_matches_one_device(one_device, strategy, balance, mesh, stripes):
  backend = backends.Backend(attention_impl="blockwise", block_q=8, block_k=8, context_strategy=strategy,
                             context_load_balance=balance)
  ((loss, logits), grads), used = _logits_and_grads(backend, _mesh(*mesh))
  assert used == stripes   # the layout the step chose: striped for all_gather, contiguous for ring
  (ref_loss, ref_logits), ref_grads = one_device
  np.testing.assert_allclose(logits, ref_logits, **TOL)
  np.testing.assert_allclose(loss, ref_loss, **TOL)
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(g, r, **TOL)


def test_stripe_layout_gives_every_shard_chunks_i_and_2n_minus_1_minus_i():
  pos = cp_ops.stripe_positions(16, 4)   # 8 chunks of 2
  np.testing.assert_array_equal(pos.reshape(4, 4), [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]])
  x = jnp.arange(2 * 16 * 3).reshape(2, 16, 3)
  np.testing.assert_array_equal(cp_ops.stripe(x, 4)[:, :, 0], x[:, pos, 0])
  np.testing.assert_array_equal(cp_ops.unstripe(cp_ops.stripe(x, 4), 4), x)
  batch = cp_ops.stripe_batch({"inputs": x[..., 0], "loss_mask": x[..., 1] * 1.0}, 4)
  np.testing.assert_array_equal(batch["positions"], np.broadcast_to(pos, (2, 16)))
  np.testing.assert_array_equal(batch["loss_mask"], x[:, pos, 1])


def _visible_tiles_per_shard(rows, n, s, block):
  """Per context shard: the (block x block) tiles of a causal mask with rows at global positions
  `rows` that hold a visible key (what the splash kernel computes; the others it skips)."""
  mask = splash_lib.BandMask((len(rows), s), None, 0, rows)
  per = len(rows) // n
  return [sum(bool(mask[slice(q, q + block), slice(k, k + block)].any())
              for q in range(i * per, (i + 1) * per, block) for k in range(0, s, block)) for i in range(n)]


def test_striping_evens_the_causal_work_per_shard():
  l, n, block = 4096, 8, 128
  contiguous = _visible_tiles_per_shard(np.arange(l), n, l, block)
  striped = _visible_tiles_per_shard(cp_ops.stripe_positions(l, n), n, l, block)
  assert sum(contiguous) == sum(striped)   # the same tiles in all, dealt out differently
  assert max(contiguous) / min(contiguous) > 10 and max(striped) == min(striped), (contiguous, striped)


def test_splash_on_a_striped_context_axis_matches_the_reference():
  """The splash kernel (interpret mode) with its query tiles sharded over context=4 and the sequence
  striped (mask rows at their striped positions, K/V back in natural order per shard): output and
  q/k/v gradients equal the dense reference on the natural order (GQA, window, packed documents)."""
  b, l, h, kh, d, n = 2, 1024, 4, 2, 8, 4
  ks = jax.random.split(jax.random.PRNGKey(3), 4)
  q, ct = (jax.random.normal(k_, (b, l, h, d)) for k_ in ks[:2])
  k, v = (jax.random.normal(k_, (b, l, kh, d)) for k_ in ks[2:])
  seg = jnp.asarray(np.stack([np.repeat([1, 2, 3], [300, 500, 224]), np.repeat([1, 2], [700, 324])]), jnp.int32)
  mesh = _mesh((2, 4), ("data", "context"))
  splash = backends.Backend(attention_impl="splash", splash_block_q=128, splash_block_kv=128, context_stripes=n)

  def run(backend, q, k, v, seg, striped):
    vis = Visibility(causal=True, window=300, q_segment_ids_BxL=seg, kv_segment_ids_BxS=seg)
    out = lambda q, k, v: backend.attention(q, k, v, vis)[0]  # noqa: E731
    f = lambda q, k, v: jnp.sum(out(q, k, v) * (cp_ops.stripe(ct, n) if striped else ct))  # noqa: E731
    return out(q, k, v), jax.grad(f, argnums=(0, 1, 2))(q, k, v)

  rules = rules_lib.get_rules("dp", mesh.axis_names)
  with jax.set_mesh(mesh):
    fn = jax.jit(mesh_lib.traced_under(lambda *a: run(splash, *a, striped=True), mesh, rules))
    out, grads = fn(*(cp_ops.stripe(x, n) for x in (q, k, v, seg)))
  ref, ref_grads = run(backends.Backend(), q, k, v, seg, striped=False)
  np.testing.assert_allclose(cp_ops.unstripe(out, n), ref, **TOL)
  for g, r in zip(grads, ref_grads):
    np.testing.assert_allclose(cp_ops.unstripe(g, n), r, **TOL)


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
  ok.mesh = ml_collections.ConfigDict(dict(ok.mesh) | {"context_load_balance": "yes"})
  with pytest.raises(ConfigError, match="mesh.context_load_balance: expected true or false"):
    validate(ok)


STEPS = 12


def _cli_losses(workdir, *flags):
  cmd = [sys.executable, str(REPO / "scripts" / "train.py"), f"--config={REPO / 'configs' / 'llama_tiny.py'}",
         f"--workdir={workdir}", f"--config.train.steps={STEPS}", "--config.data.seq_len=64",
         "--config.data.batch_size=4", "--config.model.d_model=64", "--config.model.num_layers=2",
         "--config.model.max_len=64", "--config.train.log_every=1", f"--config.train.eval_every={STEPS}",
         "--config.train.eval_batches=1", "--config.train.sample_tokens=0", "--config.train.loggers=jsonl",
         "--config.optim.warmup_steps=5", "--config.runtime.attention=blockwise",
         "--config.runtime.attention_block_q=16",
         "--config.runtime.attention_block_k=16", *flags]
  r = run(cmd, timeout=600, env=env(devices=8))
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
  return {row["step"]: row["loss"] for row in rows if "loss" in row}


@pytest.mark.slow
def test_cli_steps_on_a_context_mesh_match_one_device(tmp_path):
  """The default context layout (all_gather, the sequence striped by the train and eval steps): 12 steps
  (5 of warmup, 7 at the peak rate, an evaluation at the end), each step's loss within 1e-4."""
  one = _cli_losses(tmp_path / "one", "--config.mesh.num_devices=1")
  striped = _cli_losses(tmp_path / "striped", "--config.mesh.axes=('data','context')", "--config.mesh.shape=(2,4)")
  assert sorted(one) == sorted(striped) == list(range(1, STEPS + 1))
  np.testing.assert_allclose([striped[s] for s in one], [one[s] for s in one], atol=1e-4, rtol=0)


def test_decoding_ignores_the_context_axis():
  """A KV-cache step (one query at a traced offset) takes the ordinary path under a context mesh."""
  mesh = _mesh((8,), ("context",))
  q = jnp.ones((1, 1, 4, 8))
  kv = jnp.ones((1, 16, 2, 8))
  vis = Visibility(q_offset=jnp.int32(5))
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules_lib.get_rules("dp", mesh.axis_names)):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      out = backends.Backend(attention_impl="blockwise").attention(q, kv, kv, vis)[0]
  np.testing.assert_allclose(out, jnp.ones((1, 1, 4, 8)), **TOL)


def test_models_that_drop_tokens_in_token_order_are_not_striped():
  """Capacity dispatch (and a bounded expert-parallel buffer) drops tokens by their order: striping
  would change which are dropped, so those MoE models keep the contiguous layout."""
  from tformer_jax.config import MoEConfig
  moe = lambda **kw: ModelConfig(moe=MoEConfig(num_experts=4, **kw))  # noqa: E731
  assert step_lib._stripable(ModelConfig()) and step_lib._stripable(moe(dispatch="dropless"))
  assert not step_lib._stripable(moe(dispatch="capacity"))
  assert not step_lib._stripable(moe(dispatch="dropless", ep_buffer_factor=1.5))
  assert not step_lib._stripable(ModelConfig(causal=False))
