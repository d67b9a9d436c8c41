"""The Hugging Face families of today's open models (qwen2, qwen3, gemma2, gemma3_text, olmo2) against
transformers itself: a tiny random model of transformers' own config class with odd sizes (head_dim !=
d_model / heads), a sliding window shorter than the sequence where the family has one, a layer count
that is not a multiple of the layer pattern, and every parameter perturbed (zero biases, unit or zero
Gemma norm scales would hide a misplaced tensor). Per family: our logits equal transformers' (float32,
rtol = atol = 1e-4), unrolled and scanned (the layer pattern's cycle), our export (from the scanned
layout) loads in transformers with the same logits and back into ours bitwise, and 32 greedy tokens
through our KV cache (a local layer's ring of `window` slots) equal transformers' generate. Then one family end to end
through the command lines (tformer-convert both ways, tformer-generate), tokenizer and chat template
included."""
from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest

pytestmark = pytest.mark.reference
transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import hf_utils  # noqa: E402
import jax  # noqa: E402

from tformer_jax import decode  # noqa: E402
from tformer_jax.cli import convert, generate as generate_cli  # noqa: E402
from tformer_jax.interop import hf as hfi  # noqa: E402
from tformer_jax.interop.hf import HFConfigError, load_hf, save_hf  # noqa: E402
from tformer_jax.nn.stacking import stack_layers  # noqa: E402
from tformer_jax.serve import api as chat_api  # noqa: E402

TOL = dict(rtol=1e-4, atol=1e-4)
V = 61
LENGTH = 24          # tokens of the logits comparison: past every window below
PROMPT, NEW = 8, 32  # greedy generation: 40 positions, the window (5) wraps many times
# Buffers transformers derives from the config (RoPE frequencies, Gemma's sqrt(d_model)): not weights,
# never in a checkpoint; any other buffer would be a tensor the tables must place.
DERIVED_BUFFERS = r"rotary_emb\.(\w+_)?inv_freq$|embed_tokens\.embed_scale$"

SIZES = dict(vocab_size=V, hidden_size=32, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2,
             head_dim=12, max_position_embeddings=64, bos_token_id=0, eos_token_id=1, pad_token_id=0)
SLIDE, FULL = "sliding_attention", "full_attention"
CONFIGS = {
    # q/k/v biases (none on o_proj), untied; sliding on layers 0 and 2: the cycle 'LG' over 3 layers.
    "qwen2": lambda: transformers.Qwen2Config(
        **SIZES, num_hidden_layers=3, use_sliding_window=True, sliding_window=5, layer_types=[SLIDE, FULL, SLIDE],
        tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 5000.0}),
    # per-head QK-norm, attention_bias on all four projections, tied; the cycle 'GL' over 3 layers.
    "qwen3": lambda: transformers.Qwen3Config(
        **SIZES, num_hidden_layers=3, use_sliding_window=True, sliding_window=5, layer_types=[FULL, SLIDE, FULL],
        attention_bias=True, tie_word_embeddings=True),
    # sandwich norms (1 + w), GeGLU-tanh, query_pre_attn_scalar, both soft-caps; 'LG' over 3 layers.
    "gemma2": lambda: transformers.Gemma2Config(
        **SIZES, num_hidden_layers=3, sliding_window=5, query_pre_attn_scalar=20, attn_logit_softcapping=0.5,
        final_logit_softcapping=3.0),
    # the cycle 'LLG' over 4 layers (Gemma 3's own is 'LLLLLG': test_config_spellings_and_refusals), local
    # RoPE base 1e3 unscaled, global 1e5 with linear scaling, QK-norm (1 + w), a final soft-cap.
    "gemma3_text": lambda: transformers.Gemma3TextConfig(
        **SIZES, num_hidden_layers=4, layer_types=[SLIDE, SLIDE, FULL, SLIDE], sliding_window=5,
        query_pre_attn_scalar=20, final_logit_softcapping=3.0,
        rope_parameters={FULL: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e5},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e3}}),
    # QK-norm over the whole projections, norms after each sublayer, attention biases; no window in OLMo 2.
    "olmo2": lambda: transformers.Olmo2Config(**SIZES, num_hidden_layers=3, attention_bias=True,
                                              tie_word_embeddings=False),
}
EXPECT = {   # what the config becomes in ours
    "qwen2": dict(window=5, layer_pattern="LG", qkv_bias=True, out_bias=False, tie_embeddings=False,
                  rope_theta=5000.0),
    "qwen3": dict(window=5, layer_pattern="GL", qk_norm="head", qkv_bias=True, out_bias=True, tie_embeddings=True),
    "gemma2": dict(window=5, layer_pattern="LG", norm_position="sandwich", norm_unit_offset=True,
                   embed_scale=True, activation="geglu_tanh", attention_scale=20 ** -0.5, attn_softcap=0.5,
                   final_logit_softcap=3.0, local_rope_theta=0.0),
    "gemma3_text": dict(window=5, layer_pattern="LLG", local_rope_theta=1e3, rope_theta=1e5, qk_norm="head",
                        norm_position="sandwich", norm_unit_offset=True, embed_scale=True, final_logit_softcap=3.0,
                        attn_softcap=0.0),
    "olmo2": dict(window=0, layer_pattern="", qk_norm="proj", norm_position="reordered", qkv_bias=True,
                  out_bias=True),
}


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
  """These models are tiny: torch's thread pool on a busy machine made a 32-token generate 20-60x slower."""
  before = torch.get_num_threads()
  torch.set_num_threads(1)
  yield
  torch.set_num_threads(before)


