"""Hugging Face interop: logit parity with transformers for every family, export that transformers
loads, bitwise parameter round trips, bad checkpoints, the tokenizer and the convert CLI.

Tolerances: rtol = atol = 1e-4 on float32 logits (observed differences are ~1e-7)."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import pathlib

import numpy as np
import pytest

pytestmark = pytest.mark.reference
transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import jax  # noqa: E402

from tformer_jax.config import RopeScaling  # noqa: E402
from tformer_jax.interop import hf as hfi  # noqa: E402
from tformer_jax.interop.hf import HFConfigError, HFWeightsError, load_hf, save_hf  # noqa: E402

TOL = dict(rtol=1e-4, atol=1e-4)
V = 61
ROOT = pathlib.Path(__file__).resolve().parents[1]

LLAMA = dict(vocab_size=V, hidden_size=36, intermediate_size=40, num_hidden_layers=2, num_attention_heads=9,
             num_key_value_heads=3, head_dim=8, max_position_embeddings=64)
CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(vocab_size=V, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                            bos_token_id=0, eos_token_id=0),
    "llama_gqa_untied": lambda: transformers.LlamaConfig(**LLAMA, tie_word_embeddings=False),
    "llama_tied_biases": lambda: transformers.LlamaConfig(**LLAMA, tie_word_embeddings=True,
                                                          attention_bias=True, mlp_bias=True),
    "mistral_window": lambda: transformers.MistralConfig(
        vocab_size=V, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=5, max_position_embeddings=64),
    "mixtral": lambda: transformers.MixtralConfig(
        vocab_size=V, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64),
    "bloom_alibi6": lambda: transformers.BloomConfig(vocab_size=V, hidden_size=48, n_layer=2, n_head=6),
    "gpt_neox_partial": lambda: transformers.GPTNeoXConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        rotary_pct=0.5, max_position_embeddings=64),
    "gpt_neox_sequential": lambda: transformers.GPTNeoXConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        rotary_pct=0.25, use_parallel_residual=False, tie_word_embeddings=True, max_position_embeddings=64),
    "bert": lambda: transformers.BertConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, type_vocab_size=3),
}


def build(config, seed: int = 0):
  torch.manual_seed(seed)
  if config.model_type == "bert":
    return transformers.BertModel(config, add_pooling_layer=False).float().eval()
  return transformers.AutoModelForCausalLM.from_config(config).float().eval()


def reload(path: pathlib.Path, bert: bool):
  cls = transformers.AutoModel if bert else transformers.AutoModelForCausalLM
  return cls.from_pretrained(path).float().eval()


def hf_out(m, tokens, mask=None, types=None) -> np.ndarray:
  kw = {}
  if mask is not None:
    kw["attention_mask"] = torch.tensor(mask)
  if types is not None:
    kw["token_type_ids"] = torch.tensor(types)
  with torch.no_grad():
    out = m(torch.tensor(tokens), **kw)
  return (out.last_hidden_state if hasattr(out, "last_hidden_state") else out.logits).numpy()


def ours(model, params, tokens, mask=None, types=None, positions=None) -> np.ndarray:
  return np.asarray(model.apply({"params": params}, tokens, attention_mask_BxL=mask, token_types_BxL=types,
                                positions_BxL=positions))


def batch(length: int = 12, b: int = 2, seed: int = 1) -> np.ndarray:
  return np.random.RandomState(seed).randint(0, V, (b, length)).astype(np.int32)


def assert_same_params(a, b) -> None:
  fa, fb = hfi.flatten(a), hfi.flatten(b)
  assert sorted(fa) == sorted(fb)
  for k in fa:
    assert np.array_equal(np.asarray(fa[k]), np.asarray(fb[k])), k


def roundtrip(case_cfg, tmp_path, length: int = 12, bert_inputs: bool = False):
  """HF model -> save_pretrained -> load_hf (parity) -> save_hf -> from_pretrained (parity) -> load_hf
  (bitwise params). Returns (max abs diff import, export, model, params)."""
  m = build(case_cfg)
  bert = case_cfg.model_type == "bert"
  m.save_pretrained(tmp_path / "hf")
  model, params = load_hf(tmp_path / "hf")
  tokens = batch(length)
  mask = types = None
  if bert:
    mask = np.ones_like(tokens)
    mask[1, 7:] = 0                                   # right padding in row 1
    types = np.random.RandomState(2).randint(0, case_cfg.type_vocab_size, tokens.shape).astype(np.int32)
  ref = hf_out(m, tokens, mask, types)
  got = ours(model, params, tokens, mask, types)
  if bert:
    # HF numbers padded positions 0..L-1 too: pass those positions to compare every row entirely.
    pos = np.broadcast_to(np.arange(length), tokens.shape)
    np.testing.assert_allclose(ours(model, params, tokens, mask, types, pos), ref, **TOL)
    valid = mask.astype(bool)
    np.testing.assert_allclose(got[valid], ref[valid], **TOL)
  else:
    np.testing.assert_allclose(got, ref, **TOL)
  sel = (mask > 0) if bert else ...
  d_import = float(np.abs(got[sel] - ref[sel]).max())

  # The in-memory transformers model gives the same params as its saved directory.
  assert_same_params(load_hf(m)[1], params)

  save_hf(model, params, tmp_path / "out")
  m2 = reload(tmp_path / "out", bert)
  ref2 = hf_out(m2, tokens, mask, types)
  np.testing.assert_allclose(got[sel], ref2[sel], **TOL)
  d_export = float(np.abs(got[sel] - ref2[sel]).max())
  model3, params3 = load_hf(tmp_path / "out")
  assert hfi.arch_signature(model3.cfg) == hfi.arch_signature(model.cfg)
  assert_same_params(params3, params)
  return d_import, d_export, model, params


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_family_parity_and_roundtrip(case, tmp_path):
  d_in, d_out, model, _ = roundtrip(CONFIGS[case](), tmp_path)
  print(f"{case}: import max|diff| {d_in:.2e}, export {d_out:.2e}")
  cfg = model.cfg
  if case == "llama_gqa_untied":
    assert (cfg.num_heads, cfg.kv_heads, cfg.tie_embeddings) == (9, 3, False)
  if case == "bloom_alibi6":
    assert (cfg.position, cfg.num_heads, cfg.embed_norm) == ("alibi", 6, True)
  if case == "gpt_neox_partial":
    assert (cfg.rotary_fraction, cfg.parallel_residual, cfg.tie_embeddings) == (0.5, True, False)
  if case == "mistral_window":
    assert cfg.window == 5
  if case == "mixtral":
    assert (cfg.moe.num_experts, cfg.moe.top_k) == (4, 2)
  if case == "bert":
    assert (cfg.causal, cfg.norm_position, cfg.lm_head, cfg.type_vocab_size) == (False, "post", False, 3)


def test_window_and_experts_files(tmp_path):
  """Mistral's window is exercised (12 tokens, window 5); Mixtral's files hold one tensor per expert,
  transformers 5's modules the fused ones: both import to the same params."""
  m = build(CONFIGS["mistral_window"]())
  m.save_pretrained(tmp_path / "mistral")
  model, params = load_hf(tmp_path / "mistral")
  tokens = batch(12)
  full = hfi.Transformer(dataclasses.replace(model.cfg, window=0))
  assert np.abs(ours(full, params, tokens) - ours(model, params, tokens)).max() > 1e-3

  mx = build(CONFIGS["mixtral"]())
  mx.save_pretrained(tmp_path / "mixtral")
  names = hfi.read_hf(tmp_path / "mixtral")[1]
  assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in names
  assert "model.layers.0.mlp.experts.gate_up_proj" in dict(mx.state_dict())
  assert_same_params(load_hf(mx)[1], load_hf(tmp_path / "mixtral")[1])


