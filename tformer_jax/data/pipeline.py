"""Grain batch pipelines over prepared (memory-mapped) token data or a synthetic task, resumable and
process-sharded.

Every text corpus is read as a prepared dataset (tformer_jax/data/prepared.py: token shards and a
document index, memory-mapped, never loaded whole): `prepared:DIR` directly, and the named corpora
(shakespeare, kjv, text:PATH) prepared once into the cache (cache_root()/prepared/<key>) from their
documents (`corpora.load_documents`), so there is one pipeline. `build_dataset(data_cfg)` opens and
splits; `train_iterator` yields {'inputs', 'targets'} int32 (batch_size // process_count, seq_len),
targets = inputs shifted by one (each row is a window of seq_len+1 tokens).

Validation holds whole documents: the tail documents closest to `val_fraction` of the tokens (a
corpus of one document falls back to its token tail), or all of `data.val_corpus`.

data.packing
  packed    documents concatenated (with EOS when the tokenizer has one), attention crosses them;
            no 'loss_mask' (every position counts: use `batch.get('loss_mask')`)
  document  the same windows, plus 'segment_ids' (1, 2, ... per document in the row), 'positions'
            (restarting at 0 in each document) and a float32 'loss_mask' that is 0 where the target
            is the first token of a document (unpredictable once attention stays in its document)
Synthetic batches add their own 'loss_mask' over the answer span.

The pipeline is a grain MapDataset of global rows: row g of the run is a pure function of (seed, g):
  random   window start drawn from np.random.default_rng([seed, g]) over the train split
  packed   consecutive windows (stride seq_len) in an order reshuffled every epoch (grain shuffle)
  mixture  (data.mixture 'SPEC=W,SPEC=W'): blocks of MIX_BLOCK rows hold each dataset's quota of
           rows (its weight, largest-remainder rounded) in an order drawn from rng([seed, block]);
           row g is row n of its dataset's own stream (random/packed as above, seeded per dataset)
Process p of P takes rows g = p, p+P, p+2P, ... and batches them, so the processes' shards are
disjoint and together they form the global batch rows [step*B, (step+1)*B) whatever P is. The
iterator (`BatchIterator`, a grain DatasetIterator) resumes exactly: its state is the batch index.
"""
from __future__ import annotations

import dataclasses
import fcntl
import functools
import hashlib
import json
import logging
import mmap
import os
import pathlib
import shutil
import sys
from typing import Any, Iterator, Sequence

import grain
import numpy as np
from absl import flags

from tformer_jax.data import prepared as prepared_lib, synthetic
from tformer_jax.data.corpora import DataError, cache_root, load_documents, sha256_file, write_atomic
from tformer_jax.data.tokenizers import Tokenizer, get_tokenizer

log = logging.getLogger(__name__)

PACKINGS = ("packed", "document")
SAMPLINGS = ("random", "packed")
MIX_BLOCK = 1000            # mixture rows per block: proportions are exact per block, to 1/MIX_BLOCK
MIX_LOG_EVERY = 1000        # batches between two log lines of a mixture's realised proportions
PREPARED_KEY_VERSION = 1    # bump when the way named corpora become prepared datasets changes

_FIELDS = dict(corpus="shakespeare", tokenizer="byte", bpe_vocab_size=2048, seq_len=256,
               batch_size=32, val_fraction=0.05, sampling="random", packing="packed", mixture="",
               val_corpus="", cache_dir="", worker_count=0, seed=0)


def _cfg(data_cfg: Any, name: str) -> Any:
  try:
    return data_cfg[name]
  except (KeyError, AttributeError):
    return _FIELDS[name]


# --- token spans ----------------------------------------------------------------------------------

class Tokens:
  """A read-only span of a token stream with its document starts (relative, sorted, starting at 0).

  `tokens[a:b]` is an int32 copy; `len(tokens)` its length. `ArrayTokens` holds an array;
  `PreparedTokens` reads a prepared dataset's memory-mapped shards."""
  doc_starts: np.ndarray

  def __len__(self) -> int:
    raise NotImplementedError

  def read(self, start: int, stop: int) -> np.ndarray:
    raise NotImplementedError

  def __getitem__(self, index: slice) -> np.ndarray:
    if not isinstance(index, slice) or index.step not in (None, 1):
      raise TypeError(f"{type(self).__name__} supports contiguous slices only, got {index!r}")
    start, stop, _ = index.indices(len(self))
    return self.read(start, max(start, stop))

  def __array__(self, dtype=None, copy=None) -> np.ndarray:
    out = self.read(0, len(self))
    return out if dtype is None else out.astype(dtype)


