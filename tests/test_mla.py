"""Multi-head Latent Attention (DeepSeek-V2 section 2.1; ops/mla.py, nn/mla.py).

The absorbed latent form against the materialised one and a float64 hand computation; the layer against
the direct formula on the reference, chunked and blockwise paths (V narrower and wider than q/k: the
zero-padding both ways), forward and backward; decode (latent cache, absorbed) == the full forward over
chunks, with int8 latents, and greedy generation with left padding; the cache's bytes per token; a tiny
DeepSeek-V3 of transformers (YaRN with mscale_all_dim, interleaved RoPE, q bottleneck) gives our logits;
config refusals in one line; 8 fake devices == 1 over 5 steps."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_modern_attention import assert_greedy_is_each_rows_full_forward
from test_parallel import direct_losses

from tformer_jax import backends, decode
from tformer_jax.config import ConfigError, ModelConfig, default_config
from tformer_jax.config.model_rules import validate_model
from tformer_jax.config.schema import MLAConfig, RopeScaling
from tformer_jax.nn import Transformer
from tformer_jax.nn.mla import MLAttention
from tformer_jax.ops import masks, mla as mla_ops
from tformer_jax.train import optim

from train_utils import tiny_config

BASE = dict(vocab_size=61, d_model=32, num_layers=2, num_heads=4, position="rope", norm="rmsnorm", max_len=64,
            activation="swiglu", rope_layout="interleaved", tie_embeddings=False)
MLA = dict(kv_lora_rank=16, q_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)


def _perturbed(params, seed=5):
  """Every parameter moved off its init (unit norm scales hide mistakes)."""
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  return jax.tree.unflatten(tree, [x + 0.3 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


def _model(mla=None, **kw):
  cfg = ModelConfig(**{**BASE, **kw}, mla=MLAConfig(**{**MLA, **(mla or {})}))
  validate_model(cfg)
  return Transformer(cfg)


def _latents(b=2, l=7, s=11, h=3, n=5, dr=4, r=9, v=6, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 5)
  return (jax.random.normal(ks[0], (b, l, h, n)), jax.random.normal(ks[1], (b, l, h, dr)),
          jax.random.normal(ks[2], (b, s, r)), jax.random.normal(ks[3], (b, s, dr)),
          0.5 * jax.random.normal(ks[4], (r, h, n + v)))


def test_absorbed_equals_materialised_and_the_formula_by_hand():
  """Queries 4..10 of 11 keys with the first 2 keys of row 0 padding: the latent (absorbed) form, the
  materialised form and a float64 loop over heads agree."""
  q_n, q_r, c, kr, wkv_b = _latents()
  valid = jnp.ones((2, 11), bool).at[0, :2].set(False)
  mask = masks.Visibility(causal=True, q_offset=4, kv_valid_BxS=valid).mask(7, 11)
  got = {f.__name__: np.asarray(f(q_n, q_r, c, kr, wkv_b, mask=mask, scale=0.3))
         for f in (mla_ops.attention_absorbed, mla_ops.attention_materialised)}
  np.testing.assert_allclose(got["attention_absorbed"], got["attention_materialised"], atol=2e-5)
  qn, qr, cc, kk, w = (np.asarray(x, np.float64) for x in (q_n, q_r, c, kr, wkv_b))
  m = np.asarray(mask)
  for b in range(2):
    for h in range(3):
      k_nope, val = cc[b] @ w[:, h, :5], cc[b] @ w[:, h, 5:]            # (S, N), (S, V)
      s = 0.3 * (qn[b, :, h] @ k_nope.T + qr[b, :, h] @ kk[b].T)
      s = np.where(m[b, 0], s, -np.inf)
      p = np.exp(s - s.max(-1, keepdims=True))
      np.testing.assert_allclose(got["attention_absorbed"][b, :, h], (p / p.sum(-1, keepdims=True)) @ val, atol=2e-5)


def test_softmax_scale_is_transformers_yarn_mscale():
  from transformers.modeling_rope_utils import yarn_apply_mscale
  for rope, mscale_all_dim in (({"rope_type": "yarn", "factor": 40.0, "mscale_all_dim": 1.0}, 1.0),
                               ({"rope_type": "yarn", "factor": 4.0, "mscale_all_dim": 0.707}, 0.707),
                               ({"rope_type": "default"}, 0.0)):
    want = yarn_apply_mscale(rope, 192 ** -0.5)
    got = mla_ops.softmax_scale(192, 0.0, "yarn" if rope["rope_type"] == "yarn" else "none", rope.get("factor", 1.0),
                                mscale_all_dim)
    assert got == pytest.approx(want, rel=1e-12)


def _rope_interleaved(x, pos, dr, theta=10000.0):
  """float64 RoPE on consecutive pairs (2i, 2i+1) of the last dr dims."""
  inv = 1.0 / theta ** (np.arange(0, dr, 2) / dr)
  ang = pos[:, None] * inv[None]
  cos, sin = np.cos(ang), np.sin(ang)
  x1, x2 = x[..., 0::2], x[..., 1::2]
  cos, sin = (a.reshape(a.shape[0], *([1] * (x.ndim - 2)), a.shape[1]) for a in (cos, sin))
  out = np.empty_like(x)
  out[..., 0::2], out[..., 1::2] = x1 * cos - x2 * sin, x2 * cos + x1 * sin
  return out


def _layer_by_hand(p, x, cfg):
  """The MLA sublayer in float64 numpy from its parameters (one row, causal)."""
  a, eps = cfg.mla, cfg.norm_eps
  n, dr, r = a.qk_nope_head_dim, a.qk_rope_head_dim, a.kv_lora_rank
  rms = lambda t, w: t / np.sqrt(np.mean(t * t, -1, keepdims=True) + eps) * w   # noqa: E731
  f = {"/".join(str(e.key) for e in path): np.asarray(v, np.float64)
       for path, v in jax.tree_util.tree_flatten_with_path(p)[0]}
  if a.q_lora_rank:
    q = np.einsum("lr,rhe->lhe", rms(x @ f["wq_a"], f["q_a_norm/scale"]), f["wq_b"])
  else:
    q = np.einsum("ld,dhe->lhe", x, f["wq"])
  ckv = x @ f["wkv_a"]
  c, kr = rms(ckv[:, :r], f["kv_a_norm/scale"]), ckv[:, r:]
  pos = np.arange(x.shape[0], dtype=np.float64)
  q_n, q_r = q[..., :n], _rope_interleaved(q[..., n:], pos, dr)
  kr = _rope_interleaved(kr, pos, dr)
  out = []
  for h in range(cfg.num_heads):
    k_n, v = c @ f["wkv_b"][:, h, :n], c @ f["wkv_b"][:, h, n:]
    s = (q_n[:, h] @ k_n.T + q_r[:, h] @ kr.T) / np.sqrt(n + dr)
    s = np.where(np.tril(np.ones_like(s, bool)), s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    out.append((w / w.sum(-1, keepdims=True)) @ v)
  return np.einsum("lhv,hvd->ld", np.stack(out, 1), f["wo"])


@pytest.mark.parametrize("mla", [dict(), dict(q_lora_rank=0, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=10)],
                         ids=["v_narrower", "v_wider_no_q_lora"])
def test_layer_equals_the_formula_on_every_attention_path(mla):
  """The sublayer alone: reference, chunked and blockwise (tiles of 8 over 19 tokens) equal the float64 formula;
  their gradients (input and every parameter) equal the reference's."""
  cfg = _model(mla).cfg
  layer = MLAttention(cfg)
  x = jax.random.normal(jax.random.PRNGKey(3), (1, 19, 32))
  pos = jnp.arange(19)[None]
  params = _perturbed(nn.unbox(layer.init(jax.random.PRNGKey(0), x, pos, None)["params"]))
  want = _layer_by_hand(params, np.asarray(x[0], np.float64), cfg)
  w = jax.random.normal(jax.random.PRNGKey(4), x.shape)
  grads = {}
  for impl in ("reference", "chunked", "blockwise"):
    with backends.use(backends.Backend(attention_impl=impl, block_q=8, block_k=8)):
      f = jax.jit(jax.value_and_grad(lambda p, x: jnp.sum(layer.apply({"params": p}, x, pos, None) * w), (0, 1)))
      y = jax.jit(lambda p, x: layer.apply({"params": p}, x, pos, None))(params, x)
      grads[impl] = f(params, x)
    np.testing.assert_allclose(np.asarray(y[0]), want, atol=2e-4, rtol=1e-4, err_msg=impl)
  ref = jax.tree.leaves(grads.pop("reference"))
  for impl, got in grads.items():
    for g, r in zip(jax.tree.leaves(got), ref):
      np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=1e-4, rtol=1e-4, err_msg=impl)


