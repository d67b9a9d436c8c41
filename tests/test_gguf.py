"""GGUF import (tformer_jax/interop/gguf.py, tformer-convert --from-gguf): the real SmolLM2-135M-Instruct Q4_1 file
(tests/real_weights.py; skips without it) against transformers' own GGUF load, and bad input.

Parity: the imported weights are bit-identical to `AutoModelForCausalLM.from_pretrained(dir, gguf_file=NAME)`'s; in
float64 our logits equal transformers' to 1e-4 max abs (4.8e-5 measured; what remains is ours computing its norms,
RoPE and softmax in float32 and handing out float32 logits even in a float64 model); in float32 they differ by the
two forwards' rounding (2.5e-4 max abs asserted; 8.9e-5 measured with the prompts in one batched forward, 1.57e-4
with one forward per prompt: this model's residual stream reaches 2.5e4, where a float32 ulp is 2e-3, and
transformers' own float32 logits are 8e-5 from its float64 ones). Our tokenizer's ids equal transformers' GGUF
tokenizer's on ASCII, unicode, newlines, digits and the chat template applied."""
from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import real_weights

from tformer_jax.cli import convert
from tformer_jax.data.tokenizers import get_tokenizer
from tformer_jax.interop.hf import load_hf, read_safetensors

gguf = pytest.importorskip("gguf", reason="the gguf package (the `gguf` extra) reads GGUF files")

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    if n < 2:\n        return n\n",
           "Once upon a time, in a land far away, there lived"]
TEXTS = ["Hello, world! It's a test.", "naïve café — ünïcödé 你好，世界。 🙂", "line one\n\nline two\r\n\ttabbed  x",
         "In 2024, 3.14159 * 42 = 131.946...", "<|im_start|>user\nhi<|im_end|>\n", "   leading spaces and trailing   "]
MESSAGES = [{"role": "user", "content": "What is 12 + 30? Answer briefly."},
            {"role": "assistant", "content": "42."}, {"role": "user", "content": "Merci ! Et ensuite ?"}]


@pytest.fixture(scope="module")
def gguf_file() -> pathlib.Path:
  return real_weights.smollm2_gguf()


@pytest.fixture(scope="module")
def imported(gguf_file) -> pathlib.Path:
  """`tformer-convert --from-gguf` of the file (exit 0), made once per cache and converter version and shared
  with tests/test_recipe.py (real_weights.smollm2_hf)."""
  return real_weights.smollm2_hf()


@pytest.fixture(scope="module")
def reference(gguf_file):
  """transformers' own GGUF import: (model, tokenizer), float32."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  kw = dict(gguf_file=gguf_file.name)
  model = transformers.AutoModelForCausalLM.from_pretrained(gguf_file.parent, dtype=torch.float32, **kw).eval()
  return model, transformers.AutoTokenizer.from_pretrained(gguf_file.parent, **kw)


@pytest.fixture(scope="module")
def ours(imported):
  """Our (model, params) of the imported directory (load_hf), float32, read once for the two comparisons."""
  return load_hf(imported)


def test_directory_is_an_hf_model(imported):
  cfg = json.loads((imported / "config.json").read_text())
  assert (cfg["model_type"], cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_key_value_heads"]) == (
      "llama", 30, 576, 3)
  assert cfg["tie_word_embeddings"] and cfg["rope_parameters"]["rope_theta"] == 100000.0
  assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (1, 2, 2)
  tok_cfg = json.loads((imported / "tokenizer_config.json").read_text())
  assert tok_cfg["chat_template"].startswith("{% for message in messages %}")
  assert (tok_cfg["eos_token"], tok_cfg["add_bos_token"]) == ("<|im_end|>", False)
  tok = get_tokenizer(f"hf:{imported}")
  assert (tok.vocab_size, tok.eos_id, tok.bos_id) == (49152, 2, 1)


def _worst_logit_diff(model, params, ref_model, ref_tok) -> float:
  """Max abs difference of our logits from the torch model's over PROMPTS (argmax equal at every position).
  Ours in one forward of the prompts right-padded to the longest (one compile, not one per length): causal, so
  a prompt's positions never see the padding after them and only those positions are compared."""
  import torch
  rows = [ref_tok(prompt, return_tensors="pt").input_ids for prompt in PROMPTS]
  batch = np.full((len(rows), max(r.shape[1] for r in rows)), ref_tok.eos_token_id, np.int32)
  for i, ids in enumerate(rows):
    batch[i, :ids.shape[1]] = ids[0].numpy()
  logits = np.asarray(model.apply({"params": params}, jnp.asarray(batch)))
  worst = 0.0
  for prompt, ids, row in zip(PROMPTS, rows, logits):
    with torch.no_grad():
      want = ref_model(ids).logits[0].numpy()
    got = row[:ids.shape[1]]
    worst = max(worst, float(np.abs(got - want).max()))
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist(), prompt
  return worst