ROPE_SCALINGS = {
    "linear": dict(rope_type="linear", factor=2.0),
    "dynamic": dict(rope_type="dynamic", factor=2.0),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, beta_fast=8.0,
                 beta_slow=1.0),
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16),
}


@pytest.mark.parametrize("kind", sorted(ROPE_SCALINGS))
def test_llama_rope_scaling(kind, tmp_path):
  """Each scaling at 40 tokens with max_position_embeddings 16 (dynamic grows only beyond it)."""
  rope = {"rope_theta": 500.0, **ROPE_SCALINGS[kind]}
  cfg = transformers.LlamaConfig(**{**LLAMA, "max_position_embeddings": 16, "head_dim": 16},
                                 rope_parameters=rope)
  d_in, d_out, model, params = roundtrip(cfg, tmp_path, length=40)
  print(f"llama rope {kind}: import max|diff| {d_in:.2e}, export {d_out:.2e}")
  assert model.cfg.rope_scaling.type == kind
  plain = hfi.Transformer(dataclasses.replace(model.cfg, rope_scaling=RopeScaling()))
  tokens = batch(40)
  assert np.abs(ours(plain, params, tokens) - ours(model, params, tokens)).max() > 1e-3


# ---------------------------------------------------------------------------------------------
# Bad input