@pytest.mark.parametrize("cache_dtype", ["", "int8"])
def test_decode_equals_the_full_forward(cache_dtype):
  """Prefill 7 tokens, then chunks of 3 and single tokens into the latent cache (attended absorbed), unrolled
  and scanned: the logits of the full forward (materialised K/V), within 2e-5; int8 latents (unrolled):
  within 3% of the logits' norm (the quantisation)."""
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 20), 0, 61)
  for scan in (False, True) if not cache_dtype else (False,):
    model = _model(scan_layers=scan).clone(cache_dtype=cache_dtype)
    params = _perturbed(nn.unbox(model.init(jax.random.PRNGKey(0), tokens[:, :4])["params"]))
    full = jax.jit(model.apply)({"params": params}, tokens)
    step = jax.jit(lambda c, t, m=model, p=params: m.apply({"params": p, "cache": c}, t, decode=True,
                                                           mutable=["cache"]))
    cache, outs = decode.init_cache(model, params, 2, 32), []
    for a, b in [(0, 7), (7, 10), (10, 13), (13, 14), (14, 15), (15, 18), (18, 20)]:
      logits, upd = step(cache, tokens[:, a:b])
      outs.append(logits)
      cache = upd["cache"]
    layer = cache["layers"]["attn"] if scan else cache["layers_0"]["attn"]
    assert set(layer) == ({"c", "kr"} | ({"c_scale", "kr_scale"} if cache_dtype else set()))
    got, full = np.asarray(jnp.concatenate(outs, 1)), np.asarray(full)
    if cache_dtype == "int8":
      assert np.linalg.norm(got - full) < 0.03 * np.linalg.norm(full), (scan, np.linalg.norm(got - full))
    else:
      np.testing.assert_allclose(got, full, atol=2e-5, rtol=2e-5, err_msg=f"scan={scan}")


