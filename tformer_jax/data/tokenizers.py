"""Tokenizers behind one protocol: bytes (lossless), a sentencepiece BPE trained on the corpus, HF json.

`get_tokenizer('byte' | 'bpe' | 'spm:PATH' | 'hf:PATH', corpus=..., vocab_size=..., cache_dir=...)`
builds one; `encode_corpus` tokenizes a whole corpus and caches the token array under the cache dir
(keyed by the corpus hash and the tokenizer's `name`, which identifies it exactly), so a second start
is instant. Every tokenizer returns int32 numpy ids.

Each tokenizer also states its end/start-of-document ids (`eos_id`, `bos_id`: None when it has none; the
byte tokenizer has none) and encodes a list of texts at once (`encode_batch(texts, num_threads=1)`, the
library's own batch call), which `tformer_jax.data.prepared` uses to tokenize corpora in worker processes.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import pathlib
from typing import Iterable, Iterator, Protocol, Sequence, runtime_checkable

import numpy as np
import sentencepiece as spm
from tokenizers import Tokenizer as HFTok

from tformer_jax.data.corpora import DataError, cache_root, write_atomic

log = logging.getLogger(__name__)

TOKENIZER_SPECS = ("byte", "bpe", "spm:PATH/model.model", "hf:PATH/tokenizer.json")


@runtime_checkable
class Tokenizer(Protocol):
  """What the data pipeline, the trainer and the sampler need from a tokenizer."""
  name: str          # identifies the tokenizer exactly (used as a cache key)
  vocab_size: int

  def encode(self, text: str | bytes) -> np.ndarray:
    """int32 ids of `text`."""

  def decode(self, ids: Iterable[int]) -> str:
    """The text of `ids` (undecodable bytes become U+FFFD)."""


def corpus_hash(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()[:16]


def as_utf8(text: str | bytes, what: str = "input") -> str:
  """`text` as str; bytes that are not valid UTF-8 raise DataError naming the first bad byte offset."""
  if isinstance(text, str):
    return text
  try:
    return bytes(text).decode("utf-8")
  except UnicodeDecodeError as e:
    bad = bytes(text[e.start:e.start + 4])
    raise DataError(
        f"{what} is not valid UTF-8: invalid byte sequence {bad!r} at byte offset {e.start} "
        f"({e.reason}). Re-encode the text to UTF-8 (e.g. `iconv -f latin1 -t utf-8`) or use "
        "tokenizer='byte', which takes any bytes.") from None


def _ids(ids: Iterable[int]) -> list[int]:
  return [int(i) for i in np.asarray(ids).reshape(-1)]


class ByteTokenizer:
  """One token per byte (vocab 256): lossless for any input, UTF-8 or not. No EOS/BOS id."""
  name = "byte"
  vocab_size = 256
  eos_id: int | None = None
  bos_id: int | None = None

  def encode(self, text: str | bytes) -> np.ndarray:
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return np.frombuffer(data, dtype=np.uint8).astype(np.int32)

  def encode_batch(self, texts: Sequence[str | bytes], num_threads: int = 1) -> list[np.ndarray]:
    return [self.encode(t) for t in texts]

  def decode_bytes(self, ids: Iterable[int]) -> bytes:
    return np.asarray(ids, dtype=np.int64).reshape(-1).astype(np.uint8).tobytes()

  def decode(self, ids: Iterable[int]) -> str:
    return self.decode_bytes(ids).decode("utf-8", errors="replace")


class SentencePieceTokenizer:
  """A sentencepiece model (BPE with byte fallback when trained here); lossless on UTF-8 text."""

  def __init__(self, model_path: str | os.PathLike, name: str | None = None):
    self.path = pathlib.Path(model_path)
    if not self.path.is_file():
      raise DataError(f"sentencepiece model {self.path} does not exist")
    proto = self.path.read_bytes()
    self._sp = spm.SentencePieceProcessor(model_proto=proto)
    self.vocab_size = int(self._sp.get_piece_size())
    self.name = name or f"spm-{corpus_hash(proto)}"
    self.eos_id = _id_or_none(self._sp.eos_id())   # our trained BPEs: unk 0, bos 1, eos 2
    self.bos_id = _id_or_none(self._sp.bos_id())

  @classmethod
  def train(cls, corpus: bytes, vocab_size: int, cache_dir: str | os.PathLike | None = None
            ) -> "SentencePieceTokenizer":
    """Train (or load from the cache) a BPE of `vocab_size` on `corpus`, keyed by corpus hash."""
    text = as_utf8(corpus, "the corpus (bpe tokenizer)")
    name = f"bpe{vocab_size}-{corpus_hash(corpus)}"
    path = cache_root(cache_dir) / "tokenizers" / f"{name}.model"
    if not path.is_file():
      log.info("training a %d-token sentencepiece BPE on %d bytes -> %s", vocab_size, len(corpus), path)
      write_atomic(path, _train_bpe(text, vocab_size))
    return cls(path, name=name)

  def encode(self, text: str | bytes) -> np.ndarray:
    return np.asarray(self._sp.encode(as_utf8(text)), dtype=np.int32)

  def encode_batch(self, texts: Sequence[str | bytes], num_threads: int = 1) -> list[np.ndarray]:
    """sentencepiece's batch encode on `num_threads` threads."""
    texts = [as_utf8(t) for t in texts]
    try:
      return self._sp.encode(texts, num_threads=num_threads, return_type="numpy")
    except ValueError:     # sentencepiece < 0.2.1 has no numpy return type
      return [np.asarray(ids, dtype=np.int32) for ids in self._sp.encode(texts, num_threads=num_threads)]

  def decode(self, ids: Iterable[int]) -> str:
    return self._sp.decode(_ids(ids))


