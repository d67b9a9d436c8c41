"""Tokenizer files: which ones a model directory carries, a byte-level tokenizer.json, special token ids,
loading a tokenizer."""
from __future__ import annotations

import json
import os
import pathlib
from typing import Any

from tformer_jax.data.tokenizers import get_tokenizer

# Files beside an HF model that describe its tokenizer (chat template included) and generation: carried by
# tformer-convert (`tokenizer_files` also takes any other tokenizer*.json/*.model of the directory).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt",
                   "tokenizer.model", "spiece.model", "generation_config.json")
_TOKENIZER_GLOBS = ("tokenizer*.json", "tokenizer*.model", "*.tiktoken")


def tokenizer_files(d: str | os.PathLike) -> dict[str, pathlib.Path]:
  """{relative name: file} of every tokenizer, chat-template and generation file in the HF directory `d`
  (`TOKENIZER_FILES` and the tokenizer*.json / tokenizer*.model / *.tiktoken beside them)."""
  d = pathlib.Path(d)
  names = [n for n in TOKENIZER_FILES if (d / n).is_file()]
  for pattern in _TOKENIZER_GLOBS:
    names += sorted(str(f.relative_to(d)) for f in d.glob(pattern) if f.is_file())
  return {n: d / n for n in dict.fromkeys(names)}


def byte_tokenizer_files(out_dir: str | os.PathLike, max_len: int) -> dict[str, pathlib.Path]:
  """tokenizer.json + tokenizer_config.json in `out_dir` for the byte tokenizer (id = the byte's value),
  which transformers' PreTrainedTokenizerFast loads with the same ids: a byte-level BPE with no merges."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: PLC0415 (only for a byte-level export)
  from tokenizers.pre_tokenizers import ByteLevel  # noqa: PLC0415

  chars = ByteLevel.alphabet()                       # the 256 printable stand-ins of the bytes, GPT-2's map
  table = _bytes_to_unicode()
  assert set(chars) == set(table.values())
  tok = Tokenizer(models.BPE(vocab={table[b]: b for b in range(256)}, merges=[]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  tok.decoder = decoders.ByteLevel()
  out = pathlib.Path(out_dir)
  tok.save(str(out / "tokenizer.json"))
  (out / "tokenizer_config.json").write_text(json.dumps(
      {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": int(max_len), "clean_up_tokenization_spaces":
       False}, indent=2) + "\n")
  return {"tokenizer.json": out / "tokenizer.json", "tokenizer_config.json": out / "tokenizer_config.json"}


def sentencepiece_tokenizer_files(model_file: str | os.PathLike, out_dir: str | os.PathLike, max_len: int
                                  ) -> dict[str, pathlib.Path]:
  """tokenizer.model (the sentencepiece model itself) + tokenizer.json + tokenizer_config.json in `out_dir`,
  which transformers' AutoTokenizer loads with sentencepiece's ids: the tokenizer.json is transformers' own
  conversion of the model proto (`SpmConverter.build_tokenizer_from_spm_proto`, which follows its normalizer
  spec: no dummy prefix, identity normalisation, byte fallback for ours). Needs transformers (and protobuf):
  ImportError otherwise."""
  from transformers.convert_slow_tokenizer import SpmConverter, import_protobuf  # noqa: PLC0415 (the reference extra)

  model_file, out = pathlib.Path(model_file), pathlib.Path(out_dir)
  proto = import_protobuf().ModelProto()
  proto.ParseFromString(model_file.read_bytes())
  vocab = {piece.piece: i for i, piece in enumerate(proto.pieces)}
  tok = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab, legacy=False)
  if tok is None:
    raise ValueError(f"{model_file}: transformers cannot convert this sentencepiece model type")
  tok.save(str(out / "tokenizer.json"))
  (out / "tokenizer.model").write_bytes(model_file.read_bytes())
  spec = proto.trainer_spec
  named = {f"{kind}_token": proto.pieces[i].piece for kind, i in (("unk", spec.unk_id), ("bos", spec.bos_id),
                                                                   ("eos", spec.eos_id), ("pad", spec.pad_id))
           if 0 <= i < len(proto.pieces)}
  (out / "tokenizer_config.json").write_text(json.dumps(
      {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": int(max_len), "add_bos_token": False,
       "add_eos_token": False, "clean_up_tokenization_spaces": False, **named}, indent=2) + "\n")
  return {n: out / n for n in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")}


def _bytes_to_unicode() -> dict[int, str]:
  """GPT-2's byte -> printable character map (what the ByteLevel pre-tokenizer emits)."""
  keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + list(
      range(ord("\xae"), ord("\xff") + 1))
  chars, n = dict(zip(keep, keep)), 0
  for b in range(256):
    if b not in chars:
      chars[b] = 256 + n
      n += 1
  return {b: chr(c) for b, c in chars.items()}


def special_token_ids(tokenizer: Any, hf_dir: str | os.PathLike | None = None) -> dict[str, int | None]:
  """{'bos_token_id', 'eos_token_id', 'pad_token_id'}: an HF directory's own (config.json,
  generation_config.json) where it states them, else the tokenizer's bos/eos ids; pad falls back to
  eos (what Llama-style models use), None where there is nothing to say."""
  out: dict[str, int | None] = {"bos_token_id": getattr(tokenizer, "bos_id", None),
                                "eos_token_id": getattr(tokenizer, "eos_id", None), "pad_token_id": None}
  for name in ("config.json", "generation_config.json"):
    f = pathlib.Path(hf_dir) / name if hf_dir is not None else None
    if f is not None and f.is_file():
      try:
        stated = json.loads(f.read_text())
      except (OSError, ValueError):
        continue
      for key in out:
        value = stated.get(key) if isinstance(stated, dict) else None
        if isinstance(value, list):          # generation_config may list several eos ids
          value = value[0] if value else None
        if isinstance(value, int):
          out[key] = value
  if out["pad_token_id"] is None:
    out["pad_token_id"] = out["eos_token_id"]
  return out


_MAX_TEMPLATE_BYTES = 4 << 20   # real chat templates are kilobytes


def chat_template(d: str | os.PathLike) -> str | None:
  """The default Jinja chat template of the HF directory `d` (None if it has none), wherever transformers
  keeps it: chat_template.jinja (what transformers 5 saves), chat_template.json ({"chat_template": ...}),
  or tokenizer_config.json's "chat_template" (a string, or named templates: the 'default' one). A file
  that is not UTF-8 / JSON, or too large, counts as no template."""
  d = pathlib.Path(d)
  if d.is_file():                      # a tokenizer.json path: its directory
    d = d.parent

  def read(name: str) -> str | None:
    f = d / name
    try:
      if not f.is_file() or f.stat().st_size > _MAX_TEMPLATE_BYTES:
        return None
      return f.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
      return None

  text = read("chat_template.jinja")
  if text is not None:
    return text
  for name in ("chat_template.json", "tokenizer_config.json"):
    raw = read(name)
    try:
      template = json.loads(raw).get("chat_template") if raw is not None else None
    except (ValueError, AttributeError):
      template = None
    if isinstance(template, list):     # named templates: the default one
      template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                      None)
    if isinstance(template, str):
      return template
  return None


def load_hf_tokenizer(path: str | os.PathLike) -> Any:
  """Our tokenizer (tformer_jax.data.tokenizers) of an HF directory's tokenizer.json."""
  return get_tokenizer("hf:" + os.fspath(path))
