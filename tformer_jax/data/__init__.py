"""Data: corpora (shakespeare, kjv, text:PATH), prepared datasets (prepared:DIR), tokenizers, grain batch
pipelines (packed or document-aware, mixtures), synthetic tasks.

The names below load their module on first use: `tformer_jax.data.prepared` and `.tokenizers` stay free
of grain and jax, so tformer-prepare's worker processes start in a fraction of a second.
"""
import importlib
from typing import Any

_EXPORTS = {
    "DataError": "corpora", "cache_root": "corpora", "load_corpus": "corpora", "load_documents": "corpora",
    "split_tokens": "corpora",
    "BatchIterator": "pipeline", "Dataset": "pipeline", "PreparedTokens": "pipeline", "build_dataset": "pipeline",
    "eval_batches": "pipeline", "tokenizer_for": "pipeline", "train_iterator": "pipeline",
    "SyntheticTask": "synthetic", "SyntheticVocab": "synthetic", "exact_match_accuracy": "synthetic",
    "ByteTokenizer": "tokenizers", "HFTokenizer": "tokenizers", "SentencePieceTokenizer": "tokenizers",
    "Tokenizer": "tokenizers", "encode_corpus": "tokenizers", "get_tokenizer": "tokenizers",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
  if name in _EXPORTS:
    return getattr(importlib.import_module(f"tformer_jax.data.{_EXPORTS[name]}"), name)
  raise AttributeError(f"module 'tformer_jax.data' has no attribute {name!r}")
