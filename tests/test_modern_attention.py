"""Attention as current open models build it: soft caps, learned sinks, QK-norm, Gemma's and OLMo 2's
blocks, local/global layer patterns scanned as cycles and their ring KV cache (nn/attention.py).

Numerics against the dense reference (and a hand computation), every tiled path forward and backward,
decode == full forward past the ring's wrap-around, scanned == unrolled for a layer count that is not
a multiple of the pattern, the cache's bytes, the runtime's choice, and 8 fake devices == one device."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_parallel import direct_losses

from tformer_jax import backends, decode
from tformer_jax.config import ConfigError, ModelConfig, default_config
from tformer_jax.config.model_rules import validate_model
from tformer_jax.nn import Transformer
from tformer_jax.nn.stacking import stack_layers, unstack_layers
from tformer_jax.ops import attention as attn_ops, masks
from tformer_jax.ops.blockwise import blockwise_attention
from tformer_jax.ops.chunked_attention import chunked_attention

from train_utils import tiny_config

TOL = 2e-5


def _qkv(b=2, l=37, h=6, k=2, d=16, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  return (jax.random.normal(ks[0], (b, l, h, d)), jax.random.normal(ks[1], (b, l, k, d)),
          jax.random.normal(ks[2], (b, l, k, d)), 2.0 * jax.random.normal(ks[3], (h,)))


def test_reference_sinks_and_softcap_equal_the_formula_by_hand():
  q, k, v, sinks = _qkv(b=1, l=5, h=2, k=1, d=4)
  cap = 2.5
  out, w = attn_ops.dot_product_attention(q, k, v, mask=masks.causal_mask(5), softcap=cap, sinks_H=sinks,
                                          return_weights=True)
  qn, kn, vn, sn = (np.asarray(x, np.float64) for x in (q[0], k[0], v[0], sinks))
  for h in range(2):
    s = cap * np.tanh(qn[:, h] @ kn[:, 0].T / 2.0 / cap)           # scale 1/sqrt(4)
    s = np.where(np.tril(np.ones((5, 5), bool)), s, -np.inf)
    e = np.exp(s)
    p = e / (e.sum(-1, keepdims=True) + np.exp(sn[h]))              # the sink joins the denominator only
    np.testing.assert_allclose(np.asarray(w[0, h]), p, atol=1e-6)
    np.testing.assert_allclose(np.asarray(out[0, :, h]), p @ vn[:, 0], atol=1e-5)
  assert float(jnp.max(jnp.sum(w, -1))) < 1.0                       # rows sum to less than 1
  np.testing.assert_allclose(np.asarray(attn_ops.soft_cap(jnp.array([0.0, 1.0, 100.0]), 2.0)),
                             [0.0, 2.0 * np.tanh(0.5), 2.0 * np.tanh(50.0)], rtol=1e-6)


@pytest.mark.parametrize("window", [0, 9])
@pytest.mark.parametrize("cap,use_sinks", [(0.0, True), (3.0, False), (3.0, True)])
def test_tiled_paths_equal_the_reference_forward_and_backward(window, cap, use_sinks):
  """blockwise (online softmax: the sink starts the running max and sum) and chunked (explicit probabilities),
  outputs and the gradients of q, k, v and the sinks."""
  q, k, v, sinks = _qkv()
  sinks = sinks if use_sinks else None
  l = q.shape[1]
  mask = masks.sliding_window_mask(l, window=window) if window else masks.causal_mask(l)
  paths = {
      "reference": lambda q, k, v, s: attn_ops.dot_product_attention(q, k, v, mask=mask, softcap=cap, sinks_H=s),
      "blockwise": lambda q, k, v, s: blockwise_attention(q, k, v, window=window, block_q=8, block_k=8,
                                                          softcap=cap, sinks_H=s),
      "chunked": lambda q, k, v, s: chunked_attention(q, k, v, window=window, chunk=8, softcap=cap, sinks_H=s),
  }
  w = jax.random.normal(jax.random.PRNGKey(9), q.shape)
  argnums = (0, 1, 2, 3) if use_sinks else (0, 1, 2)
  got = {name: jax.value_and_grad(lambda *a, f=f: jnp.sum(f(*a) * w), argnums=argnums)(q, k, v, sinks)
         for name, f in paths.items()}
  ref_val, ref_grads = got.pop("reference")
  for name, (val, grads) in got.items():
    np.testing.assert_allclose(float(val), float(ref_val), rtol=1e-5, err_msg=name)
    for g, r in zip(grads, ref_grads):
      np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=5e-5, err_msg=name)


BASE = dict(vocab_size=61, d_model=40, num_layers=5, num_heads=4, num_kv_heads=2, head_dim=12, position="rope",
            norm="rmsnorm", max_len=64, activation="swiglu")
FAMILIES = {   # each a shape of a current family, on a tiny model
    "gemma3": dict(layer_pattern="LLG", window=5, local_rope_theta=1e4, rope_theta=1e6, qk_norm="head",
                   norm_position="sandwich", norm_unit_offset=True, embed_scale=True, attention_scale=0.3,
                   activation="geglu_tanh", final_logit_softcap=5.0, attn_softcap=4.0),
    "olmo2": dict(qk_norm="proj", norm_position="reordered", tie_embeddings=False),
    "gpt_oss": dict(attention_sinks=True, layer_pattern="LG", window=4),
    "mistral": dict(window=6),
}


def _perturbed(params, seed=5):
  """Every parameter moved off its init (zero biases, unit or zero norm scales and zero sinks hide mistakes)."""
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  return jax.tree.unflatten(tree, [x + 0.3 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


def _model(family, **kw):
  cfg = ModelConfig(**{**BASE, **FAMILIES[family], **kw})
  validate_model(cfg)
  return Transformer(cfg)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_decode_equals_the_full_forward_past_the_ring_wrap(family):
  """Prefill 7 tokens, then chunks of 3 into the cache: 23 tokens, several times a window of 4-6."""
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 23), 0, 61)
  for scan in (False, True):
    model = _model(family, scan_layers=scan)
    params = _perturbed(model.init(jax.random.PRNGKey(0), tokens[:, :4])["params"])
    full = jax.jit(model.apply)({"params": params}, tokens)
    step = jax.jit(lambda c, t, m=model, p=params: m.apply({"params": p, "cache": c}, t, decode=True,
                                                           mutable=["cache"]))
    cache, outs = decode.init_cache(model, params, 2, 64), []
    for a, b in [(0, 7)] + [(t, t + 3) for t in range(7, 23, 3)]:
      logits, upd = step(cache, tokens[:, a:b])
      outs.append(logits)
      cache = upd["cache"]
    np.testing.assert_allclose(np.asarray(jnp.concatenate(outs, 1)), np.asarray(full), atol=TOL * 10,
                               err_msg=f"{family} scan={scan}")


def assert_greedy_is_each_rows_full_forward(model, params, prompts: list[list[int]], n: int) -> None:
  """Greedy generation of the left-padded batch `prompts` (n tokens each, max_len 32): each row's tokens are
  the argmax of that row's full forward alone (one jitted forward over a fixed buffer, causal); test_mla.py too."""
  out = np.asarray(decode.generate(model, params, prompts, max_new_tokens=n, temperature=0.0, max_len=32))
  forward = jax.jit(lambda t: model.apply({"params": params}, t))
  for prompt, row in zip(prompts, out):
    buf = np.zeros((1, len(prompt) + n), np.int32)
    buf[0, :len(prompt)] = prompt
    for t in range(len(prompt), len(prompt) + n):
      buf[0, t] = int(jnp.argmax(forward(jnp.asarray(buf))[0, t - 1]))
    assert list(row) == list(buf[0, len(prompt):])


