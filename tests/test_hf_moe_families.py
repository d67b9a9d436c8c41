"""The Hugging Face mixture-of-experts families (qwen3_moe, gpt_oss, deepseek_v3) against transformers
itself, as tests/test_hf_families.py does the dense ones: a tiny random model of transformers' own config
class with odd sizes, every parameter perturbed (router weights and biases, the correction bias, expert
biases, attention sinks, norm scales), a dense first layer where the family has one and a routing that
differs from the plain top-k where the family has one (DeepSeek-V3's group limit). Per family: our logits
equal transformers' (float32, rtol = atol = 1e-4), unrolled and scanned, our export loads in transformers
with the same logits and back into ours bitwise, and 32 greedy tokens equal transformers' generate."""
from __future__ import annotations

import dataclasses
import json
import re
import shutil

import numpy as np
import pytest

pytestmark = pytest.mark.reference
transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from test_hf_families import assert_same_params, hf_logits, ours, scanned_export_and_greedy  # noqa: E402

from tformer_jax.config import RopeScaling  # noqa: E402
from tformer_jax.interop import hf as hfi  # noqa: E402
from tformer_jax.interop.hf import HFConfigError, load_hf, save_hf  # noqa: E402

TOL = dict(rtol=1e-4, atol=1e-4)
V = 61
LENGTH = 24
PROMPT, NEW = 8, 32
DERIVED_BUFFERS = r"rotary_emb\.(\w+_)?inv_freq$"
SIZES = dict(vocab_size=V, hidden_size=32, num_attention_heads=4, max_position_embeddings=64, bos_token_id=0,
             eos_token_id=1, pad_token_id=0)

GPT_OSS_ROPE = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 4096}
CONFIGS = {
    # QK-norm per head, attention biases, a dense first layer (mlp_only_layers), 5 experts of width 24 (the
    # dense FFN 40), top-3 without renormalisation, one window on every layer.
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **SIZES, num_hidden_layers=3, num_key_value_heads=2, head_dim=12, intermediate_size=40,
        moe_intermediate_size=24, num_experts=5, num_experts_per_tok=3, norm_topk_prob=False,
        mlp_only_layers=[0], attention_bias=True, use_sliding_window=True, sliding_window=5,
        tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 5000.0}),
    # sinks, attention and expert biases, a router bias, interleaved gate/up, a SwiGLU clamp that bites
    # (|gate|, |up| reach past 0.4 here), the sliding/full alternation 'LG' over 3 layers, and GPT-OSS's own
    # RoPE: YaRN with an untruncated correction range (here dimensions 1.5..3.3 of 6, not 1..4).
    "gpt_oss": lambda: transformers.GptOssConfig(
        **SIZES, num_hidden_layers=3, num_key_value_heads=2, head_dim=12, intermediate_size=24,
        num_local_experts=5, num_experts_per_tok=3, sliding_window=5, swiglu_limit=0.4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], tie_word_embeddings=False,
        rope_parameters=GPT_OSS_ROPE),
    # MLA with the q bottleneck, interleaved RoPE with YaRN and mscale_all_dim, a dense first layer, 8 experts
    # in 4 groups of which 2 are kept (test_features_matter: the limit changes the choice), a correction bias,
    # 2 shared experts, scaled and renormalised weights.
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **SIZES, num_hidden_layers=3, num_key_value_heads=4, intermediate_size=40, moe_intermediate_size=12,
        q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, first_k_dense_replace=1,
        n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=2,
        routed_scaling_factor=1.7, norm_topk_prob=True, rope_interleave=True, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                         "original_max_position_embeddings": 16, "mscale_all_dim": 1.0, "beta_fast": 32.0,
                         "beta_slow": 1.0}),
}
EXPECT = {
    "qwen3_moe": dict(window=5, layer_pattern="", qk_norm="head", qkv_bias=True, out_bias=True, tie_embeddings=False,
                      rope_theta=5000.0),
    "deepseek_v3": dict(rope_layout="interleaved", qkv_bias=False, tie_embeddings=False, mtp_depth=0),
    "gpt_oss": dict(window=5, layer_pattern="LG", attention_sinks=True, qkv_bias=True, out_bias=True,
                    tie_embeddings=False, rope_theta=150000.0,
                    rope_scaling=RopeScaling(type="yarn", factor=32.0, original_max_len=4096, truncate=False)),
}
EXPECT_MOE = {
    "qwen3_moe": dict(router="softmax", num_experts=5, top_k=3, d_ff=24, renormalize=False, first_k_dense=1, every=1),
    "deepseek_v3": dict(router="sigmoid", num_experts=8, top_k=3, d_ff=12, n_group=4, topk_group=2,
                        num_shared_experts=2, routed_scaling_factor=1.7, renormalize=True, first_k_dense=1),
    "gpt_oss": dict(router="softmax_topk", num_experts=5, top_k=3, d_ff=24, expert_bias=True, swiglu_limit=0.4,
                    swiglu_alpha=1.702),
}


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
  before = torch.get_num_threads()
  torch.set_num_threads(1)
  yield
  torch.set_num_threads(before)