@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory) -> pathlib.Path:
  d = tmp_path_factory.mktemp("gpt2")
  build(CONFIGS["gpt2"]()).save_pretrained(d)
  return d


def _edit_weights(src: pathlib.Path, dst: pathlib.Path, edit) -> pathlib.Path:
  from safetensors.numpy import save_file
  dst.mkdir()
  (dst / "config.json").write_text((src / "config.json").read_text())
  tensors = {k: np.array(v) for k, v in hfi.read_safetensors(src / "model.safetensors").items()}
  edit(tensors)
  save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
  return dst


def test_unknown_family(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "foo"}))
  (tmp_path / "model.safetensors").write_bytes(b"")
  with pytest.raises(HFConfigError, match="'foo'"):
    load_hf(tmp_path)


def test_missing_unexpected_and_misshaped_tensors(gpt2_dir, tmp_path):
  bad = _edit_weights(gpt2_dir, tmp_path / "missing", lambda t: t.pop("transformer.h.1.ln_2.bias"))
  with pytest.raises(HFWeightsError, match=r"missing tensor\(s\): transformer\.h\.1\.ln_2\.bias"):
    load_hf(bad)
  bad = _edit_weights(gpt2_dir, tmp_path / "extra",
                      lambda t: t.update({"transformer.h.0.attn.rogue.weight": np.zeros((2, 2), np.float32)}))
  with pytest.raises(HFWeightsError, match=r"unexpected tensor\(s\): transformer\.h\.0\.attn\.rogue\.weight"):
    load_hf(bad)

  def shrink(t):
    t["transformer.wpe.weight"] = t["transformer.wpe.weight"][:31]
    t["transformer.h.0.attn.c_attn.weight"] = t["transformer.h.0.attn.c_attn.weight"][:, :90]
  bad = _edit_weights(gpt2_dir, tmp_path / "shape", shrink)
  with pytest.raises(HFWeightsError) as e:
    load_hf(bad)
  msg = str(e.value)
  assert "transformer.wpe.weight has shape (31, 32), expected (32, 32)" in msg
  assert "transformer.h.0.attn.c_attn.weight has shape (32, 90), expected (32, 96)" in msg


def test_export_refuses_what_a_family_cannot_represent(gpt2_dir, tmp_path):
  model, params = load_hf(gpt2_dir)
  with pytest.raises(HFConfigError, match=r"llama cannot represent model\.activation"):
    save_hf(model, params, tmp_path / "x", family="llama")
  assert hfi.infer_family(model.cfg) == "gpt2"


def test_sharded_and_bin_checkpoints(gpt2_dir, tmp_path):
  model, params = load_hf(gpt2_dir)
  save_hf(model, params, tmp_path / "sharded", max_shard_bytes=20_000)
  index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
  assert len(set(index["weight_map"].values())) > 1
  assert_same_params(load_hf(tmp_path / "sharded")[1], params)
  tokens = batch(12)
  ref = hf_out(reload(tmp_path / "sharded", bert=False), tokens)
  np.testing.assert_allclose(ours(model, params, tokens), ref, **TOL)

  b = tmp_path / "bin"
  b.mkdir()
  (b / "config.json").write_text((gpt2_dir / "config.json").read_text())
  weights = hfi.read_safetensors(gpt2_dir / "model.safetensors")
  sd = {k: torch.from_numpy(np.array(v)) for k, v in weights.items()}
  torch.save(sd, b / "pytorch_model.bin")
  assert_same_params(load_hf(b)[1], params)