def build(config, seed: int = 0):
  """transformers' model (eager attention: the reference) with every parameter perturbed."""
  torch.manual_seed(seed)
  m = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
  g = torch.Generator().manual_seed(seed + 1)
  with torch.no_grad():
    for p in m.parameters():
      p.add_(0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype) if p.ndim == 1 else
             0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
  extra = [n for n, _ in m.named_buffers() if not re.search(DERIVED_BUFFERS, n)]
  assert not extra, f"buffers that are not derived from the config: {extra}"
  return m


def hf_logits(m, tokens: np.ndarray) -> np.ndarray:
  with torch.no_grad():
    return m(torch.tensor(tokens)).logits.numpy()


def ours(model, params, tokens: np.ndarray) -> np.ndarray:
  return np.asarray(jax.jit(model.apply)({"params": params}, tokens))


def batch(length: int, b: int = 2, seed: int = 1) -> np.ndarray:
  return np.random.RandomState(seed).randint(0, V, (b, length)).astype(np.int32)


def hf_greedy(m, prompts: np.ndarray, n: int) -> np.ndarray:
  m.generation_config.eos_token_id = None     # exactly n tokens, as ours
  x = torch.tensor(prompts)
  with torch.no_grad():   # the mask given: generate would take a prompt's token 0 (= pad_token_id) for padding
    out = m.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, pad_token_id=0,
                     disable_compile=True)   # Gemma's cache would torch.compile the step: 20 s here
  return out[:, prompts.shape[1]:].numpy()


def assert_same_params(a, b) -> None:
  fa, fb = hfi.flatten(a), hfi.flatten(b)
  assert sorted(fa) == sorted(fb)
  for k in fa:
    assert np.array_equal(np.asarray(fa[k]), np.asarray(fb[k])), k


def scanned_export_and_greedy(family, m, model, params, tokens, got, prompts, tmp_path) -> None:
  """The rest of a family's parity (tests/test_hf_moe_families.py too), given transformers' model `m`, ours
  imported from it and our logits `got` on `tokens` (already checked against transformers'): train.init_from=hf
  with scan_layers (the unrolled layers stacked per cycle, the leftover and a MoE model's dense first layers
  apart) gives the same logits; its export loads in transformers with those logits and back into ours bitwise;
  greedy tokens from `prompts` equal transformers' generate."""
  cfg = model.cfg
  scanned = hfi.Transformer(dataclasses.replace(cfg, scan_layers=True))
  scanned_params = stack_layers(params, cfg.num_layers, cfg.cycle, cfg.moe.first_k_dense)
  np.testing.assert_allclose(ours(scanned, scanned_params, tokens), got, **TOL)

  save_hf(scanned, scanned_params, tmp_path / "out")          # exported from the scanned layout
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
  assert back.config.model_type == family
  np.testing.assert_allclose(hf_logits(back, tokens), got, **TOL)
  model2, params2 = load_hf(tmp_path / "out")
  assert hfi.arch_signature(model2.cfg) == hfi.arch_signature(cfg)
  assert_same_params(params2, params)

  want = hf_greedy(m, prompts, NEW)
  mine = decode.generate(model, params, prompts, max_new_tokens=NEW, temperature=0.0)
  np.testing.assert_array_equal(mine, want)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_family_parity_export_and_greedy(family, tmp_path):
  m = build(CONFIGS[family]())
  m.save_pretrained(tmp_path / "hf")
  model, params = load_hf(tmp_path / "hf")
  cfg = model.cfg
  for field, want in EXPECT[family].items():
    assert getattr(cfg, field) == want, field
  assert cfg.hd * cfg.num_heads != cfg.d_model
  if cfg.window:
    assert cfg.window < LENGTH and cfg.num_layers % cfg.cycle, "the window and the cycle are exercised"
  assert hfi.infer_family(cfg) == family

  tokens = batch(LENGTH)
  ref = hf_logits(m, tokens)
  got = ours(model, params, tokens)
  np.testing.assert_allclose(got, ref, **TOL)
  assert_same_params(load_hf(m)[1], params)      # the in-memory model: the same params as its files

  scanned_export_and_greedy(family, m, model, params, tokens, got, batch(PROMPT, seed=3), tmp_path)
  print(f"{family}: logits max|diff| {np.abs(got - ref).max():.1e}")