def build(config, seed: int = 0):
  """transformers' model (eager attention) with every parameter perturbed, 1-d ones (biases, norm scales,
  router and correction biases, sinks) more."""
  torch.manual_seed(seed)
  m = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
  g = torch.Generator().manual_seed(seed + 1)
  with torch.no_grad():
    for p in m.parameters():
      p.add_(0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype) if p.ndim == 1 else
             0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    for name, b in m.named_buffers():
      if name.endswith("e_score_correction_bias"):
        b.add_(0.2 * torch.randn(b.shape, generator=g, dtype=b.dtype))
  extra = [n for n, _ in m.named_buffers()
           if not re.search(DERIVED_BUFFERS, n) and not n.endswith("e_score_correction_bias")]
  assert not extra, f"buffers that are not derived from the config: {extra}"
  return m






def batch(length: int, b: int = 2, seed: int = 1) -> np.ndarray:
  return np.random.RandomState(seed).randint(0, V, (b, length)).astype(np.int32)






@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_moe_family_parity_export_and_greedy(family, tmp_path):
  m = build(CONFIGS[family]())
  m.save_pretrained(tmp_path / "hf")
  model, params = load_hf(tmp_path / "hf")
  cfg = model.cfg
  for field, want in EXPECT[family].items():
    assert getattr(cfg, field) == want, field
  for field, want in EXPECT_MOE[family].items():
    assert getattr(cfg.moe, field) == want, f"moe.{field}"
  assert hfi.infer_family(cfg) == family

  tokens = batch(LENGTH)
  ref = hf_logits(m, tokens)
  got = ours(model, params, tokens)
  np.testing.assert_allclose(got, ref, **TOL)
  assert_same_params(load_hf(m)[1], params)      # the in-memory (fused experts) model: the same params

  scanned_export_and_greedy(family, m, model, params, tokens, got, batch(PROMPT, seed=3), tmp_path)
  print(f"{family}: logits max|diff| {np.abs(got - ref).max():.1e}")


def test_moe_config_spellings_and_refusals():
  """What the MoE families' config.json can say that our MoEConfig cannot hold: one line naming it."""
  qwen = dict(model_type="qwen3_moe", vocab_size=V, hidden_size=32, intermediate_size=40, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
              moe_intermediate_size=16, norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[0, 1])
  cfg = hfi.model_config_from_hf(qwen)
  assert (cfg.moe.every, cfg.moe.first_k_dense, cfg.moe.renormalize) == (2, 2, True)
  assert [cfg.is_moe_layer(i) for i in range(4)] == [False, False, False, True]
  with pytest.raises(HFConfigError, match=r"mlp_only_layers=\[1\].*first k layers"):
    hfi.model_config_from_hf({**qwen, "mlp_only_layers": [1]})
  # gpt-oss-20b/120b's own config (transformers' defaults) imports, RoPE included: YaRN without truncating its
  # correction range, written back as it came.
  oss = transformers.GptOssConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=8, intermediate_size=16, num_local_experts=4,
                                  num_experts_per_tok=2).to_dict()
  cfg = hfi.model_config_from_hf(oss)
  assert (cfg.layer_pattern, cfg.window, cfg.moe.swiglu_limit, cfg.moe.router) == ("LG", 128, 7.0, "softmax_topk")
  assert cfg.rope_scaling == RopeScaling(type="yarn", factor=32.0, original_max_len=4096, truncate=False)
  back = hfi.hf_config_from_model(cfg, "gpt_oss")["rope_parameters"]
  assert back == {**oss["rope_parameters"], "truncate": False}
  truncated = hfi.model_config_from_hf({**oss, "rope_parameters": {**oss["rope_parameters"], "truncate": True}})
  assert truncated.rope_scaling.truncate and truncated.architecture() != cfg.architecture()
  assert "truncate" not in hfi.hf_config_from_model(truncated, "gpt_oss")["rope_parameters"]
  with pytest.raises(HFConfigError, match="truncate"):
    hfi.model_config_from_hf({**oss, "rope_parameters": {**oss["rope_parameters"], "truncate": "no"}})


