"""Data: corpora (shakespeare, kjv, text:PATH), prepared datasets (prepared:DIR), tokenizers, grain batch
pipelines (packed or document-aware, mixtures), synthetic tasks."""
from tformer_jax.data.corpora import DataError, cache_root, load_corpus, load_documents, split_tokens
from tformer_jax.data.pipeline import (
    BatchIterator,
    Dataset,
    PreparedTokens,
    build_dataset,
    eval_batches,
    tokenizer_for,
    train_iterator,
)
from tformer_jax.data.synthetic import SyntheticTask, SyntheticVocab, exact_match_accuracy
from tformer_jax.data.tokenizers import (
    ByteTokenizer,
    HFTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    encode_corpus,
    get_tokenizer,
)

__all__ = [
    "BatchIterator", "ByteTokenizer", "DataError", "Dataset", "HFTokenizer", "PreparedTokens",
    "SentencePieceTokenizer", "SyntheticTask", "SyntheticVocab", "Tokenizer", "build_dataset", "cache_root",
    "encode_corpus", "eval_batches", "exact_match_accuracy", "get_tokenizer", "load_corpus", "load_documents",
    "split_tokens", "tokenizer_for", "train_iterator",
]