def test_features_matter():
  """The window, the local RoPE base and the soft-caps each change the logits of these models, so the
  parity above tests them (QK-norm and the norms: their perturbed scales are imported weights)."""
  tokens = batch(LENGTH)
  for family, changes in (("gemma3_text", [dict(window=0, layer_pattern=""), dict(local_rope_theta=0.0),
                                           dict(final_logit_softcap=0.0)]),
                          ("gemma2", [dict(attn_softcap=0.0)]), ("qwen2", [dict(layer_pattern="")])):
    model, params = load_hf(build(CONFIGS[family]()))
    base = ours(model, params, tokens)
    for change in changes:
      other = hfi.Transformer(dataclasses.replace(model.cfg, **change))
      assert np.abs(ours(other, params, tokens) - base).max() > 1e-3, (family, change)


def test_gemma3_ignores_the_attention_cap_as_transformers_does():
  """Gemma3Attention stores attn_logit_softcapping and never applies it (QK-norm replaced the cap): a config.json
  that sets one (a merge, a hand edit) loads without it and gives transformers' logits; a model of ours with the
  cap cannot be written as Gemma 3, in one line naming the field."""
  m = build(transformers.Gemma3TextConfig(**{**CONFIGS["gemma3_text"]().to_dict(), "attn_logit_softcapping": 0.5}))
  model, params = load_hf(m)
  assert model.cfg.attn_softcap == 0.0
  tokens = batch(LENGTH)
  ref = hf_logits(m, tokens)
  np.testing.assert_allclose(ours(model, params, tokens), ref, atol=1e-4 * np.abs(ref).max())
  capped = dataclasses.replace(model.cfg, attn_softcap=0.5)
  with pytest.raises(HFConfigError, match=r"gemma3_text cannot represent model\.attn_softcap=0\.5 \(transformers"):
    hfi.hf_config_from_model(capped, "gemma3_text")