def test_features_matter():
  """The routing, clamp, sink and window choices each change these models' logits, so the parity above
  tests them."""
  tokens = batch(LENGTH)
  for family, changes in (("deepseek_v3", [dict(n_group=0, topk_group=0), dict(routed_scaling_factor=1.0),
                                           dict(first_k_dense=0)]),
                          ("qwen3_moe", [dict(renormalize=True), dict(first_k_dense=0)]),
                          ("gpt_oss", [dict(swiglu_limit=0.0), dict(router="softmax"), dict(attention_sinks=False),
                                       dict(layer_pattern="")])):
    model, params = load_hf(build(CONFIGS[family]()))
    base = ours(model, params, tokens)
    for change in changes:
      moe = {k: v for k, v in change.items() if hasattr(model.cfg.moe, k)}
      top = {k: v for k, v in change.items() if k not in moe}
      cfg = dataclasses.replace(model.cfg, moe=dataclasses.replace(model.cfg.moe, **moe), **top)
      p = params
      if moe.get("first_k_dense") == 0:   # layer 0 as an MoE layer: layer 1's experts
        p = {**params, "layers_0": {**params["layers_0"], "moe": params["layers_1"]["moe"]}}
      assert np.abs(ours(hfi.Transformer(cfg), p, tokens) - base).max() > 1e-3, (family, change)


def _mtp_checkpoint(path):
  """A tiny DeepSeek-V3 saved by transformers, plus (as DeepSeek-V3's checkpoint holds them) one multi-token
  prediction layer model.layers.<num_layers>: a perturbed decoder layer (MoE: from a 4-layer transformers
  model), enorm, hnorm, eh_proj, shared_head.norm, and the repeated embedding and head. Returns (the
  transformers model, the MTP tensors added)."""
  from safetensors.numpy import load_file, save_file
  config = CONFIGS["deepseek_v3"]()
  m = build(config)
  m.save_pretrained(path)
  deeper = build(transformers.DeepseekV3Config(**{**config.to_dict(), "num_hidden_layers": 4}), seed=7)
  n, d = config.num_hidden_layers, config.hidden_size
  rng = np.random.RandomState(3)
  deeper.save_pretrained(path / "deeper")                         # its layer n as the files hold it
  extra = {k: v for k, v in load_file(next((path / "deeper").glob("*.safetensors"))).items()
           if k.startswith(f"model.layers.{n}.")}
  extra.update({f"model.layers.{n}.enorm.weight": 1 + 0.2 * rng.randn(d), f"model.layers.{n}.hnorm.weight":
                1 + 0.2 * rng.randn(d), f"model.layers.{n}.eh_proj.weight": 0.05 * rng.randn(d, 2 * d),
                f"model.layers.{n}.shared_head.norm.weight": 1 + 0.2 * rng.randn(d),
                f"model.layers.{n}.embed_tokens.weight": m.model.embed_tokens.weight.detach().numpy(),
                f"model.layers.{n}.shared_head.head.weight": m.lm_head.weight.detach().numpy()})
  extra = {k: np.ascontiguousarray(v, np.float32) for k, v in extra.items()}
  [file] = list(path.glob("*.safetensors"))
  save_file({**load_file(file), **extra}, file, metadata={"format": "pt"})
  shutil.rmtree(path / "deeper")
  return m, extra


def test_deepseek_v3_mtp_weights_kept(tmp_path, caplog):
  """DeepSeek-V3's multi-token prediction layer (model.layers.<num_layers>) imports as mtp_0 when the files hold
  it, whatever num_nextn_predict_layers says (transformers writes 1 without the weights: mtp_depth 0 above), and
  exports back under the same names, bitwise; the main logits do not change and transformers loads the export."""
  from safetensors.numpy import load_file
  m, extra = _mtp_checkpoint(tmp_path / "hf")
  n = m.config.num_hidden_layers
  model, params = load_hf(tmp_path / "hf")
  assert model.cfg.mtp_depth == 1 and model.cfg.num_layers == n
  p = hfi.flatten(params)
  assert np.array_equal(np.asarray(p["mtp_0/enorm/scale"]), extra[f"model.layers.{n}.enorm.weight"])
  assert np.array_equal(np.asarray(p["mtp_0/eh_proj"]), extra[f"model.layers.{n}.eh_proj.weight"].T)
  assert np.array_equal(np.asarray(p["mtp_0/final_norm/scale"]), extra[f"model.layers.{n}.shared_head.norm.weight"])
  assert np.array_equal(np.asarray(p["mtp_0/block/attn/kv_a_norm/scale"]),
                        extra[f"model.layers.{n}.self_attn.kv_a_layernorm.weight"])
  assert "correction_bias" in params["mtp_0"]["block"]["moe"]     # the MTP layer is an MoE layer, as layer n is

  tokens = batch(LENGTH)
  got = ours(model, params, tokens)
  np.testing.assert_allclose(got, hf_logits(m, tokens), **TOL)
  plain_model, plain = load_hf(m)                                   # no MTP tensors: no modules
  assert plain_model.cfg.mtp_depth == 0
  np.testing.assert_array_equal(ours(plain_model, plain, tokens), got)
  _, _, mtp_h = model.apply({"params": params}, tokens, mtp_tokens_BxL=np.roll(tokens, -1, axis=1))
  assert len(mtp_h) == 1 and np.isfinite(np.asarray(mtp_h[0])).all()

  save_hf(model, params, tmp_path / "out")
  written = load_file(tmp_path / "out" / "model.safetensors")
  source = load_file(next((tmp_path / "hf").glob("*.safetensors")))
  mtp_names = sorted(k for k in written if k.startswith(f"model.layers.{n}."))
  for k in mtp_names:
    assert np.array_equal(written[k], np.asarray(source[k], np.float32)), k
  assert mtp_names == sorted(extra)                               # the same names, the repeated ones included
  hf_cfg = hfi.read_hf_config(tmp_path / "out")
  assert hf_cfg["num_nextn_predict_layers"] == 1
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
  np.testing.assert_allclose(hf_logits(back, tokens), got, **TOL)
  model2, params2 = load_hf(tmp_path / "out")
  assert model2.cfg == model.cfg
  assert_same_params(params2, params)


