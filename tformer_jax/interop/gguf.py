"""Import a GGUF checkpoint (llama.cpp's format) of a Llama-family model as a Hugging Face directory.

  gguf_to_hf("SmolLM2-135M-Instruct.Q4_1.gguf", "out/smollm2")   # tformer-convert --from-gguf=F --out=DIR
  -> config.json + model.safetensors (float32) + tokenizer.json + tokenizer_config.json (chat template,
     special tokens, add_bos) + generation_config.json: what `train.init_from=hf:DIR`, tformer-generate,
     tformer-eval and tformer-serve read, and what transformers' from_pretrained loads.

The file is read with the `gguf` package (llama.cpp's own reader, the `gguf` extra) and every tensor
dequantised with its `gguf.quants.dequantize`; nothing here re-implements a quantisation format. What is
ours is the mapping onto the HF layout, as transformers' GGUF loader does it: the tensor names, GGUF's
reversed (ne) shape order (the reader's arrays already come in row-major order), llama.cpp's permutation
of the q/k rows for its interleaved RoPE (undone, `_unpermute`), tied embeddings when output.weight is
absent, and the config from the metadata. The weights then go through the llama family's own import and
export (`save_hf`), so the output is checked like any HF directory and written whole (a partial directory
renamed into place). The tokenizer is rebuilt with `tokenizers` from tokenizer.ggml.*: a byte-level BPE
(tokenizer.ggml.model=gpt2, e.g. SmolLM2, Llama 3) with the pre-tokenizer split tokenizer.ggml.pre names;
for another tokenizer kind no tokenizer files are written (a note says so) and the weights still are.
"""
from __future__ import annotations

import json
import os
import pathlib
import sys
import tempfile
from collections.abc import Mapping
from typing import Any

import numpy as np

from tformer_jax.interop.families import HFConfigError, get_family
from tformer_jax.interop.hf.common import HFWeightsError
from tformer_jax.interop.hf.family import model_config_from_hf
from tformer_jax.interop.hf.model_io import EXPORT_FORMAT, EXPORT_MARKER, check_target, save_hf
from tformer_jax.interop.hf.weights import check_weights, import_tensors, unflatten

ARCHITECTURES = ("llama",)         # general.architecture values we import (Mistral GGUFs say llama too)

# GGUF tensor name -> HF name (llama), per layer with {i}; transformers' gguf_conversion_mapping has the same.
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias", "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_OUTER_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}

# tokenizer.ggml.pre -> how llama.cpp splits text before BPE (llama-vocab.cpp's regex_exprs per pre type).
_GPT2_TYPES = ("gpt2", "default", "mpt", "olmo", "jais")
_DIGIT_TYPES = ("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva")  # \p{N}, then GPT-2
_LLAMA3_TYPES = ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3", "pixtral")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CONTROL, _USER_DEFINED = 3, 4     # tokenizer.ggml.token_type values (llama.cpp's llama_token_type)


class GGUFError(HFWeightsError):
  """A GGUF file we cannot import (not GGUF, corrupt, an architecture or quantisation we do not read): one line."""


def _gguf():
  try:
    import gguf  # noqa: PLC0415 (optional, the `gguf` extra: only GGUF imports need it)
  except ImportError:
    raise GGUFError("reading a GGUF file needs the gguf package (pip install 'tformer-jax[gguf]')") from None
  return gguf


def read_gguf(path: str | os.PathLike) -> Any:
  """The `gguf.GGUFReader` of `path` (memory-mapped); GGUFError / FileNotFoundError in one line otherwise."""
  path = pathlib.Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"{path}: no such file (--from-gguf takes a .gguf file)")
  gguf = _gguf()
  with open(path, "rb") as f:
    magic = f.read(4)
  if magic != b"GGUF":
    raise GGUFError(f"{path}: not a GGUF file (it starts with {magic!r}, not b'GGUF')")
  try:
    return gguf.GGUFReader(path)
  except Exception as e:  # on purpose: the reader raises ValueError, IndexError, struct errors ... on corrupt files
    raise GGUFError(f"{path}: not a readable GGUF file ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
                    ) from None


def metadata(reader: Any) -> dict[str, Any]:
  """{key: value} of the file's metadata (arrays as lists, strings decoded)."""
  out = {}
  for key, field in reader.fields.items():
    try:
      out[key] = field.contents()
    except Exception as e:  # on purpose: a corrupt field names itself instead of failing the whole read
      raise GGUFError(f"metadata {key}: unreadable ({type(e).__name__}: {e})") from None
  return out


def _get(meta: Mapping[str, Any], key: str, kind: type, default: Any = None) -> Any:
  v = meta.get(key, default)
  if v is None:
    raise GGUFError(f"metadata {key} is missing")
  if kind is int and (isinstance(v, bool) or not isinstance(v, (int, np.integer))):
    raise GGUFError(f"metadata {key}={v!r} is not an integer")
  if kind is float and not isinstance(v, (int, float, np.number)):
    raise GGUFError(f"metadata {key}={v!r} is not a number")
  return kind(v)