def test_generation_with_left_padding_equals_the_full_forward():
  """Greedy generation of left-padded prompts: each row's tokens are the argmax of that row's full forward."""
  model = _model()
  params = _perturbed(nn.unbox(model.init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))["params"]))
  prompts, n = [[5, 9, 2, 33, 7, 1, 8, 12, 40], [3, 4]], 10
  assert_greedy_is_each_rows_full_forward(model, params, prompts, n)


def test_cache_holds_the_latent_and_the_rope_key_per_token_and_layer():
  """(kv_lora_rank + qk_rope_head_dim) values a token and layer, plus the model's validity byte: 2 x 20 x 4 + 1
  = 161 bytes a token in float32, 2 x (20 + 2 x 2) + 1 = 49 in int8 (a bfloat16 scale for each of the two);
  a GQA model with 2 KV heads of 5 dims (2 x 2 x 5 = 20 values) holds as much."""
  model = _model()
  s1, s2 = 64, 256
  per_token = lambda m: (decode.cache_bytes(m, 1, s2) - decode.cache_bytes(m, 1, s1)) / (s2 - s1)  # noqa: E731
  assert per_token(model) == mla_ops.cache_bytes_per_token(2, 16, 4, 4) + 1 == 161
  assert per_token(model.clone(cache_dtype="int8")) == mla_ops.cache_bytes_per_token(2, 16, 4, 1, 2) + 1 == 49
  assert decode.cache_bytes(model, 1, s1) == s1 * 161 + 4                         # + the int32 index
  gqa = Transformer(ModelConfig(**{**BASE, "num_kv_heads": 2, "head_dim": 5}))
  assert mla_ops.gqa_equal_cache_heads(16, 4, 5) == 2.0
  assert per_token(gqa) == per_token(model)