def test_deepseek_v3_mtp_layer_count_and_missing_tensors(tmp_path):
  """The layer count checks num_layers + the MTP layers present; an MTP layer without one of its tensors,
  or a decoder layer past num_layers without them, is named in one line."""
  from safetensors.numpy import load_file, save_file
  _, extra = _mtp_checkpoint(tmp_path / "hf")
  [file] = list((tmp_path / "hf").glob("*.safetensors"))
  full = load_file(file)
  n = 3
  save_file({k: v for k, v in full.items() if not k.endswith(f"{n}.eh_proj.weight")}, file)
  with pytest.raises(hfi.HFWeightsError, match=rf"missing tensor\(s\): model\.layers\.{n}\.eh_proj\.weight"):
    load_hf(tmp_path / "hf")
  own = ("enorm", "hnorm", "eh_proj", "shared_head")
  save_file({k: v for k, v in full.items() if not any(f"layers.{n}.{o}" in k for o in own)}, file)
  with pytest.raises(hfi.HFWeightsError, match=r"num_hidden_layers=3 does not match the weights, which hold 4 "):
    load_hf(tmp_path / "hf")


OSS_TEMPLATE = ("{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
                "{% if add_generation_prompt %}<|start|>assistant{% endif %}")
CHAT = [{"role": "user", "content": "Who is Romeo?"}]


def test_gpt_oss_tokenizer_and_chat_template_through_convert(tmp_path):
  """A GPT-OSS directory as transformers saves it (its own YaRN, tokenizer files, chat_template.jinja) ->
  tformer-convert --from-hf -> workdir -> tformer-convert --to-hf: the workdir keeps the RoPE (truncate
  included), transformers loads the export with the same logits, tokenizer and chat template."""
  import hf_utils

  from tformer_jax.cli import convert
  tok = hf_utils.byte_level_bpe(20_000, 300, ["<|endoftext|>", "<|start|>", "<|message|>", "<|end|>"])
  fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                              pad_token="<|endoftext|>")
  fast.chat_template = OSS_TEMPLATE
  src = tmp_path / "hf"
  fast.save_pretrained(src)
  config = CONFIGS["gpt_oss"]()
  config.vocab_size = tok.get_vocab_size()
  config.pad_token_id = config.eos_token_id = config.bos_token_id = 0
  m = build(config)
  m.save_pretrained(src)
  assert (src / "chat_template.jinja").is_file()

  assert convert.main(["--from-hf", str(src), "--to", str(tmp_path / "work")]) == 0
  saved = json.loads((tmp_path / "work" / "config.json").read_text())["model"]["rope_scaling"]
  assert (saved["type"], saved["truncate"]) == ("yarn", False)
  assert convert.main(["--from", str(tmp_path / "work"), "--to-hf", str(tmp_path / "back")]) == 0
  assert json.loads((tmp_path / "back" / "tformer_export.json").read_text())["family"] == "gpt_oss"
  assert json.loads((tmp_path / "back" / "config.json").read_text())["rope_parameters"] == GPT_OSS_ROPE
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager").eval()
  tokens = np.random.RandomState(1).randint(0, config.vocab_size, (2, LENGTH))
  np.testing.assert_allclose(hf_logits(back, tokens), hf_logits(m, tokens), **TOL)
  want_chat = fast.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
  back_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "back")
  assert back_tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == want_chat
  text = "ROMEO: What light through yonder window breaks?"
  assert back_tok(text)["input_ids"] == fast(text)["input_ids"]
  for d in (tmp_path / "work", tmp_path / "back"):
    assert hfi.chat_template(d) == OSS_TEMPLATE, d