def _id_or_none(i: int) -> int | None:
  return int(i) if i >= 0 else None


def _lines(text: str, max_chars: int = 4096) -> Iterator[str]:
  for line in text.split("\n"):
    for i in range(0, len(line), max_chars):
      chunk = line[i:i + max_chars]
      if chunk.strip():
        yield chunk


def _train_bpe(text: str, vocab_size: int) -> bytes:
  """A serialized sentencepiece BPE: identity normalization and no whitespace tricks (lossless)."""
  out = io.BytesIO()
  try:
    spm.SentencePieceTrainer.train(
        sentence_iterator=_lines(text), model_writer=out, vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, character_coverage=0.9999, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=False, split_digits=True,
        allow_whitespace_only_pieces=True, max_sentence_length=1 << 14,
        input_sentence_size=2_000_000, shuffle_input_sentence=True,
        num_threads=max(1, min(8, os.cpu_count() or 1)), minloglevel=2)
  except RuntimeError as e:
    raise DataError(f"sentencepiece BPE training failed for bpe_vocab_size={vocab_size}: {str(e).rstrip('.')}. "
                    "Byte fallback needs at least ~300 entries; a small corpus supports only a "
                    "small vocabulary.") from None
  return out.getvalue()


class HFTokenizer:
  """A Hugging Face `tokenizers` tokenizer.json (no special tokens added when encoding)."""

  def __init__(self, path: str | os.PathLike):
    p = pathlib.Path(path).expanduser()
    if p.is_dir():
      p = p / "tokenizer.json"
    if not p.is_file():
      raise DataError(f"hf:{path}: no tokenizer.json at {p}")
    data = p.read_bytes()
    try:
      self._tok = HFTok.from_str(data.decode("utf-8"))
    except Exception as e:  # the library raises plain Exceptions for malformed files
      raise DataError(f"hf:{path}: cannot load {p}: {e}") from None
    self.path = p
    self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
    self.name = f"hf-{corpus_hash(data)}"
    self.eos_id, self.bos_id = _hf_special_ids(self._tok, p.parent / "tokenizer_config.json")

  def encode(self, text: str | bytes) -> np.ndarray:
    enc = self._tok.encode(as_utf8(text), add_special_tokens=False)
    return np.asarray(enc.ids, dtype=np.int32)

  def encode_batch(self, texts: Sequence[str | bytes], num_threads: int = 1) -> list[np.ndarray]:
    """The library's `encode_batch`: on one thread when num_threads == 1, else on its own thread pool
    (all cores unless RAYON_NUM_THREADS was set before its first parallel call)."""
    texts = [as_utf8(t) for t in texts]
    with _tokenizers_parallelism(num_threads > 1):
      encs = self._tok.encode_batch(texts, add_special_tokens=False)
    return [np.asarray(e.ids, dtype=np.int32) for e in encs]

  def decode(self, ids: Iterable[int]) -> str:
    return self._tok.decode(_ids(ids), skip_special_tokens=False)


