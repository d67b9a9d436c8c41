"""The data tokenizer's vocabulary size, read from its files (manifest.json, tokenizer.json, an spm model), and
`resolved(cfg)`: model.vocab_size = 0 filled from it."""
from __future__ import annotations

import json
import pathlib
from typing import Any

import ml_collections

from tformer_jax.config.errors import ConfigError
from tformer_jax.config.mixture import parse_mixture


def tokenizer_vocab_size(data: Any) -> int | None:
  """The vocabulary of data.tokenizer (of data.corpus when it is a prepared dataset, of the first
  dataset of a mixture), read from the tokenizer's files without loading any text; None when it
  cannot be known here (a synthetic task's, a file that does not exist yet)."""
  corpus = str(data.get("corpus", "") or "")
  mixture = str(data.get("mixture", "") or "").strip()
  if mixture:
    try:
      corpus = parse_mixture(mixture)[0][0]
    except ConfigError:
      return None    # validate() names it
  if corpus.startswith("synthetic:"):
    return None
  try:
    if corpus.startswith("prepared:"):
      manifest = json.loads((pathlib.Path(corpus[len("prepared:"):]).expanduser() / "manifest.json").read_text())
      return int(manifest["tokenizer"]["vocab_size"])
    spec = str(data.get("tokenizer", "byte")).strip()
    if spec == "byte":
      return 256
    if spec == "bpe":
      return int(data.get("bpe_vocab_size", 2048))
    if spec.startswith("hf:"):
      path = pathlib.Path(spec[3:]).expanduser()
      path = path / "tokenizer.json" if path.is_dir() else path
      tok = json.loads(path.read_text(encoding="utf-8"))
      vocab = tok.get("model", {}).get("vocab", {})
      ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
      ids += [int(t["id"]) for t in tok.get("added_tokens", [])]
      return max(ids) + 1 if ids else None
    if spec.startswith("spm:"):
      import sentencepiece  # noqa: PLC0415 (only for an spm: tokenizer)
      return int(sentencepiece.SentencePieceProcessor(model_file=str(pathlib.Path(spec[4:]).expanduser()))
                 .get_piece_size())
  except (OSError, ValueError, KeyError, TypeError, RuntimeError):
    return None      # validate() and the data pipeline name the missing or broken file
  return None


def resolved(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """cfg with model.vocab_size = 0 replaced by the data tokenizer's vocabulary (a copy; cfg itself if
  there is nothing to resolve). A vocab_size set by hand stays: smaller than the tokenizer's is an
  error where the data is loaded; larger (padding to a multiple of 64, say) is allowed."""
  if "model" not in cfg or cfg.model.get("vocab_size", 0) != 0 or "data" not in cfg:
    return cfg
  n = tokenizer_vocab_size(cfg.data)
  if n is None:
    return cfg
  out = cfg.copy_and_resolve_references()
  with out.unlocked():
    out.model.vocab_size = n
  return out