def test_transformers_deepseek_v3_gives_our_logits():
  """A tiny transformers DeepSeek-V3 (dense layers, q bottleneck, YaRN with mscale_all_dim, interleaved RoPE),
  every weight perturbed, its weights mapped onto ours by name: logits within 1e-4 at float32."""
  import torch
  from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
  torch.manual_seed(0)
  hf_cfg = DeepseekV3Config(
      vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
      num_key_value_heads=4, q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
      first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
      max_position_embeddings=64, rms_norm_eps=1e-6, rope_interleave=True, tie_word_embeddings=False,
      rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                       "original_max_position_embeddings": 16, "mscale_all_dim": 1.0, "beta_fast": 32.0,
                       "beta_slow": 1.0})
  hf = DeepseekV3ForCausalLM(hf_cfg).eval()
  with torch.no_grad():
    for p in hf.parameters():
      p.add_(0.1 * torch.randn_like(p))
  sd = {k: v.detach().double().numpy() for k, v in hf.state_dict().items()}
  model = _model(dict(mscale_all_dim=1.0), d_ff=48, norm_eps=1e-6,
                 rope_scaling=RopeScaling(type="yarn", factor=4.0, original_max_len=16, attention_factor=1.0))
  h, a = 4, model.cfg.mla
  params = {"embed": sd["model.embed_tokens.weight"], "head": sd["lm_head.weight"].T,
            "final_norm": {"scale": sd["model.norm.weight"]}}
  for i in range(2):
    g = lambda name, i=i: sd[f"model.layers.{i}.{name}"]   # noqa: E731
    params[f"layers_{i}"] = {
        "ln1": {"scale": g("input_layernorm.weight")}, "ln2": {"scale": g("post_attention_layernorm.weight")},
        "mlp": {"wg": g("mlp.gate_proj.weight").T, "wi": g("mlp.up_proj.weight").T, "wo": g("mlp.down_proj.weight").T},
        "attn": {"wq_a": g("self_attn.q_a_proj.weight").T, "q_a_norm": {"scale": g("self_attn.q_a_layernorm.weight")},
                 "wq_b": g("self_attn.q_b_proj.weight").T.reshape(a.q_lora_rank, h, -1),
                 "wkv_a": g("self_attn.kv_a_proj_with_mqa.weight").T,
                 "kv_a_norm": {"scale": g("self_attn.kv_a_layernorm.weight")},
                 "wkv_b": g("self_attn.kv_b_proj.weight").T.reshape(a.kv_lora_rank, h, -1),
                 "wo": g("self_attn.o_proj.weight").T.reshape(h, a.v_head_dim, -1)}}
  params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
  ours = nn.unbox(model.init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))["params"])
  assert jax.tree.map(jnp.shape, params) == jax.tree.map(jnp.shape, ours)
  tokens = np.random.default_rng(0).integers(0, 61, (2, 40))
  with torch.no_grad():
    want = hf(torch.tensor(tokens)).logits.numpy()
  got = np.asarray(jax.jit(model.apply)({"params": params}, jnp.asarray(tokens)))
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_every_mla_and_mtp_parameter_has_a_role_and_muon_reads_the_latents():
  """Weight decay by role (strict: a name outside the tables fails), and Muon orthogonalises the latent
  up-projections and the MTP projection with their input (latent, [embedding ; hidden]) as the reduction."""
  boxed = _model(mtp_depth=1).init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))["params"]
  for path, x in jax.tree_util.tree_flatten_with_path(nn.unbox(boxed))[0]:
    optim.param_role(path, x, strict=True)
  axes = optim.logical_axes(boxed)
  for name, reduction, output in (("layers_0/attn/wq_b", (0,), (1, 2)), ("layers_0/attn/wkv_b", (0,), (1, 2)),
                                  ("layers_0/attn/wkv_a", (0,), (1,)), ("mtp_0/eh_proj", (0,), (1,))):
    dims = optim.muon_dims(axes[name])
    assert (tuple(dims.reduction_axis), tuple(dims.output_axis)) == (reduction, output), name
  labels = optim.muon_labels(nn.unbox(boxed), axes)
  assert {labels["layers_0"]["attn"][k] for k in ("wq_a", "wq_b", "wkv_a", "wkv_b", "wo")} == {"muon"}