@contextlib.contextmanager
def _tokenizers_parallelism(on: bool) -> Iterator[None]:
  """TOKENIZERS_PARALLELISM for the calls inside (the library reads it at every batch call)."""
  key, old = "TOKENIZERS_PARALLELISM", os.environ.get("TOKENIZERS_PARALLELISM")
  os.environ[key] = "true" if on else "false"
  try:
    yield
  finally:
    if old is None:
      os.environ.pop(key, None)
    else:
      os.environ[key] = old


# Names an end-of-document token goes by, in the order we prefer them when tokenizer_config.json is absent.
_EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "[SEP]")
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "[CLS]")


def _hf_special_ids(tok: HFTok, config_path: pathlib.Path) -> tuple[int | None, int | None]:
  """(eos_id, bos_id): from tokenizer_config.json's eos_token/bos_token beside tokenizer.json when present,
  else the first special token with a conventional name; None when there is none."""
  named: dict[str, str | None] = {}
  if config_path.is_file():
    try:
      cfg = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
      cfg = {}
    for key in ("eos_token", "bos_token"):
      value = cfg.get(key) if isinstance(cfg, dict) else None
      named[key] = value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None

  def find(key: str, names: tuple[str, ...]) -> int | None:
    for name in ([named[key]] if named.get(key) else []) + list(names):
      i = tok.token_to_id(name)
      if i is not None:
        return int(i)
    return None

  return find("eos_token", _EOS_NAMES), find("bos_token", _BOS_NAMES)


def get_tokenizer(spec: str, *, corpus: bytes | None = None, vocab_size: int = 2048,
                  cache_dir: str | os.PathLike | None = None) -> Tokenizer:
  """'byte' | 'bpe' (trained on `corpus`, cached) | 'spm:PATH' | 'hf:PATH' (tokenizer.json or its dir)."""
  spec = spec.strip()
  if spec == "byte":
    return ByteTokenizer()
  if spec == "bpe":
    if corpus is None:
      raise DataError("tokenizer='bpe' is trained on the corpus: pass corpus=<bytes>")
    return SentencePieceTokenizer.train(corpus, vocab_size, cache_dir)
  if spec.startswith("spm:"):
    return SentencePieceTokenizer(pathlib.Path(spec[4:]).expanduser())
  if spec.startswith("hf:"):
    if not spec[3:]:
      raise DataError("hf:PATH needs the path of a tokenizer.json (or of a directory holding one)")
    return HFTokenizer(spec[3:])
  raise DataError(f"unknown tokenizer {spec!r}; expected one of {', '.join(TOKENIZER_SPECS)}")


def encode_corpus(tokenizer: Tokenizer, corpus: bytes, cache_dir: str | os.PathLike | None = None
                  ) -> np.ndarray:
  """The int32 tokens of the whole corpus, cached as .npy keyed by corpus hash + tokenizer name."""
  if isinstance(tokenizer, ByteTokenizer):
    return tokenizer.encode(corpus)       # cheaper than a cache read
  path = cache_root(cache_dir) / "tokens" / f"{corpus_hash(corpus)}-{tokenizer.name}.npy"
  if path.is_file():
    try:
      return np.load(path)
    except (OSError, ValueError):
      log.warning("ignoring unreadable token cache %s", path)
  tokens = tokenizer.encode(corpus)
  buf = io.BytesIO()
  np.save(buf, tokens)
  write_atomic(path, buf.getvalue())
  return tokens