def hf_config(meta: Mapping[str, Any], tensor_names: set[str]) -> dict[str, Any]:
  """The llama config.json dict the metadata describes (transformers' GGUF_CONFIG_MAPPING['llama'])."""
  arch = meta.get("general.architecture")
  if arch not in ARCHITECTURES:
    raise GGUFError(f"unsupported architecture general.architecture={arch!r} (supported: {', '.join(ARCHITECTURES)})")
  a = f"{arch}."
  if meta.get(a + "expert_count"):
    raise GGUFError(f"{arch} with {meta[a + 'expert_count']} experts (a mixture of experts) is not supported")
  scaling = meta.get(a + "rope.scaling.type", "none")
  if scaling != "none" or "rope_freqs.weight" in tensor_names:
    raise GGUFError(f"RoPE scaling ({a}rope.scaling.type={scaling!r}, or a rope_freqs tensor) is not supported")
  d, h = _get(meta, a + "embedding_length", int), _get(meta, a + "attention.head_count", int)
  if h < 1 or d % h:
    raise GGUFError(f"{a}attention.head_count={h} does not divide {a}embedding_length={d}")
  head_dim = _get(meta, a + "attention.key_length", int, default=d // h)
  rope_dims = _get(meta, a + "rope.dimension_count", int, default=head_dim)
  if rope_dims != head_dim:
    raise GGUFError(f"partial RoPE ({a}rope.dimension_count={rope_dims} of head size {head_dim}) is not supported")
  tokens = meta.get("tokenizer.ggml.tokens")
  vocab = _get(meta, a + "vocab_size", int, default=len(tokens) if tokens else None)
  return {
      "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": d,
      "intermediate_size": _get(meta, a + "feed_forward_length", int),
      "num_hidden_layers": _get(meta, a + "block_count", int), "num_attention_heads": h,
      "num_key_value_heads": _get(meta, a + "attention.head_count_kv", int, default=h), "head_dim": head_dim,
      "rms_norm_eps": _get(meta, a + "attention.layer_norm_rms_epsilon", float),
      "rope_theta": _get(meta, a + "rope.freq_base", float, default=10000.0),
      "max_position_embeddings": _get(meta, a + "context_length", int), "hidden_act": "silu",
      "tie_word_embeddings": "output.weight" not in tensor_names,
      "attention_bias": "blk.0.attn_q.bias" in tensor_names}


def hf_name(name: str) -> str:
  """The HF llama name of GGUF tensor `name`; GGUFError for one the llama layout does not have."""
  if name in _OUTER_NAMES:
    return _OUTER_NAMES[name]
  parts = name.split(".", 2)
  if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
    return f"model.layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}"
  raise GGUFError(f"tensor {name} has no place in a llama model")


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
  """Undo llama.cpp's q/k row permutation (convert_hf_to_gguf.py's LlamaModel.permute): each head's rows go
  from (rotary pair, half) back to HF's (half, rotary pair) order; transformers' LlamaTensorProcessor."""
  half = w.shape[0] // heads // 2
  return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensors(reader: Any, cfg: Mapping[str, Any]) -> dict[str, np.ndarray]:
  """{HF name: float32 array in HF's (out, in) layout} of every tensor, dequantised with gguf.quants."""
  gguf = _gguf()
  out = {}
  for t in reader.tensors:
    name = hf_name(t.name)
    try:
      w = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError:
      raise GGUFError(f"tensor {t.name}: quantisation type {t.tensor_type.name} is not supported by the gguf "
                      "package's dequantize") from None
    shape = tuple(int(n) for n in reversed(t.shape))      # GGUF lists ne (innermost first)
    w = np.asarray(w, dtype=np.float32).reshape(shape)
    if t.name.startswith("blk.") and ".attn_q." in t.name:
      w = _unpermute(w, cfg["num_attention_heads"])
    elif t.name.startswith("blk.") and ".attn_k." in t.name:
      w = _unpermute(w, cfg["num_key_value_heads"])
    out[name] = w
  return out


def _pre_tokenizer(pre: str | None) -> Any:
  """The `tokenizers` pre-tokenizer of llama.cpp's split for tokenizer.ggml.pre; None for one we do not know."""
  from tokenizers import Regex, pre_tokenizers  # noqa: PLC0415 (only when a tokenizer is written)

  if pre is None or pre in _GPT2_TYPES:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  if pre in _DIGIT_TYPES:
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
  if pre in _LLAMA3_TYPES:
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  return None


def _special(meta: Mapping[str, Any], tokens: list[str], key: str) -> str | None:
  i = meta.get(f"tokenizer.ggml.{key}")
  return tokens[int(i)] if isinstance(i, (int, np.integer)) and 0 <= int(i) < len(tokens) else None


def tokenizer_json(meta: Mapping[str, Any]) -> Any:
  """The `tokenizers.Tokenizer` tokenizer.ggml.* describes (a byte-level BPE); GGUFError naming what it
  cannot build."""
  from tokenizers import AddedToken, Tokenizer, decoders, models, processors  # noqa: PLC0415 (only when writing one)

  kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre")
  if kind != "gpt2":
    raise GGUFError(f"tokenizer.ggml.model={kind!r} is not a byte-level BPE (gpt2), the one kind rebuilt here")
  pre_tok = _pre_tokenizer(pre)
  if pre_tok is None:
    raise GGUFError(f"tokenizer.ggml.pre={pre!r} is a pre-tokenizer split we do not know")
  tokens, merges = list(meta.get("tokenizer.ggml.tokens") or []), list(meta.get("tokenizer.ggml.merges") or [])
  pairs = [tuple(m.split(" ")) for m in merges]
  if not tokens or any(len(p) != 2 for p in pairs):
    raise GGUFError("tokenizer.ggml.tokens is empty or tokenizer.ggml.merges holds a merge that is not a pair")
  tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=pairs, fuse_unk=False))
  tok.pre_tokenizer = pre_tok
  tok.decoder = decoders.ByteLevel()
  post = [processors.ByteLevel(trim_offsets=False)]
  bos = _special(meta, tokens, "bos_token_id")
  if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
    bos_id = tokens.index(bos)
    post.append(processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                              special_tokens=[(bos, bos_id)]))
  tok.post_processor = processors.Sequence(post)
  types = list(meta.get("tokenizer.ggml.token_type") or [])
  tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                          for t, k in zip(tokens, types) if k == _CONTROL])
  tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == _USER_DEFINED])
  return tok