@pytest.mark.parametrize("field,value,needle", [
    ("mla.v_head_dim", 0, "needs it > 0"), ("mla.qk_rope_head_dim", 3, "must be even"),
    ("num_kv_heads", 2, "leave it 0"), ("position", "alibi", "needs position='rope'"),
    ("window", 8, "no sliding window"), ("qk_norm", "head", "without QK-norm"),
    ("mla.mscale_all_dim", 1.0, "set model.rope_scaling"), ("mla.kv_lora_rank", -1, "must be >= 0"),
])
def test_bad_fields_get_one_line_naming_them(field, value, needle):
  c = default_config()
  c.model.vocab_size, c.model.position, c.model.d_model = 256, "rope", 64
  c.model.mla.update(MLA)
  node = c.model.mla if field.startswith("mla.") else c.model
  node[field.split(".")[-1]] = value
  with pytest.raises(ConfigError, match=needle) as e:
    validate_model(ModelConfig.from_config(c.model))
  assert "\n" not in str(e.value) and f"model.{field}" in str(e.value)


def test_mla_sizes_without_a_latent_are_refused():
  c = default_config()
  c.model.vocab_size, c.model.mla.v_head_dim = 256, 16
  with pytest.raises(ConfigError, match="model.mla.v_head_dim: is an MLA size: set model.mla.kv_lora_rank"):
    validate_model(ModelConfig.from_config(c.model))


def test_eight_devices_equal_one_device_over_five_steps():
  """A DeepSeek-shaped tiny MLA model (q bottleneck, interleaved RoPE): losses on a (2, 2, 2) data x fsdp x
  tensor mesh under fsdp_tp equal one device's."""
  model = {"model.mla.kv_lora_rank": 32, "model.mla.q_lora_rank": 24, "model.mla.qk_nope_head_dim": 16,
           "model.mla.qk_rope_head_dim": 8, "model.mla.v_head_dim": 12, "model.rope_layout": "interleaved",
           "model.activation": "swiglu"}
  one, _ = direct_losses(tiny_config(steps=5, **model, **{"mesh.num_devices": 1}), 5)
  eight, _ = direct_losses(tiny_config(steps=5, **model, **{"mesh.shape": (2, 2, 2), "mesh.rules": "fsdp_tp"}), 5)
  np.testing.assert_allclose(eight, one, rtol=2e-5)
  assert one[-1] < one[0]


def test_training_attention_runs_the_kernel_not_the_dense_path():
  """A forward without a cache hands the backend a static zero query offset, so the kernels serve it: under
  splash (Pallas interpret mode on CPU) the traced forward holds the kernel's pallas_call and the logits equal
  the reference backend's (1e-5). A traced offset once sent every MLA training call to the dense reference."""
  model = _model()
  tokens = jax.random.randint(jax.random.PRNGKey(3), (1, 128), 0, BASE["vocab_size"])
  params = _perturbed(nn.unbox(model.init(jax.random.PRNGKey(0), tokens[:, :8])["params"]))
  forward = lambda t: model.apply({"params": params}, t)  # noqa: E731
  with backends.use(backends.Backend(attention_impl="splash", splash_block_q=128, splash_block_kv=128)):
    assert "pallas_call" in str(jax.make_jaxpr(forward)(tokens))
    got = jax.jit(forward)(tokens)
  np.testing.assert_allclose(np.asarray(got), np.asarray(jax.jit(forward)(tokens)), atol=1e-5)