def test_generation_with_left_padding_and_a_ring_equals_the_full_forward():
  """Greedy generation of a batch with left-padded prompts on a ring-cached model: each row's tokens are the
  argmax of the full forward of that row alone."""
  model = _model("gemma3")
  params = _perturbed(nn.unbox(model.init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))["params"]))
  prompts, n = [[5, 9, 2, 33, 7, 1, 8, 12, 40], [3, 4]], 12
  assert_greedy_is_each_rows_full_forward(model, params, prompts, n)


def test_scanned_cycles_equal_unrolled_layers_for_a_count_off_the_pattern():
  """5 layers of pattern 'LLG' scan one whole cycle ('layers/block_0..2') and run layers 3 and 4 after it;
  the unrolled model with the same weights gives the same logits and gradients."""
  tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 19), 0, 61)
  unrolled, scanned = _model("gemma3"), _model("gemma3", scan_layers=True)
  params = _perturbed(nn.unbox(unrolled.init(jax.random.PRNGKey(0), tokens)["params"]))
  stacked = stack_layers(params, 5, cycle=3)
  assert sorted(stacked["layers"]) == ["block_0", "block_1", "block_2"] and {"layers_3", "layers_4"} <= set(stacked)
  scanned_params = nn.unbox(scanned.init(jax.random.PRNGKey(0), tokens)["params"])
  assert jax.tree.structure(stacked) == jax.tree.structure(scanned_params)
  assert jax.tree.all(jax.tree.map(np.array_equal, unstack_layers(stacked, 5, cycle=3), params))
  loss = lambda m, p: jnp.mean(m.apply({"params": p}, tokens) ** 2)   # noqa: E731
  (lu, gu), (ls, gs) = (jax.jit(jax.value_and_grad(lambda p, m=m: loss(m, p)))(p)
                        for m, p in ((unrolled, params), (scanned, stacked)))
  np.testing.assert_allclose(float(ls), float(lu), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(stack_layers(gu, 5, cycle=3)), jax.tree.leaves(gs)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_local_layers_see_only_their_window_and_global_layers_everything():
  """Causality and reach by gradient: with pattern 'LG' and window 4, one local layer sees 3 keys back,
  a local layer then a global one sees the whole prefix."""
  x = jax.random.randint(jax.random.PRNGKey(3), (1, 16), 0, 61)
  for pattern, reach in (("LG", 15), ("L", 3)):   # 'L' alone: two local layers see 2 x 3 back
    kw = dict(num_layers=2, layer_pattern=pattern if pattern != "L" else "", window=4)
    model = _model("mistral", **kw)
    params = nn.unbox(model.init(jax.random.PRNGKey(0), x)["params"])
    emb = jnp.take(params["embed"], x, axis=0)
    g = jax.grad(lambda e, m=model, p=params: m.apply({"params": p}, x, inputs_embeds_BxLxD=e)[0, 15].sum())(emb)
    seen = np.nonzero(np.abs(np.asarray(g[0])).sum(-1) > 0)[0]
    want = 15 - (reach if pattern == "LG" else 6)
    assert seen.min() == max(0, want) and seen.max() == 15, (pattern, seen)


def test_ring_cache_bytes_per_token_5_to_1_against_all_global_at_32k():
  """Gemma 3's 5:1 pattern with a 1024-token window at 32,768 tokens of context: the local layers' rings hold
  1024 slots, so the cache is (5 * 1024 + 32768) / (6 * 32768) = 0.193 of the all-global one (about a fifth)."""
  s, w, kh, dh = 32768, 1024, 2, 16
  cfg = dict(vocab_size=64, d_model=32, num_layers=6, num_heads=2, num_kv_heads=kh, head_dim=dh, max_len=s,
             position="rope", norm="rmsnorm")
  local = Transformer(ModelConfig(**cfg, layer_pattern="LLLLLG", window=w))
  every = Transformer(ModelConfig(**cfg))
  kv = 2 * kh * dh * 4                                        # K and V, float32, per slot and layer
  top = s * 1 + 4                                             # the model's kv_valid (bool) and index
  ring_extra = w * (4 + 1)                                    # each ring slot's index (int32) and validity
  assert decode.cache_bytes(every, 1, s) == 6 * s * kv + top
  assert decode.cache_bytes(local, 1, s) == 5 * (w * kv + ring_extra) + s * kv + top
  ratio = decode.cache_bytes(local, 1, s) / decode.cache_bytes(every, 1, s)
  assert 0.19 < ratio < 0.20, ratio


@pytest.mark.parametrize("field,value,needle", [
    ("layer_pattern", "LLX", "letters are L"), ("layer_pattern", "GG", "no local layer"),
    ("local_rope_theta", 1e4, "needs position='rope' and a layer_pattern"), ("qk_norm", "layer", "qk_norm"),
    ("attn_softcap", -1.0, "must be >= 0"), ("norm_unit_offset", True, "norm='rmsnorm'"),
])
def test_bad_fields_get_one_line_naming_them(field, value, needle):
  c = default_config()
  c.model.vocab_size = 256
  c.model[field] = value
  if field == "norm_unit_offset":
    c.model.norm = "layernorm"
  with pytest.raises(ConfigError, match=needle) as e:
    validate_model(ModelConfig.from_config(c.model))
  assert "\n" not in str(e.value) and f"model.{field}" in str(e.value)


def test_pattern_without_window_and_linear_with_sinks_are_refused():
  for kw, needle in ((dict(layer_pattern="LG"), "set model.window > 0"),
                     (dict(attention="linear", attention_sinks=True, position="learned"), "no softmax to cap or sink")):
    with pytest.raises(ConfigError, match=needle):
      validate_model(ModelConfig(**{**BASE, **kw}))


def test_runtime_never_picks_a_path_without_the_feature_and_says_why():
  c = default_config()
  c.model.vocab_size, c.model.attn_softcap, c.model.attention_sinks = 256, 30.0, True
  gpu = backends.resolve_runtime(c, platform="gpu", quiet=True)
  assert gpu.backend.attention_impl == "blockwise"
  assert any("no attention soft cap" in r for r in gpu.reasons), gpu.reasons
  cpu = backends.resolve_runtime(c, platform="cpu", quiet=True)
  assert cpu.backend.attention_impl == "chunked"
  if cpu.backend.cpu_kernels:
    assert any("not the C++ kernel" in r for r in cpu.reasons), cpu.reasons
  assert backends.resolve_runtime(c, platform="tpu", quiet=True).backend.attention_impl == "splash"
  c.runtime.attention = "xla"
  with pytest.raises(ConfigError, match="runtime.attention: 'xla' has no attention soft cap"):
    backends.resolve_runtime(c, platform="gpu", quiet=True)


def test_splash_kernel_takes_the_soft_cap_and_sinks():
  """jax's splash kernel (Pallas interpret mode on CPU) with its attn_logits_soft_cap and sinks equals the
  reference."""
  q, k, v, sinks = _qkv(b=1, l=128, h=2, k=1, d=8)
  vis = masks.Visibility(causal=True, window=40)
  out = backends.Backend(attention_impl="splash", splash_block_q=128, splash_block_kv=128).attention(
      q, k, v, vis, softcap=3.0, sinks_H=sinks)[0]
  ref = attn_ops.dot_product_attention(q, k, v, mask=masks.sliding_window_mask(128, window=40), softcap=3.0,
                                       sinks_H=sinks)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5)


