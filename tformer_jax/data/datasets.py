"""`build_dataset(data_cfg)`: the corpus (or mixture, and validation corpus) of a data section opened and
split into train and validation token spans; a synthetic task's vocabulary; `tokenizer_for`, the tokenizer
of the batches without preparing anything."""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np

from tformer_jax import config as config_lib
from tformer_jax.data import prepared as prepared_lib, synthetic
from tformer_jax.data.cache import prepared_location
from tformer_jax.data.corpora import DataError, load_documents
from tformer_jax.data.settings import PACKINGS, setting
from tformer_jax.data.tokenizers import Tokenizer, get_tokenizer
from tformer_jax.data.tokens import PreparedTokens, Tokens, as_tokens, split_documents

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class MixPart:
  """One dataset of a mixture: its train and validation spans and its weight."""
  name: str
  weight: float
  train: Tokens
  val: Tokens


@dataclasses.dataclass
class Dataset:
  """Train and validation token spans (`Tokens`, or arrays), or (both None) a synthetic task.
  A mixture lists its datasets in `mixture`; train/val_tokens are then the first one's."""
  tokenizer: Tokenizer
  train_tokens: Tokens | np.ndarray | None
  val_tokens: Tokens | np.ndarray | None
  task: synthetic.SyntheticTask | None = None
  mixture: tuple[MixPart, ...] = ()

  @property
  def vocab_size(self) -> int:
    return self.tokenizer.vocab_size

  def parts(self) -> tuple[MixPart, ...]:
    """The datasets rows are drawn from (one, unless a mixture)."""
    if self.mixture:
      return self.mixture
    return (MixPart("corpus", 1.0, as_tokens(self.train_tokens), as_tokens(self.val_tokens)),)

@dataclasses.dataclass
class _Opened:
  name: str
  ds: prepared_lib.PreparedDataset
  tokenizer: Tokenizer
  train: PreparedTokens
  val: PreparedTokens | None



def _open_split(spec: str, data_cfg: Any, *, whole: bool = False) -> _Opened:
  """Corpus `spec` opened and split (`whole`: all of it is the train span, no val span). A named
  corpus's tokenizer is the one its spec builds (cached), a prepared directory's the one inside it."""
  path, tok = prepared_location(spec, data_cfg)
  ds = prepared_lib.open_prepared(path)
  tok = ds.tokenizer() if tok is None else tok
  offsets = np.asarray(ds.doc_offsets, np.int64)
  total = int(offsets[-1])
  if whole:
    return _Opened(spec, ds, tok, PreparedTokens(path, 0, total, np.unique(offsets[:-1]), ds), None)
  seq_len, val_fraction = int(setting(data_cfg, "seq_len")), float(setting(data_cfg, "val_fraction"))
  cut = split_documents(offsets, val_fraction, seq_len + 1)
  if cut < 0:
    cut = total - int(round(total * val_fraction))
    if ds.num_documents > 1:
      log.warning("data: %s: no document boundary leaves seq_len+1=%d tokens on both sides of a "
                  "%.3f validation split; validation is the token tail", spec, seq_len + 1, val_fraction)
  starts = offsets[:-1]
  train = PreparedTokens(path, 0, cut, np.unique(starts[starts < cut]), ds)
  val = PreparedTokens(path, cut, total, np.unique(np.concatenate([[0], starts[starts >= cut] - cut])), ds)
  if min(len(train), len(val)) < seq_len + 1:
    raise DataError(
        f"corpus {spec!r} is too short: {total} tokens with tokenizer {ds.manifest['tokenizer']['name']!r} "
        f"split into train={len(train)} and validation={len(val)} (val_fraction={val_fraction}); each split "
        f"needs at least seq_len+1={seq_len + 1} tokens. Use more text, a smaller seq_len or a "
        "larger val_fraction.")
  return _Opened(spec, ds, tok, train, val)



