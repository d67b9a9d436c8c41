"""runtime.attention='splash' (jax's Pallas TPU kernel, interpret mode on CPU) against the reference.

Tolerance: float32, outputs and q/k/v gradients within atol 1e-5 (rtol 1e-5) of the dense reference
attention under the same `Visibility`; a tiny model's training losses within 1e-5; BandMask's block
tables equal the kernel's stock masks' (exactly). Also: the 'cudnn'
argument mapping and refusals, the platform-driven choices of resolve_runtime, config refusals.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from jax.experimental.pallas.ops.tpu import splash_attention as sa
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as info
from jax.sharding import AxisType

from tformer_jax import backends, config as config_lib
from tformer_jax.backends import base as base_lib, splash as splash_lib
from tformer_jax.config import ConfigError, ModelConfig
from tformer_jax.nn.transformer import Transformer
from tformer_jax.ops.masks import Visibility
from tformer_jax.parallel import rules as rules_lib

TOL = dict(atol=1e-5, rtol=1e-5)
SPLASH = backends.Backend(attention_impl="splash", splash_block_q=128, splash_block_kv=128, splash_interpret=True)
REFERENCE = backends.Backend()


def _inputs(b, l, h, kh, d, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  q = jax.random.normal(ks[0], (b, l, h, d), jnp.float32)
  k = jax.random.normal(ks[1], (b, l, kh, d), jnp.float32)
  v = jax.random.normal(ks[2], (b, l, kh, d), jnp.float32)
  ct = jax.random.normal(ks[3], (b, l, h, d), jnp.float32)
  return q, k, v, ct


def _segments(b, l):
  """Packed documents of uneven lengths with a padded tail (segment 0) in row 0."""
  row0 = np.concatenate([np.full(100, 1), np.full(90, 2), np.full(40, 3), np.zeros(l - 230)])
  row1 = np.concatenate([np.full(60, 1), np.full(l - 60, 2)])
  return jnp.asarray(np.stack([row0, row1])[:b], jnp.int32)


def _out_and_grads(backend, vis, q, k, v, ct):
  def f(q, k, v):
    return jnp.sum(backend.attention(q, k, v, vis)[0] * ct)
  out = backend.attention(q, k, v, vis)[0]
  return out, jax.grad(f, argnums=(0, 1, 2))(q, k, v)


CASES = {  # name: (batch, heads, kv heads, Visibility kwargs)
    "causal_gqa": (1, 4, 2, dict(causal=True)),
    "window_mqa_left_padding": (2, 2, 1, dict(causal=True, window=50, padding=True)),
    "packed_documents_gqa": (2, 4, 2, dict(causal=True, segments=True)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_splash_matches_reference_outputs_and_gradients(name):
  b, h, kh, kw = CASES[name]
  l, d = 256, 16
  q, k, v, ct = _inputs(b, l, h, kh, d)
  kw = dict(kw)
  if kw.pop("segments", False):
    seg = _segments(b, l)
    kw.update(q_segment_ids_BxL=seg, kv_segment_ids_BxS=seg)
  if kw.pop("padding", False):
    kw["kv_valid_BxS"] = jnp.arange(l)[None, :] >= jnp.asarray([[37], [0]])[:b]   # row 0 left-padded
  vis = Visibility(**kw)
  out, grads = jax.jit(lambda *a: _out_and_grads(SPLASH, vis, *a))(q, k, v, ct)
  ref, ref_grads = _out_and_grads(REFERENCE, vis, q, k, v, ct)
  np.testing.assert_allclose(out, ref, **TOL)
  for g, r in zip(grads, ref_grads):
    np.testing.assert_allclose(g, r, **TOL)


def test_tiny_model_trains_with_splash_like_the_reference():
  cfg = ModelConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=2, num_kv_heads=1, max_len=128,
                    position="rope", norm="rmsnorm", activation="swiglu", window=100)
  model = Transformer(cfg)
  tokens = jax.random.randint(jax.random.PRNGKey(1), (1, 129), 0, 64)
  params = model.init(jax.random.PRNGKey(0), tokens[:, :-1])["params"]
  tx = optax.adam(1e-2)

  def losses(backend):
    def loss_fn(p):
      logits = model.apply({"params": p}, tokens[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    with backends.use(backend):
      @jax.jit
      def step(p, s):
        loss, g = jax.value_and_grad(loss_fn)(p)
        upd, s = tx.update(g, s, p)
        return optax.apply_updates(p, upd), s, loss
      p, s, out = params, tx.init(params), []
      for _ in range(3):
        p, s, loss = step(p, s)
        out.append(float(loss))
    return out

  np.testing.assert_allclose(losses(SPLASH), losses(REFERENCE), atol=1e-5, rtol=0)


def _cfg(**runtime):
  c = config_lib.default_config()
  c.model.num_heads, c.model.d_model = 4, 64
  for k, v in runtime.items():
    c.runtime[k] = v
  return c


def test_auto_picks_splash_on_tpu_and_interpret_mode_follows_the_target():
  tpu = backends.resolve_runtime(_cfg(), platform="tpu", quiet=True).backend
  assert tpu.attention_impl == "splash" and not tpu.splash_interpret and tpu.splash_block_q == 512
  cpu = backends.resolve_runtime(_cfg(attention="splash", splash_block_q=256), platform="cpu", quiet=True).backend
  assert cpu.attention_impl == "splash" and cpu.splash_interpret and cpu.splash_block_q == 256
  alibi = _cfg()
  alibi.model.position = "alibi"
  assert backends.resolve_runtime(alibi, platform="tpu", quiet=True).backend.attention_impl == "xla"


@pytest.mark.parametrize("field,value,needle", [
    ("position", "alibi", "'splash' takes no ALiBi"), ("num_global_tokens", 2, "no global tokens"),
    ("position", "t5", "no dense bias"), ("attn_dropout", 0.1, "'reference' attention only")])
def test_splash_refuses_what_the_kernel_cannot_express(field, value, needle):
  c = _cfg(attention="splash")
  c.model[field] = value
  if field == "num_global_tokens":
    c.model.window = 8
  with pytest.raises(ConfigError, match=needle) as e:
    config_lib.validate_runtime(ml_collections.ConfigDict(c.runtime), ModelConfig.from_config(c.model))
  assert "\n" not in str(e.value)


# -- cudnn: the mask mapping (checked through the 'xla' path, which takes the same arguments) -------

def test_sliding_window_reaches_dot_product_attention_as_local_window_size():
  assert base_lib.fused_mask_args(Visibility(causal=True, window=5), "cudnn") == (True, (4, 0))
  assert base_lib.fused_mask_args(Visibility(causal=False, window=5), "cudnn") == (False, (4, 4))
  assert base_lib.fused_mask_args(Visibility(causal=True), "cudnn") == (True, None)
  seg = jnp.ones((1, 16), jnp.int32)
  assert base_lib.fused_mask_args(Visibility(q_segment_ids_BxL=seg, kv_segment_ids_BxS=seg), "xla") == (False, None)
  q, k, v, _ = _inputs(2, 40, 4, 2, 16)
  for vis in (Visibility(causal=True, window=7), Visibility(causal=False, window=9)):
    got = base_lib.dense_attention(q, k, v, vis, impl="xla")[0]
    np.testing.assert_allclose(got, REFERENCE.attention(q, k, v, vis)[0], **TOL)


def test_cudnn_refuses_packed_documents_in_one_line_and_auto_falls_back():
  q, k, v, _ = _inputs(1, 32, 4, 2, 16)
  seg = jnp.asarray(np.repeat([[1, 2]], 16, axis=1), jnp.int32)
  vis = Visibility(q_segment_ids_BxL=seg, kv_segment_ids_BxS=seg)
  with pytest.raises(ValueError, match="'cudnn' cannot serve packed documents") as e:
    backends.Backend(attention_impl="cudnn").attention(q, k, v, vis)
  assert "\n" not in str(e.value)
  auto = backends.Backend(attention_impl="cudnn", cudnn_fallback="xla")
  np.testing.assert_allclose(auto.attention(q, k, v, vis)[0], REFERENCE.attention(q, k, v, vis)[0], **TOL)
  c = _cfg(attention="cudnn")
  c.data.packing = "document"
  with pytest.raises(ConfigError, match="cannot mask packed documents"):
    backends.resolve_runtime(c, platform="gpu", quiet=True)
  half = _cfg()
  half.model.dtype = "bfloat16"
  gpu = backends.resolve_runtime(half, platform="gpu", quiet=True).backend
  assert (gpu.attention_impl, gpu.cudnn_fallback) == ("cudnn", "xla")


def test_heads_split_over_the_tensor_axis_with_their_kv_heads():
  """'heads' and 'kv_heads' both map to 'tensor' under the tp presets: attention's layout splits both (a
  spec holding both would give the axis to only one of them, and the kernel would run every head on every
  device); KV heads the axis cannot split leave both whole."""
  mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), \
      nn.logical_axis_rules(rules_lib.get_rules("fsdp_tp", mesh.axis_names)):
    layout = base_lib.attention_layout()
  assert (layout.heads, layout.kv_heads) == ("tensor", "tensor")
  fitted = layout.fit(8, 256, 8, 4)
  assert (fitted.batch, fitted.heads, fitted.kv_heads) == (("data", "fsdp"), "tensor", "tensor")
  assert (layout.fit(8, 256, 8, 1).heads, layout.fit(8, 256, 8, 1).kv_heads) == (None, None)


@pytest.mark.parametrize("left,right", [(None, 0), (99, 0), (99, 99)], ids=["causal", "window", "bidirectional_window"])
def test_band_mask_gives_the_kernels_own_mask_tables(left, right):
  """BandMask answers the tiles its bounds decide without evaluating them: the kernel's block tables
  (forward and dK/dV, 4 query shards) equal those of its stock CausalMask / LocalMask."""
  l = 2048
  stock = (sa.CausalMask((l, l), shard_count=4) if left is None
           else sa.LocalMask((l, l), (left, right), 0, shard_count=4))
  band = splash_lib.BandMask((l, l), left, right, np.arange(l), shard_count=4)
  for dkv in (False, True):
    got = info._process_mask(sa.MultiHeadMask([band] * 2), (256, 512), dkv, q_seq_shards=4)[0]
    want = info._process_mask(sa.MultiHeadMask([stock] * 2), (256, 512), dkv, q_seq_shards=4)[0]
    for field in want._fields:
      a, b = getattr(got, field), getattr(want, field)
      assert (a is None) == (b is None) and (a is None or np.array_equal(np.asarray(a), np.asarray(b))), field