def test_weights_and_logits_match_transformers(imported, reference, ours):
  """The weights are bit-identical to transformers' dequantised ones; the logits differ only by float32 rounding in
  the two forwards: measured 8.9e-5 max abs (1.57e-4 with one forward per prompt; logits up to 41;
  transformers' own float32 is 8e-5 from float64)."""
  pytest.importorskip("torch")
  ref_model, ref_tok = reference
  weights = read_safetensors(imported / "model.safetensors")
  ref_sd = ref_model.state_dict()
  assert set(weights) == set(ref_sd) - {"lm_head.weight"}         # tied: the head is the embedding
  for name, w in weights.items():
    np.testing.assert_array_equal(np.asarray(w), ref_sd[name].numpy(), err_msg=name)
  model, params = ours
  assert _worst_logit_diff(model, params, ref_model, ref_tok) <= 2.5e-4


def test_float64_logits_equal_transformers(reference, ours):
  """The same comparison with both forwards in float64, so the two float32 forwards' rounding is gone: the issue's
  1e-4 holds (4.8e-5 measured, ours keeping norms, RoPE, softmax and its logits in float32)."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  ref_model, ref_tok = reference
  # transformers keeps a GGUF load's weights packed and its kernels compute in float32 whatever dtype is asked
  # for, so its float64 reference is its own Llama in float64 holding the weights that load dequantised
  ref64 = transformers.AutoModelForCausalLM.from_config(ref_model.config, dtype=torch.float64).eval()
  ref64.load_state_dict({k: v.to(torch.float64) for k, v in ref_model.state_dict().items()})
  model, params = ours
  with jax.enable_x64(True):
    model64 = type(model)(dataclasses.replace(model.cfg, dtype="float64", param_dtype="float64"))
    params64 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), params)
    assert _worst_logit_diff(model64, params64, ref64, ref_tok) <= 1e-4


def test_tokenizer_matches_transformers(imported, reference):
  _, ref_tok = reference
  ours = get_tokenizer(f"hf:{imported}")
  chat = ref_tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
  assert chat.startswith("<|im_start|>system\n")
  for text in [*TEXTS, chat]:
    want = ref_tok(text, add_special_tokens=True).input_ids      # the file says add_bos_token=False
    assert ours.encode(text).tolist() == want, text
    assert ours.decode(want) == text
  transformers = pytest.importorskip("transformers")
  mine = transformers.AutoTokenizer.from_pretrained(imported)   # our files, as transformers reads them
  assert mine.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == chat
  assert [mine(t).input_ids for t in TEXTS] == [ref_tok(t).input_ids for t in TEXTS]


def _tiny_gguf(path: pathlib.Path, arch: str = "llama", qtype=None) -> pathlib.Path:
  """A 1-layer llama-shaped GGUF written by the gguf package (token_embd of `qtype` raw bytes if given)."""
  w = gguf.GGUFWriter(str(path), arch)
  for key, v in (("block_count", 1), ("context_length", 32), ("embedding_length", 8), ("feed_forward_length", 16),
                 ("attention.head_count", 2), ("attention.head_count_kv", 1), ("vocab_size", 256)):
    w.add_uint32(f"{arch}.{key}", v)
  w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
  if qtype is None:
    w.add_tensor("token_embd.weight", np.zeros((256, 8), np.float32))
  else:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    w.add_tensor("token_embd.weight", np.zeros((256 * 8 // block * size,), np.uint8), raw_dtype=qtype)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path


@pytest.mark.parametrize("case, expect", [
    ("missing", "no such file"), ("not_gguf", "not a GGUF file"), ("truncated", "not a readable GGUF file"),
    ("arch", "unsupported architecture general.architecture='qwen2'"),
    ("quant", "quantisation type Q8_K is not supported")])
def test_bad_input_is_one_line_exit_2(case, expect, tmp_path, capsys):
  src = tmp_path / "model.gguf"
  if case == "not_gguf":
    src.write_text('{"model_type": "llama"}')
  elif case == "truncated":
    src.write_bytes(_tiny_gguf(tmp_path / "whole.gguf").read_bytes()[:40])
  elif case == "arch":
    _tiny_gguf(src, arch="qwen2")
  elif case == "quant":
    _tiny_gguf(src, qtype=gguf.GGMLQuantizationType.Q8_K)
  out = tmp_path / "out"
  assert convert.main(["--from-gguf", str(src), "--out", str(out)]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("error: ") and expect in err and "\n" not in err, err
  assert not out.exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