def build_dataset(data_cfg: Any) -> Dataset:
  """Open (preparing named corpora once, cached) and split the data of `data_cfg`; errors when a split
  can't hold one window."""
  spec, seq_len = str(setting(data_cfg, "corpus")), int(setting(data_cfg, "seq_len"))
  if seq_len <= 0:
    raise DataError(f"data.seq_len must be positive, got {seq_len}")
  mixture = setting(data_cfg, "mixture")
  if spec.startswith("synthetic:") and not mixture:
    task = synthetic.parse_synthetic(spec, seq_len)
    return Dataset(task.vocab, None, None, task=task)
  packing = str(setting(data_cfg, "packing"))
  if packing not in PACKINGS:
    raise DataError(f"unknown data.packing {packing!r}; expected 'packed' or 'document'")
  val_spec = str(setting(data_cfg, "val_corpus") or "").strip()
  entries = config_lib.parse_mixture(mixture) if mixture else [(spec, 1.0)]
  opened: list[_Opened] = []
  for name, _ in entries:
    if name.startswith("synthetic:"):
      raise DataError(f"data.mixture: {name!r}: synthetic tasks cannot be mixed with text")
    opened.append(_open_split(name, data_cfg, whole=bool(val_spec)))
  if val_spec:
    v = _open_split(val_spec, data_cfg, whole=True)
    if len(v.train) < seq_len + 1:
      raise DataError(f"data.val_corpus {val_spec!r} has {len(v.train)} tokens, fewer than seq_len+1={seq_len + 1}")
    for o in opened:
      o.val = v.train
    opened_all = opened + [v]
  else:
    opened_all = opened
  first = opened[0]
  for o in opened_all[1:]:
    if _tokenizer_id(o) != _tokenizer_id(first):
      field = "data.val_corpus" if o is opened_all[-1] and val_spec else "data.mixture"
      raise DataError(f"{field}: {o.name!r} was tokenized with {o.tokenizer.name!r}, {first.name!r} with "
                      f"{first.tokenizer.name!r}; training and validation data need one tokenizer")
  tok = first.tokenizer
  mix = tuple(MixPart(o.name, w, o.train, o.val) for o, (_, w) in zip(opened, entries))
  for p in mix:
    log.info("data: %s%s, %d tokens (train %d, val %d%s), %d train documents, tokenizer %s (vocab %d), "
             "packing %s", p.name, f" (weight {p.weight:.3f})" if len(mix) > 1 else "",
             len(p.train) + (0 if val_spec else len(p.val)), len(p.train), len(p.val),
             f" from {val_spec}" if val_spec else "", len(p.train.doc_starts), tok.name, tok.vocab_size, packing)
  return Dataset(tok, mix[0].train, mix[0].val, mixture=mix if len(mix) > 1 else ())


def prepared_datasets(ds: Dataset) -> list[prepared_lib.PreparedDataset]:
  """The prepared datasets `ds` reads, each once, in order (none for a synthetic task)."""
  if ds.task is not None:
    return []
  out: dict[str, prepared_lib.PreparedDataset] = {}
  for part in ds.parts():
    for t in (part.train, part.val):
      if isinstance(t, PreparedTokens):
        opened = t._ds if t._ds is not None else prepared_lib.open_prepared(t.path)
        out.setdefault(str(opened.path.absolute()), opened)
  return list(out.values())


def tokenizer_for(data_cfg: Any) -> Tokenizer:
  """The tokenizer the batches of `data_cfg` are in, without preparing or splitting anything: a prepared
  dataset's own (the first of a mixture), a synthetic task's vocabulary, else data.tokenizer (a 'bpe'
  from the cache, trained on the corpus if missing) -- for generation and tools that only decode."""
  mixture = setting(data_cfg, "mixture")
  spec = config_lib.parse_mixture(mixture)[0][0] if mixture else str(setting(data_cfg, "corpus")).strip()
  if spec.startswith("synthetic:"):
    return synthetic.parse_synthetic(spec, int(setting(data_cfg, "seq_len"))).vocab
  if spec.startswith("prepared:"):
    return prepared_lib.open_prepared(prepared_location(spec, data_cfg)[0]).tokenizer()
  cache_dir = setting(data_cfg, "cache_dir") or None
  tok_spec = str(setting(data_cfg, "tokenizer")).strip()
  corpus = b"".join(load_documents(spec, cache_dir)) if tok_spec == "bpe" else None
  return get_tokenizer(tok_spec, corpus=corpus, vocab_size=int(setting(data_cfg, "bpe_vocab_size")),
                       cache_dir=cache_dir)


def _tokenizer_id(o: _Opened) -> tuple[Any, ...]:
  """What makes two datasets' token ids mean the same: the tokenizer's checksum (and EOS)."""
  t = o.ds.manifest["tokenizer"]
  return (t.get("sha256") or t.get("name"), o.ds.eos_id)