@pytest.mark.parametrize("shape", ["gemma3", "qwen3"])
def test_eight_devices_equal_one_device_over_five_steps(shape):
  """A Gemma-3-shaped (pattern, ring, caps, sandwich, QK-norm) and a Qwen3-shaped (QK-norm, odd head_dim,
  GQA) tiny model: losses on a (2, 2, 2) data x fsdp x tensor mesh under fsdp_tp equal one device's."""
  model = {"gemma3": {"model.layer_pattern": "LLG", "model.window": 8, "model.local_rope_theta": 1e4,
                      "model.num_layers": 4, "model.qk_norm": "head", "model.norm_position": "sandwich",
                      "model.norm_unit_offset": True, "model.attn_softcap": 20.0, "model.final_logit_softcap": 15.0,
                      "model.embed_scale": True, "model.activation": "geglu_tanh", "model.scan_layers": True},
           "qwen3": {"model.qk_norm": "head", "model.head_dim": 24, "model.num_kv_heads": 2, "model.num_layers": 3,
                     "model.activation": "swiglu"}}[shape]
  one, _ = direct_losses(tiny_config(steps=5, **model, **{"mesh.num_devices": 1}), 5)
  eight, _ = direct_losses(tiny_config(steps=5, **model, **{"mesh.shape": (2, 2, 2), "mesh.rules": "fsdp_tp"}), 5)
  np.testing.assert_allclose(eight, one, rtol=2e-5)
  assert one[-1] < one[0]


def test_qk_norm_params_are_per_head_or_per_projection():
  x = jnp.zeros((1, 4), jnp.int32)
  init = lambda m: nn.unbox(m.init(jax.random.PRNGKey(0), x)["params"])   # noqa: E731
  head, proj = init(_model("gemma3"))["layers_0"]["attn"], init(_model("olmo2"))["layers_0"]["attn"]
  assert head["q_norm"]["scale"].shape == head["k_norm"]["scale"].shape == (12,)
  assert proj["q_norm"]["scale"].shape == (4 * 12,) and proj["k_norm"]["scale"].shape == (2 * 12,)
  assert float(jnp.abs(head["q_norm"]["scale"]).max()) == 0.0          # Gemma: (1 + w), w from 0
  block = init(_model("olmo2"))["layers_0"]
  assert sorted(k for k in block if "norm" in k or k.startswith("ln")) == ["post_attn_norm", "post_ffn_norm"]
  assert init(_model("gpt_oss"))["layers_0"]["attn"]["sinks"].shape == (4,)