def test_config_spellings_and_refusals():
  """Older config.json spellings (transformers 4) and what the families cannot hold."""
  gemma3_old = dict(model_type="gemma3_text", vocab_size=V, hidden_size=32, intermediate_size=40,
                    num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                    sliding_window=512, sliding_window_pattern=6, rope_theta=1e6, rope_local_base_freq=1e4,
                    rope_scaling={"rope_type": "linear", "factor": 8.0}, query_pre_attn_scalar=16,
                    max_position_embeddings=32768, hidden_activation="gelu_pytorch_tanh")
  cfg = hfi.model_config_from_hf(gemma3_old)
  assert (cfg.layer_pattern, cfg.window, cfg.local_rope_theta, cfg.rope_theta) == ("LLLLLG", 512, 1e4, 1e6)
  assert (cfg.rope_scaling.type, cfg.rope_scaling.factor, cfg.attention_scale) == ("linear", 8.0, 0.0)
  assert cfg.tie_embeddings and cfg.final_logit_softcap == 0.0
  qwen2_old = dict(model_type="qwen2", vocab_size=V, hidden_size=32, intermediate_size=40, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, sliding_window=131072, use_sliding_window=False,
                   max_window_layers=2, rope_theta=1e6, max_position_embeddings=32768)
  cfg = hfi.model_config_from_hf(qwen2_old)
  assert (cfg.window, cfg.layer_pattern, cfg.qkv_bias, cfg.out_bias, cfg.rope_theta) == (0, "", True, False, 1e6)
  cfg = hfi.model_config_from_hf({**qwen2_old, "use_sliding_window": True, "sliding_window": 8})
  assert (cfg.window, cfg.layer_pattern) == (8, "GGLL")          # max_window_layers: no shorter cycle
  gemma2_old = {**gemma3_old, "model_type": "gemma2", "num_hidden_layers": 5, "rope_scaling": None,
                "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0}
  cfg = hfi.model_config_from_hf(gemma2_old)
  assert (cfg.layer_pattern, cfg.attn_softcap, cfg.final_logit_softcap, cfg.qk_norm) == ("LG", 50.0, 30.0, "none")

  with pytest.raises(HFConfigError, match="layer_types 'chunked_attention'"):
    hfi.model_config_from_hf({**qwen2_old, "layer_types": ["chunked_attention"] * 4})
  with pytest.raises(HFConfigError, match="not one entry per layer"):
    hfi.model_config_from_hf({**qwen2_old, "layer_types": ["full_attention"] * 3})
  with pytest.raises(HFConfigError, match="use_bidirectional_attention"):
    hfi.model_config_from_hf({**gemma3_old, "use_bidirectional_attention": True})
  with pytest.raises(HFConfigError, match="sliding layers"):
    hfi.model_config_from_hf({**gemma3_old, "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}})
  llama_like = hfi.model_config_from_hf(dict(model_type="llama", vocab_size=V, hidden_size=32, intermediate_size=40,
                                             num_hidden_layers=2, num_attention_heads=4))
  with pytest.raises(HFConfigError, match=r"qwen3 cannot represent model\.qk_norm='none'"):
    hfi.hf_config_from_model(llama_like, "qwen3")
  qk = dataclasses.replace(llama_like, qk_norm="head")
  with pytest.raises(HFConfigError, match=r"llama cannot represent model\.qk_norm='head'"):
    hfi.hf_config_from_model(qk, "llama")
  assert hfi.infer_family(qk) == "qwen3"


# ---------------------------------------------------------------------------------------------
# One new family through the command lines, with its tokenizer and chat template

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
            "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
CHAT = [{"role": "user", "content": "Who is Romeo?"}]


def test_gemma3_convert_and_generate_through_the_cli(tmp_path, capsys):
  """A Gemma 3 directory as transformers saves it (tokenizer.json, tokenizer_config.json,
  chat_template.jinja) -> tformer-convert --from-hf -> workdir -> tformer-convert --to-hf: transformers
  loads the export with the same logits and the same chat template; tformer-generate greedy on the
  export prints transformers' greedy continuation of the original."""
  tok = hf_utils.byte_level_bpe(20_000, 300, ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"])
  fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                              pad_token="<pad>")
  fast.chat_template = TEMPLATE
  src = tmp_path / "hf"
  fast.save_pretrained(src)
  config = CONFIGS["gemma3_text"]()
  config.vocab_size = tok.get_vocab_size()
  config.pad_token_id, config.eos_token_id, config.bos_token_id = 0, 1, 2
  m = build(config)
  m.save_pretrained(src)
  assert (src / "chat_template.jinja").is_file()

  assert convert.main(["--from-hf", str(src), "--to", str(tmp_path / "work")]) == 0
  assert convert.main(["--from", str(tmp_path / "work"), "--to-hf", str(tmp_path / "back")]) == 0
  info = json.loads((tmp_path / "back" / "tformer_export.json").read_text())
  assert info["family"] == "gemma3_text"
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager").eval()
  tokens = np.random.RandomState(1).randint(0, config.vocab_size, (2, LENGTH))
  np.testing.assert_allclose(hf_logits(back, tokens), hf_logits(m, tokens), **TOL)
  want_chat = fast.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
  back_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "back")
  assert back_tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == want_chat
  assert json.loads((tmp_path / "back" / "generation_config.json").read_text())["eos_token_id"] == 1
  for d in (tmp_path / "work", tmp_path / "back"):            # what tformer-serve / generate --chat render
    assert hfi.chat_template(d) == TEMPLATE, d
  ours_tok = hfi.load_hf_tokenizer(tmp_path / "back" / "tokenizer.json")
  assert chat_api.render_chat(CHAT, ours_tok, hfi.chat_template(tmp_path / "back")) == want_chat

  prompt = "ROMEO: What light"
  ids = fast(prompt, add_special_tokens=False, return_tensors="np")["input_ids"].astype(np.int32)
  n = 12
  want = hf_greedy(m, ids, n)[0].tolist()
  want = want[:want.index(1) + 1] if 1 in want else want          # ours stops at eos too
  text = fast.decode(want, skip_special_tokens=True)
  capsys.readouterr()
  assert generate_cli.main([f"--hf={tmp_path / 'back'}", f"--prompt={prompt}", "--temperature=0",
                            f"--max_new_tokens={n}"]) == 0
  out = capsys.readouterr().out
  assert text.strip() and text in out, (text, out)