class ArrayTokens(Tokens):
  """Tokens held in memory (tests, notebooks); one document unless `doc_starts` says otherwise."""

  def __init__(self, tokens: np.ndarray, doc_starts: np.ndarray | None = None):
    self.tokens = np.asarray(tokens)
    self.doc_starts = np.unique(np.concatenate([[0], np.asarray([] if doc_starts is None else doc_starts)])
                                ).astype(np.int64)

  def __len__(self) -> int:
    return len(self.tokens)

  def read(self, start: int, stop: int) -> np.ndarray:
    return self.tokens[start:stop].astype(np.int32)


RELEASE_BYTES = 2 << 20     # page-cache folios can map up to 2 MiB around one faulted page


class PreparedTokens(Tokens):
  """Global tokens [start, stop) of the prepared dataset at `path`, read from its memory-mapped shards.

  Nothing is loaded: a window is copied out of the shard's np.memmap, and the mapped pages around it
  are then released (madvise DONTNEED, a no-op for the data, which stays in the page cache): large
  page-cache folios otherwise map up to 2 MiB per random read into this process, and resident memory
  would grow towards the corpus size. Pickles as its path (grain worker processes reopen it)."""

  def __init__(self, path: str | os.PathLike, start: int, stop: int, doc_starts: np.ndarray,
               ds: prepared_lib.PreparedDataset | None = None):
    self.path, self.start, self.stop = str(path), int(start), int(stop)
    self.doc_starts = np.asarray(doc_starts, np.int64)
    self._ds = ds
    self._maps: list[tuple[np.ndarray, Any, int]] | None = None
    self._shard_starts: np.ndarray | None = None

  def __getstate__(self) -> dict[str, Any]:
    return {"path": self.path, "start": self.start, "stop": self.stop, "doc_starts": self.doc_starts}

  def __setstate__(self, state: dict[str, Any]) -> None:
    self.__init__(**state)

  def __len__(self) -> int:
    return self.stop - self.start

  def _open(self) -> None:
    ds = self._ds if self._ds is not None else prepared_lib.open_prepared(self.path)
    maps = []
    for tokens, _ in ds.shards:
      mm = getattr(tokens, "_mmap", None)
      delta = tokens.ctypes.data - np.frombuffer(mm, np.uint8).ctypes.data if mm is not None else 0
      maps.append((tokens, mm, delta))
    sizes = np.array([len(t) for t, _, _ in maps], np.int64)
    self._shard_starts = np.concatenate([[0], np.cumsum(sizes)])
    self._ds, self._maps = ds, maps

  @property
  def memmaps(self) -> list[np.ndarray]:
    """The shards' token arrays (np.memmap)."""
    if self._maps is None:
      self._open()
    return [t for t, _, _ in self._maps]

  def read(self, start: int, stop: int) -> np.ndarray:
    if self._maps is None:
      self._open()
    a, b = self.start + start, self.start + stop
    out = np.empty(b - a, np.int32)
    i = int(np.searchsorted(self._shard_starts, a, side="right")) - 1
    pos = a
    while pos < b:
      tokens, mm, delta = self._maps[i]
      lo = pos - int(self._shard_starts[i])
      hi = min(b, int(self._shard_starts[i + 1])) - int(self._shard_starts[i])
      out[pos - a:pos - a + hi - lo] = tokens[lo:hi]
      if mm is not None:
        item = tokens.itemsize
        x = (delta + lo * item) // RELEASE_BYTES * RELEASE_BYTES
        y = min(len(mm), -(-(delta + hi * item) // RELEASE_BYTES) * RELEASE_BYTES)
        mm.madvise(mmap.MADV_DONTNEED, x, y - x)
      pos += hi - lo
      i += 1
    return out


def as_tokens(x: Tokens | np.ndarray) -> Tokens:
  return x if isinstance(x, Tokens) else ArrayTokens(x)


def split_documents(doc_offsets: np.ndarray, val_fraction: float, min_tokens: int = 1) -> int:
  """The token index where validation starts: the document boundary closest to the last
  `val_fraction` of the tokens that leaves both sides at least `min_tokens`; -1 if there is none
  (a single document, or documents too large for the fraction asked)."""
  if not 0.0 < val_fraction < 1.0:
    raise DataError(f"val_fraction must be in (0, 1), got {val_fraction}")
  offsets = np.asarray(doc_offsets, np.int64)
  total = int(offsets[-1])
  cuts = offsets[1:-1]
  cuts = cuts[(cuts >= min_tokens) & (total - cuts >= min_tokens)]
  if not len(cuts):
    return -1
  target = total * (1.0 - val_fraction)
  return int(cuts[np.argmin(np.abs(cuts - target))])


# --- datasets -------------------------------------------------------------------------------------

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


def prepared_path(spec: str, data_cfg: Any) -> pathlib.Path:
  """The prepared dataset directory of corpus `spec`: DIR of 'prepared:DIR', else the cache entry of
  a named corpus (prepared now if missing)."""
  return _prepared(spec, data_cfg)[0]


def _prepared(spec: str, data_cfg: Any) -> tuple[pathlib.Path, Tokenizer | None]:
  """(directory, tokenizer: None for prepared:DIR, whose tokenizer is in the directory)."""
  spec = spec.strip()
  if spec.startswith("prepared:"):
    if not spec[len("prepared:"):].strip():
      raise DataError("prepared:DIR needs a directory, e.g. corpus='prepared:/data/my_corpus' (written by "
                      "tformer-prepare)")
    return pathlib.Path(spec[len("prepared:"):].strip()).expanduser(), None
  cache_dir = _cfg(data_cfg, "cache_dir") or None
  docs = load_documents(spec, cache_dir)
  tok_spec, vocab = str(_cfg(data_cfg, "tokenizer")).strip(), int(_cfg(data_cfg, "bpe_vocab_size"))
  raw = False   # the byte tokenizer takes any bytes; the others need UTF-8 text
  for i, d in enumerate(docs):
    if tok_spec == "byte" and b"\x00" in d:   # prepare() skips NUL-holding (binary) text; bytes take it
      raw = True
      break
    try:
      d.decode("utf-8")
    except UnicodeDecodeError as e:
      if tok_spec == "byte":
        raw = True
        break
      raise DataError(f"{spec}: document {i} is not valid UTF-8 (invalid byte {d[e.start:e.start + 1]!r} at byte "
                      f"offset {e.start}); tokenizer {tok_spec!r} reads UTF-8 text: re-encode it (e.g. `iconv -f "
                      "latin1 -t utf-8`) or use tokenizer='byte', which takes any bytes") from None
  tok = get_tokenizer(tok_spec, corpus=b"".join(docs) if tok_spec == "bpe" else None, vocab_size=vocab,
                      cache_dir=cache_dir)
  h = hashlib.sha256(f"{PREPARED_KEY_VERSION} {prepared_lib.FORMAT} {tok.name}".encode())
  for d in docs:
    h.update(len(d).to_bytes(8, "little"))
    h.update(d)
  key = h.hexdigest()[:20]
  root = cache_root(cache_dir) / "prepared"
  out = root / key
  if not (out / prepared_lib.MANIFEST).is_file():
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{key}.lock", "w") as lock:
      fcntl.flock(lock, fcntl.LOCK_EX)        # concurrent runs (or the processes of one run) wait here
      if not (out / prepared_lib.MANIFEST).is_file():
        if raw:
          _write_byte_documents(docs, out, spec)
        else:
          _prepare_documents(docs, out, tok, tok_spec, spec)
  return out, tok


def _prepare_documents(docs: list[bytes], out: pathlib.Path, tok: Tokenizer, tok_spec: str, spec: str) -> None:
  """Write `docs` (one .txt file each) and prepare them into `out` with the tokenizer `tok` (a trained
  BPE as its cached model file). A leftover of an interrupted attempt is overwritten."""
  log.info("data: preparing %s (%d documents, %d bytes, tokenizer %s) into %s", spec, len(docs),
           sum(map(len, docs)), tok.name, out)
  src = out.parent / f".{out.name}.documents"
  shutil.rmtree(src, ignore_errors=True)
  src.mkdir(parents=True)
  try:
    for i, d in enumerate(docs):
      (src / f"{i:06d}.txt").write_bytes(d)
    spec_for_prepare = f"spm:{tok.path}" if tok_spec == "bpe" else tok_spec
    prepared_lib.prepare([str(src)], out, tokenizer=spec_for_prepare, workers=1, progress=False,
                         on_bad_utf8="fail", overwrite=True)
  finally:
    shutil.rmtree(src, ignore_errors=True)


@dataclasses.dataclass
class _Opened:
  name: str
  ds: prepared_lib.PreparedDataset
  tokenizer: Tokenizer
  train: PreparedTokens
  val: PreparedTokens | None


def _write_byte_documents(docs: list[bytes], out: pathlib.Path, spec: str) -> None:
  """Byte-tokenized documents that are not all UTF-8, as a prepared dataset (the format of data/prepared.py:
  one shard, tokens = the bytes, no EOS). prepare() reads UTF-8 text only; the byte tokenizer takes any bytes."""
  log.info("data: %s is not UTF-8 text: writing its bytes as byte tokens into %s", spec, out)
  tmp = out.parent / f".{out.name}.bytes"
  shutil.rmtree(tmp, ignore_errors=True)
  tmp.mkdir(parents=True)
  tokens_name, offsets_name = prepared_lib.shard_files(0)
  lengths = np.array([len(d) for d in docs if d], np.int64)
  np.save(tmp / tokens_name, np.frombuffer(b"".join(docs), np.uint8).astype(prepared_lib.token_dtype(256)))
  np.save(tmp / offsets_name, np.concatenate([[0], np.cumsum(lengths)]).astype("<i8"))
  manifest = {
      "format": prepared_lib.FORMAT, "dtype": prepared_lib.token_dtype(256).name,
      "tokenizer": {"spec": "byte", "name": "byte", "vocab_size": 256,
                    "sha256": hashlib.sha256(b"byte").hexdigest(), "file": None},
      "eos_id": None, "bos_id": None,
      "convention": "documents are concatenated with no separator (the tokenizer has no EOS id); "
                    "boundaries are in the offsets; the bytes are not all UTF-8",
      "num_documents": len(lengths), "num_tokens": int(lengths.sum()),
      "skipped_documents": {"not_utf8": 0, "empty": len(docs) - len(lengths)}, "sources": [spec],
      "text_field": None, "shard_tokens": int(lengths.sum()),
      "shards": [{"tokens": tokens_name, "offsets": offsets_name, "num_documents": len(lengths),
                  "num_tokens": int(lengths.sum()),
                  "sha256": {"tokens": sha256_file(tmp / tokens_name), "offsets": sha256_file(tmp / offsets_name)}}]}
  write_atomic(tmp / prepared_lib.MANIFEST, json.dumps(manifest, indent=1).encode())
  os.replace(tmp, out)


def _open_split(spec: str, data_cfg: Any, *, whole: bool = False) -> _Opened:
  """Corpus `spec` opened and split (`whole`: all of it is the train span, no val span). A named
  corpus's tokenizer is the one its spec builds (cached), a prepared directory's the one inside it."""
  path, tok = _prepared(spec, data_cfg)
  ds = prepared_lib.open_prepared(path)
  tok = ds.tokenizer() if tok is None else tok
  offsets = np.asarray(ds.doc_offsets, np.int64)
  total = int(offsets[-1])
  if whole:
    return _Opened(spec, ds, tok, PreparedTokens(path, 0, total, np.unique(offsets[:-1]), ds), None)
  seq_len, val_fraction = int(_cfg(data_cfg, "seq_len")), float(_cfg(data_cfg, "val_fraction"))
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


def parse_mixture(mixture: str | Sequence[Any]) -> list[tuple[str, float]]:
  """'SPEC=W,SPEC=W' (or a list of 'SPEC=W' / (SPEC, W)) -> [(spec, weight)], weights normalised."""
  items = mixture.split(",") if isinstance(mixture, str) else list(mixture)
  out = []
  for item in items:
    if isinstance(item, (tuple, list)) and len(item) == 2:
      spec, w = str(item[0]).strip(), item[1]
    else:
      spec, sep, w = str(item).strip().rpartition("=")
      if not sep or not spec.strip():
        raise DataError(f"data.mixture: {str(item).strip()!r} is not SPEC=WEIGHT (e.g. 'prepared:/data/a=0.7')")
    try:
      weight = float(w)
    except (TypeError, ValueError):
      raise DataError(f"data.mixture: weight {w!r} of {spec.strip()!r} is not a number") from None
    if not np.isfinite(weight) or weight <= 0:
      raise DataError(f"data.mixture: weight of {spec.strip()!r} must be a positive number, got {w!r}")
    out.append((spec.strip(), weight))
  if not out:
    raise DataError("data.mixture is empty; give 'SPEC=WEIGHT,SPEC=WEIGHT'")
  total = sum(w for _, w in out)
  return [(s, w / total) for s, w in out]


def build_dataset(data_cfg: Any) -> Dataset:
  """Open (preparing named corpora once, cached) and split the data of `data_cfg`; errors when a split
  can't hold one window."""
  spec, seq_len = str(_cfg(data_cfg, "corpus")), int(_cfg(data_cfg, "seq_len"))
  if seq_len <= 0:
    raise DataError(f"data.seq_len must be positive, got {seq_len}")
  mixture = _cfg(data_cfg, "mixture")
  if spec.startswith("synthetic:") and not mixture:
    task = synthetic.parse_synthetic(spec, seq_len)
    return Dataset(task.vocab, None, None, task=task)
  packing = str(_cfg(data_cfg, "packing"))
  if packing not in PACKINGS:
    raise DataError(f"unknown data.packing {packing!r}; expected 'packed' or 'document'")
  val_spec = str(_cfg(data_cfg, "val_corpus") or "").strip()
  entries = parse_mixture(mixture) if mixture else [(spec, 1.0)]
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
  mixture = _cfg(data_cfg, "mixture")
  spec = parse_mixture(mixture)[0][0] if mixture else str(_cfg(data_cfg, "corpus")).strip()
  if spec.startswith("synthetic:"):
    return synthetic.parse_synthetic(spec, int(_cfg(data_cfg, "seq_len"))).vocab
  if spec.startswith("prepared:"):
    return prepared_lib.open_prepared(_prepared(spec, data_cfg)[0]).tokenizer()
  cache_dir = _cfg(data_cfg, "cache_dir") or None
  tok_spec = str(_cfg(data_cfg, "tokenizer")).strip()
  corpus = b"".join(load_documents(spec, cache_dir)) if tok_spec == "bpe" else None
  return get_tokenizer(tok_spec, corpus=corpus, vocab_size=int(_cfg(data_cfg, "bpe_vocab_size")), cache_dir=cache_dir)


def _tokenizer_id(o: _Opened) -> tuple[Any, ...]:
  """What makes two datasets' token ids mean the same: the tokenizer's checksum (and EOS)."""
  t = o.ds.manifest["tokenizer"]
  return (t.get("sha256") or t.get("name"), o.ds.eos_id)


# --- rows -----------------------------------------------------------------------------------------

def _document_fields(doc_starts: np.ndarray, start: int, n: int) -> tuple[np.ndarray, np.ndarray]:
  """(segment ids 1, 2, ..., positions restarting at 0 in each segment) of tokens [start, start+n)."""
  lo = int(np.searchsorted(doc_starts, start, side="right"))
  hi = int(np.searchsorted(doc_starts, start + n, side="left"))
  inner = doc_starts[lo:hi] - start                 # documents that begin inside the window (> 0)
  seg = np.ones(n, np.int32)
  seg[inner] += 1
  seg = np.cumsum(seg, dtype=np.int32) - np.arange(n, dtype=np.int32)
  seg_start = np.concatenate([[0], inner]).astype(np.int32)
  return seg, np.arange(n, dtype=np.int32) - seg_start[seg - 1]


@dataclasses.dataclass(frozen=True)
class _Windows:
  """Window start -> the row: the seq_len+1 tokens, and with document packing their documents."""
  tokens: Tokens
  seq_len: int
  document: bool

  def row(self, start: int) -> np.ndarray | dict[str, np.ndarray]:
    w = self.tokens.read(start, start + self.seq_len + 1)
    if not self.document:
      return w
    seg, pos = _document_fields(self.tokens.doc_starts, start, self.seq_len + 1)
    return {"tokens": w, "segment_ids": seg, "positions": pos}


@dataclasses.dataclass(frozen=True)
class _RandomWindow:
  """Global row g -> a window at a start drawn from rng([seed, g])."""
  windows: _Windows
  seed: int

  def __call__(self, g: int):
    high = len(self.windows.tokens) - self.windows.seq_len       # starts 0 .. len - (seq_len+1)
    return self.windows.row(int(np.random.default_rng([self.seed, int(g)]).integers(0, high)))


@dataclasses.dataclass(frozen=True)
class _Window:
  """Window index k -> the window at k*seq_len."""
  windows: _Windows

  def __call__(self, k: int):
    return self.windows.row(int(k) * self.windows.seq_len)


def num_windows(tokens: Tokens | np.ndarray, seq_len: int) -> int:
  """Non-overlapping windows (stride seq_len, seq_len+1 tokens each) in `tokens`."""
  return (len(tokens) - 1) // seq_len


def _stack(rows: list) -> dict[str, np.ndarray]:
  if not isinstance(rows[0], dict):
    w = np.stack(rows).astype(np.int32)
    return {"inputs": w[:, :-1], "targets": w[:, 1:]}
  w = np.stack([r["tokens"] for r in rows]).astype(np.int32)
  seg = np.stack([r["segment_ids"] for r in rows])
  pos = np.stack([r["positions"] for r in rows])
  return {"inputs": w[:, :-1], "targets": w[:, 1:], "segment_ids": seg[:, :-1], "positions": pos[:, :-1],
          "loss_mask": (seg[:, 1:] == seg[:, :-1]).astype(np.float32)}


def _local_batch(batch_size: int, process_index: int, process_count: int) -> int:
  if process_count < 1 or not 0 <= process_index < process_count:
    raise DataError(f"bad process_index={process_index} for process_count={process_count}")
  if batch_size % process_count:
    raise DataError(f"data.batch_size={batch_size} must be divisible by the number of processes "
                    f"({process_count})")
  return batch_size // process_count


def _ensure_absl_flags() -> None:
  """grain's worker processes read absl flags; mark them parsed when the caller never ran absl.app."""
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()


def _part_rows(part: MixPart, sampling: str, seq_len: int, seed: int, document: bool) -> grain.MapDataset:
  windows = _Windows(part.train, seq_len, document)
  if sampling == "random":
    return grain.MapDataset.range(sys.maxsize).map(_RandomWindow(windows, seed))
  if sampling == "packed":
    n = num_windows(part.train, seq_len)
    return grain.MapDataset.range(n).shuffle(seed=seed).repeat().map(_Window(windows))
  raise DataError(f"unknown data.sampling {sampling!r}; expected 'random' or 'packed'")


def mixture_quotas(weights: Sequence[float], block: int = MIX_BLOCK, *, allow_zero: bool = False) -> tuple[int, ...]:
  """Rows per block of each dataset: weight * block, largest remainders rounded up (sum = block)."""
  w = np.asarray(weights, np.float64) / np.sum(weights)
  raw = w * block
  q = np.floor(raw).astype(np.int64)
  q[np.argsort(-(raw - q), kind="stable")[:block - int(q.sum())]] += 1
  if (q == 0).any() and not allow_zero:
    i = int(np.argmin(q))
    raise DataError(f"data.mixture: weight {w[i]:.2g} is below 1/{block}, the mixture's resolution")
  return tuple(int(x) for x in q)


@functools.lru_cache(maxsize=64)
def _mix_block(quotas: tuple[int, ...], seed: int, block: int) -> tuple[np.ndarray, np.ndarray]:
  """(dataset of each row of the block, its rank among that dataset's rows in the block)."""
  which = np.random.default_rng([seed, block, 0x6D6978]).permutation(np.repeat(np.arange(len(quotas)), quotas))
  rank = np.empty(len(which), np.int64)
  for i in range(len(quotas)):
    sel = which == i
    rank[sel] = np.arange(int(sel.sum()))
  return which, rank


@dataclasses.dataclass(frozen=True)
class Mixture:
  """Global row g -> (dataset i, row n of dataset i's stream); see the module doc."""
  quotas: tuple[int, ...]
  seed: int

  def locate(self, g: int) -> tuple[int, int]:
    b, j = divmod(int(g), sum(self.quotas))
    which, rank = _mix_block(self.quotas, self.seed, b)
    i = int(which[j])
    return i, b * self.quotas[i] + int(rank[j])

  def counts(self, rows: int) -> np.ndarray:
    """Rows of each dataset among global rows [0, rows)."""
    b, j = divmod(int(rows), sum(self.quotas))
    out = np.asarray(self.quotas, np.int64) * b
    if j:
      out += np.bincount(_mix_block(self.quotas, self.seed, b)[0][:j], minlength=len(self.quotas))
    return out


@dataclasses.dataclass(frozen=True)
class _MixedRow:
  mixture: Mixture
  parts: tuple[grain.MapDataset, ...]

  def __call__(self, g: int):
    i, n = self.mixture.locate(g)
    return self.parts[i][n]


def _global_rows(ds: Dataset, data_cfg: Any) -> tuple[grain.MapDataset, Mixture | None]:
  seq_len, seed = int(_cfg(data_cfg, "seq_len")), int(_cfg(data_cfg, "seed"))
  infinite = grain.MapDataset.range(sys.maxsize)
  if ds.task is not None:
    return infinite.map(synthetic.SyntheticRows(ds.task, seed, synthetic.TRAIN_STREAM)), None
  sampling = str(_cfg(data_cfg, "sampling"))
  document = str(_cfg(data_cfg, "packing")) == "document"
  parts = ds.parts()
  if len(parts) == 1:
    return _part_rows(parts[0], sampling, seq_len, seed, document), None
  streams = tuple(_part_rows(p, sampling, seq_len, int(np.random.default_rng([seed, i]).integers(2**31)), document)
                  for i, p in enumerate(parts))
  mix = Mixture(mixture_quotas([p.weight for p in parts]), seed)
  return infinite.map(_MixedRow(mix, streams)), mix


class BatchIterator(grain.DatasetIterator):
  """Batches of an index-addressable grain MapDataset; the state is just the next batch index.

  Restoring builds a fresh grain pipeline from that index, so a state is portable across
  worker_count values (grain's own multiprocess states are not). A grain DatasetIterator, so
  `grain.checkpoint.CheckpointSave/Restore` and Orbax checkpoint it like any other.
  A mixture's iterator logs the realised proportions every MIX_LOG_EVERY batches
  (`realised_proportions()` gives them at any time).
  """

  def __init__(self, batches: grain.MapDataset, workers: int = 0, start: int = 0, *,
               mixture: Mixture | None = None, names: Sequence[str] = (), global_batch: int = 0):
    super().__init__()
    self._batches, self._workers, self._next = batches, workers, int(start)
    self._it: grain.DatasetIterator | None = None
    self._mixture, self._names, self._global_batch = mixture, tuple(names), int(global_batch)

  def _open(self) -> grain.DatasetIterator:
    if self._it is None:
      ds = self._batches[self._next:].to_iter_dataset(
          grain.ReadOptions(num_threads=2, prefetch_buffer_size=4))
      if self._workers > 0:
        _ensure_absl_flags()
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=self._workers))
      self._it = iter(ds)
    return self._it

  def __next__(self) -> dict[str, np.ndarray]:
    self._assert_not_closed()
    batch = next(self._open())
    self._next += 1
    if self._mixture is not None and self._next % MIX_LOG_EVERY == 0:
      got = self.realised_proportions()
      log.info("data mixture after %d batches: %s", self._next,
               ", ".join(f"{k} {v:.4f}" for k, v in got.items()))
    return batch

  def realised_proportions(self) -> dict[str, float]:
    """The fraction of the global rows delivered so far that came from each dataset of the mixture."""
    if self._mixture is None:
      return {}
    counts = self._mixture.counts(self._next * self._global_batch)
    return {n: float(c) / max(1, int(counts.sum())) for n, c in zip(self._names, counts)}

  def get_state(self) -> dict[str, Any]:
    return {"next_index": self._next}

  def set_state(self, state: dict[str, Any]) -> None:
    self._assert_not_closed()
    if self._it is not None:
      self._it.close()
      self._it = None
    self._next = int(state["next_index"])

  def start_prefetch(self) -> None:
    self._open().start_prefetch()

  def close(self) -> None:
    if self._it is not None:
      self._it.close()
      self._it = None
    super().close()