def test_tokenizer(tmp_path):
  from tokenizers import Tokenizer, models, pre_tokenizers
  vocab = {"[UNK]": 0, "hello": 1, "world": 2, "!": 3}
  tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.save(str(tmp_path / "tokenizer.json"))
  ours_tok = hfi.load_hf_tokenizer(tmp_path)
  assert ours_tok.vocab_size == 4
  assert list(ours_tok.encode("hello world !")) == tok.encode("hello world !").ids == [1, 2, 3]


# ---------------------------------------------------------------------------------------------
# The convert CLI

def _convert_module():
  spec = importlib.util.spec_from_file_location("tformer_convert", ROOT / "scripts" / "convert.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_convert_cli_roundtrip(tmp_path):
  pytest.importorskip("tformer_jax.checkpoint")
  from tformer_jax.checkpoint import restore_params
  from tformer_jax.config import ModelConfig, validate
  convert = _convert_module()
  m = build(CONFIGS["llama_gqa_untied"]())
  m.save_pretrained(tmp_path / "hf")
  from tokenizers import Tokenizer, models  # noqa: PLC0415 (a tokenizer.json that loads: copied as-is)
  Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(tmp_path / "hf" / "tokenizer.json"))
  assert convert.main(["--from-hf", str(tmp_path / "hf"), "--to", str(tmp_path / "work")]) == 0
  cfg, params = restore_params(tmp_path / "work")
  assert validate(cfg) == ModelConfig.from_config(cfg.model)
  assert cfg.data.tokenizer == "hf:" + str((tmp_path / "work" / "tokenizer.json").absolute())
  model = hfi.Transformer(ModelConfig.from_config(cfg.model))
  tokens = batch(12)
  ref = hf_out(m, tokens)
  np.testing.assert_allclose(ours(model, jax.tree.map(np.asarray, params), tokens), ref, **TOL)

  assert convert.main(["--from", str(tmp_path / "work"), "--to-hf", str(tmp_path / "back"),
                       "--family", "llama"]) == 0
  assert (tmp_path / "back" / "tokenizer.json").read_text() == (tmp_path / "hf" / "tokenizer.json").read_text()
  np.testing.assert_allclose(hf_out(reload(tmp_path / "back", bert=False), tokens), ref, **TOL)


def test_older_config_spellings():
  """transformers 4 config.json keys (top-level rope_theta / rope_scaling, rotary_pct, n_embed)."""
  llama = dict(model_type="llama", vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=4, max_position_embeddings=4096, rope_theta=5e5, rms_norm_eps=1e-5,
               rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 1024})
  cfg = hfi.model_config_from_hf(llama)
  assert (cfg.rope_theta, cfg.kv_heads, cfg.tie_embeddings) == (5e5, 4, False)
  assert cfg.rope_scaling == RopeScaling(type="llama3", factor=8.0, original_max_len=1024)
  neox = dict(model_type="gpt_neox", vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, rotary_pct=0.25, rotary_emb_base=1000, use_parallel_residual=True)
  cfg = hfi.model_config_from_hf(neox)
  assert (cfg.rotary_fraction, cfg.rope_theta, cfg.parallel_residual) == (0.25, 1000.0, True)
  bloom = dict(model_type="bloom", vocab_size=V, n_embed=48, n_layer=2, num_attention_heads=6)
  assert (hfi.model_config_from_hf(bloom).d_model, hfi.model_config_from_hf(bloom).num_heads) == (48, 6)
  with pytest.raises(HFConfigError, match="apply_residual_connection_post_layernorm"):
    hfi.model_config_from_hf({**bloom, "apply_residual_connection_post_layernorm": True})
  with pytest.raises(HFConfigError, match="longrope"):
    hfi.model_config_from_hf({**llama, "rope_scaling": {"rope_type": "longrope", "factor": 2.0}})