def tokenizer_files(meta: Mapping[str, Any], out: pathlib.Path, max_len: int) -> dict[str, pathlib.Path]:
  """tokenizer.json + tokenizer_config.json (bos/eos/unk/pad tokens, add_bos/add_eos, chat template) in `out`;
  {} with a one-line note on stderr where the tokenizer is not one we rebuild."""
  try:
    tok = tokenizer_json(meta)
  except GGUFError as e:
    print(f"note: no tokenizer files written ({e}); the weights are", file=sys.stderr)
    return {}
  tokens = list(meta["tokenizer.ggml.tokens"])
  tok.save(str(out / "tokenizer.json"))
  cfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": int(max_len),
                         "clean_up_tokenization_spaces": False,
                         "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
                         "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False))}
  for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"),
                    ("pad_token", "padding_token_id")):
    cfg[name] = _special(meta, tokens, key)
  if isinstance(meta.get("tokenizer.chat_template"), str):
    cfg["chat_template"] = meta["tokenizer.chat_template"]
  (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
  return {"tokenizer.json": out / "tokenizer.json", "tokenizer_config.json": out / "tokenizer_config.json"}


def _token_ids(meta: Mapping[str, Any]) -> dict[str, int | None]:
  ids = {k: meta.get(f"tokenizer.ggml.{g}") for k, g in (("bos_token_id", "bos_token_id"),
                                                          ("eos_token_id", "eos_token_id"),
                                                          ("pad_token_id", "padding_token_id"))}
  ids = {k: int(v) if isinstance(v, (int, np.integer)) else None for k, v in ids.items()}
  if ids["pad_token_id"] is None:
    ids["pad_token_id"] = ids["eos_token_id"]
  return ids


def load_gguf(path: str | os.PathLike) -> tuple[Any, dict[str, Any], dict[str, Any]]:
  """(ModelConfig, params, metadata) of a GGUF llama checkpoint, through the llama family's import (checked like
  an HF directory: HFConfigError / HFWeightsError / GGUFError in one line naming the file)."""
  reader = read_gguf(path)
  meta = metadata(reader)
  names = {t.name for t in reader.tensors}
  try:
    hf_cfg = hf_config(meta, names)
    family = get_family("llama")
    cfg = model_config_from_hf(hf_cfg, family)
    tensors = hf_tensors(reader, hf_cfg)
    check_weights(family, cfg, hf_cfg, {k: tuple(v.shape) for k, v in tensors.items()}, str(path),
                  dict.fromkeys(tensors, pathlib.Path(path).name))
    flat = import_tensors(family, cfg, tensors, where=str(path))
  except (GGUFError, HFConfigError, HFWeightsError) as e:
    msg = str(e)
    raise type(e)(msg if msg.startswith(str(path)) else f"{path}: {msg}") from None
  return cfg, unflatten(flat), meta


def gguf_to_hf(path: str | os.PathLike, out: str | os.PathLike, overwrite: bool = False) -> pathlib.Path:
  """Write the GGUF checkpoint `path` as the HF directory `out` (float32 weights, tokenizer, chat template);
  written whole and atomically by `save_hf`: `out` must be missing, empty or (overwrite) an earlier output."""
  check_target(pathlib.Path(out), overwrite, EXPORT_MARKER, EXPORT_FORMAT, "an HF export")  # refused before reading
  cfg, params, meta = load_gguf(path)
  with tempfile.TemporaryDirectory() as tmp:
    files = tokenizer_files(meta, pathlib.Path(tmp), cfg.max_len)
    return save_hf(cfg, params, out, "llama", token_ids=_token_ids(meta), files=files, overwrite=overwrite,
                   source={"from_gguf": str(pathlib.Path(path).absolute())})