def train_iterator(ds: Dataset, data_cfg: Any, *, process_index: int = 0, process_count: int = 1
                   ) -> BatchIterator:
  """An endless, resumable iterator of this process's training batches (see the module doc)."""
  bsz = int(_cfg(data_cfg, "batch_size"))
  local = _local_batch(bsz, process_index, process_count)
  rows, mix = _global_rows(ds, data_cfg)
  batch_fn = synthetic.stack_rows if ds.task is not None else _stack
  batches = rows[process_index::process_count].batch(local, drop_remainder=True, batch_fn=batch_fn)
  if mix is not None:
    log.info("data mixture: %s (rows per block of %d: %s)",
             ", ".join(f"{p.name} {p.weight:.4f}" for p in ds.mixture), sum(mix.quotas),
             ", ".join(map(str, mix.quotas)))
  return BatchIterator(batches, workers=int(_cfg(data_cfg, "worker_count")), mixture=mix,
                       names=[p.name for p in ds.mixture], global_batch=bsz)


def eval_batches(ds: Dataset, data_cfg: Any, num_batches: int, *, process_index: int = 0,
                 process_count: int = 1) -> list[dict[str, np.ndarray]]:
  """`num_batches` fixed validation batches: evenly spaced windows over the whole validation split
  (a mixture: over each dataset's validation split, as many windows as its weight's share).

  Global row g of batch i is window i*B + g of the num_batches*B windows; process p gets rows
  p, p+P, ... like `train_iterator`. Synthetic tasks draw from a separate eval stream.
  """
  bsz = int(_cfg(data_cfg, "batch_size"))
  local = _local_batch(bsz, process_index, process_count)
  total = num_batches * bsz
  mine = [np.arange(i * bsz + process_index, (i + 1) * bsz, process_count)
          for i in range(num_batches)]
  if ds.task is not None:
    rows = synthetic.SyntheticRows(ds.task, int(_cfg(data_cfg, "seed")), synthetic.EVAL_STREAM)
    return [synthetic.stack_rows([rows(g) for g in idx]) for idx in mine]
  seq_len = int(_cfg(data_cfg, "seq_len"))
  document = str(_cfg(data_cfg, "packing")) == "document"
  parts = ds.parts()
  counts = mixture_quotas([p.weight for p in parts], total, allow_zero=True) if len(parts) > 1 else (total,)
  windows = []   # (part, start) of every global eval row
  for p, n in zip(parts, counts):
    last = len(p.val) - (seq_len + 1)
    if last < 0:
      raise DataError(f"validation split has {len(p.val)} tokens, fewer than seq_len+1={seq_len + 1}")
    starts = np.linspace(0, last, n).round().astype(np.int64) if n > 1 else np.zeros(n, np.int64)
    w = _Windows(p.val, seq_len, document)
    windows += [(w, int(s)) for s in starts]
  out = []
  for idx in mine:
    assert len(idx) == local
    out.append(_stack([windows[g][0].row(windows[g][1]) for g in idx]))
  return out


def iterate(it: Iterator[dict[str, np.ndarray]], n: int) -> list[dict[str, np.ndarray]]:
  """The next `n` batches of `it` (a small helper for tests and notebooks)."""
  return [next(it) for _ in range(n)]


def describe(ds: Dataset) -> dict[str, Any]:
  """A JSON-able summary (benchmarks, logs)."""
  return {"tokenizer": ds.tokenizer.name, "vocab_size": ds.vocab_size,
          "parts": [{"name": p.name, "weight": p.weight, "train_tokens": len(p.train), "val_tokens": len(p.val),
                     "train_documents": len(p.train.doc_starts)} for p in ds.parts()]}


__all__ = ["ArrayTokens", "BatchIterator", "Dataset", "MixPart", "Mixture", "PreparedTokens", "Tokens",
           "build_dataset", "eval_batches", "iterate", "mixture_quotas", "parse_mixture",
           "prepared_path", "split_documents", "tokenizer_for", "train_iterator"]
