"""Prepared datasets: text sources tokenized once into shards of token ids, read memory-mapped.

The format (`tformer_jax.prepared/1`), a directory:

  manifest.json                written last, atomically: its presence means the dataset is complete. Holds the
                               dtype, the tokenizer (spec, name, vocab_size, sha256, file), eos_id / bos_id and
                               the convention, counts, the sources, and per shard its counts and sha256s.
  tokenizer.model | .json      a copy of the tokenizer (none for the byte tokenizer)
  shard-NNNNN.tokens.npy       1-D token ids, uint16 when the vocabulary has <= 65536 ids, else uint32
  shard-NNNNN.offsets.npy      1-D int64, num_documents + 1 entries: document i of the shard is
                               tokens[offsets[i]:offsets[i + 1]], its EOS included when eos_id is set

Documents never span shards; a shard closes once it holds >= shard_tokens tokens. Every document ends with
eos_id when the tokenizer has one (no BOS is added); the byte tokenizer has none, and its documents are
concatenated with no separator (the offsets hold the boundaries).

Reading: `open_prepared(DIR)` -> `PreparedDataset` (shards memory-mapped; `verify()` checks the sha256s).
Training: `check_run_data` (at a run's start) hashes each token shard once and checks its ids against the
vocabulary, records the datasets' identity (shard checksums + tokenizer sha256) in WORKDIR/data.json, and
refuses a resumed run whose directory was prepared again.
Writing: `prepare(sources, DIR, tokenizer=...)` streams documents (`tformer_jax.data.sources`), tokenizes
batches of them in `workers` processes (the main process and workers - 1 spawned ones), and writes the
results in input order, so the output is byte-identical for any worker count. Each shard is committed
atomically (temporary file, fsync, rename), then `.progress.json` records where the input stands; a rerun
with the same arguments resumes there, and the result is byte-identical to an uninterrupted run.
`tokenizer_ceiling` measures the tokenizer library's own batch encode on the same texts (the throughput
ceiling `prepare` is compared with).

The output directory is owned: `prepare` writes only into a missing or empty directory or one holding its
own manifest / progress / lock file (`.prepare.lock`, an flock held for the whole run, so a second prepare
into the same directory stops at once naming the first), refuses anything else, and deletes only files it
wrote. `overwrite=True` replaces a dataset of ours atomically: the new one is built in a directory beside it,
then the two are exchanged (renameat2 RENAME_EXCHANGE; two renames where that is missing). A full or
read-only disk is one DataError line; the committed shards stay resumable.

Test hooks: with $TFORMER_PREPARE_KILL_AFTER_SHARDS=N set, `prepare` kills its own process (SIGKILL, or the
signal named by $TFORMER_PREPARE_KILL_SIGNAL, e.g. INT, sent to its process group as a terminal's Ctrl-C is)
right after committing its N-th shard of this run, as a crash would; with $TFORMER_PREPARE_WAIT_FOR_WORKERS=1 the
main process waits for the spawned workers to be up before the first unit (so a small input still reaches
them).
"""
from __future__ import annotations

import collections
import concurrent.futures
import concurrent.futures.process
import ctypes
import dataclasses
import datetime
import errno
import fcntl
import hashlib
import io
import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import pathlib
import resource
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from typing import Any, Iterator, Sequence

import numpy as np
import tqdm

from tformer_jax.data import sources as sources_lib
from tformer_jax.data.corpora import DataError, cache_root, sha256_file, write_atomic
from tformer_jax.data.sources import EMPTY, NOT_UTF8, Position, Unit
from tformer_jax.data.tokenizers import (
    ByteTokenizer,
    HFTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    get_tokenizer,
)

log = logging.getLogger(__name__)

FORMAT = "tformer_jax.prepared/1"
MANIFEST = "manifest.json"
PROGRESS = ".progress.json"
LOCK = ".prepare.lock"
TOKENIZER_EXTRAS = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
KILL_ENV = "TFORMER_PREPARE_KILL_AFTER_SHARDS"
SIGNAL_ENV = "TFORMER_PREPARE_KILL_SIGNAL"
WAIT_ENV = "TFORMER_PREPARE_WAIT_FOR_WORKERS"
DEFAULT_SHARD_TOKENS = 1 << 24
DEFAULT_BPE_VOCAB = 8192
DEFAULT_SAMPLE_BYTES = 20_000_000


def token_dtype(vocab_size: int) -> np.dtype:
  """uint16 when every id fits (vocab_size <= 65536), else uint32; DataError beyond uint32."""
  if vocab_size <= 1 << 16:
    return np.dtype("<u2")
  if vocab_size <= 1 << 32:
    return np.dtype("<u4")
  raise DataError(f"a vocabulary of {vocab_size} ids does not fit uint32 token ids (at most {1 << 32})")


def shard_files(index: int) -> tuple[str, str]:
  return f"shard-{index:05d}.tokens.npy", f"shard-{index:05d}.offsets.npy"


def _convention(eos_id: int | None) -> str:
  if eos_id is None:
    return ("documents are concatenated with no separator (the tokenizer has no EOS id); "
            "boundaries are in the offsets")
  return f"every document ends with eos_id ({eos_id}); no BOS is added"


# --- reading ---------------------------------------------------------------------------------------

def _npy_header_len(path: pathlib.Path) -> int:
  with open(path, "rb") as f:
    version = np.lib.format.read_magic(f)
    if version == (1, 0):
      np.lib.format.read_array_header_1_0(f)
    else:
      np.lib.format.read_array_header_2_0(f)
    return f.tell()


class PreparedDataset:
  """A prepared dataset directory, its shards memory-mapped (nothing is loaded whole)."""

  def __init__(self, path: str | os.PathLike, manifest: dict[str, Any]):
    self.path = pathlib.Path(path)
    self.manifest = manifest
    self.dtype = np.dtype(manifest["dtype"])
    self.num_documents = int(manifest["num_documents"])
    self.num_tokens = int(manifest["num_tokens"])
    self.eos_id = manifest.get("eos_id")
    self.bos_id = manifest.get("bos_id")
    self.vocab_size = int(manifest["tokenizer"]["vocab_size"])
    self.shards: list[tuple[np.ndarray, np.ndarray]] = []
    for entry in manifest["shards"]:
      self.shards.append((self._load(entry["tokens"], self.dtype, entry["num_tokens"]),
                          self._load(entry["offsets"], np.dtype("<i8"), entry["num_documents"] + 1, mmap=False)))
    for (tokens, offsets), entry in zip(self.shards, manifest["shards"]):
      if offsets[0] != 0 or offsets[-1] != len(tokens) or np.any(np.diff(offsets) < 0):
        raise DataError(f"{self.path / entry['offsets']}: offsets are not 0..{len(tokens)} ascending: the file is "
                        "corrupt; prepare the dataset again")
    self.shard_token_starts = np.concatenate([[0], np.cumsum([len(t) for t, _ in self.shards])]).astype(np.int64)
    self.shard_doc_starts = np.concatenate([[0], np.cumsum([len(o) - 1 for _, o in self.shards])]).astype(np.int64)
    if self.shard_token_starts[-1] != self.num_tokens or self.shard_doc_starts[-1] != self.num_documents:
      raise DataError(f"{self.path / MANIFEST}: the shards hold {self.shard_token_starts[-1]} tokens and "
                      f"{self.shard_doc_starts[-1]} documents, the manifest says {self.num_tokens} and "
                      f"{self.num_documents}: prepare the dataset again")
    self._doc_offsets: np.ndarray | None = None

  def _load(self, name: str, dtype: np.dtype, length: int, mmap: bool = True) -> np.ndarray:
    file = self.path / name
    if not file.is_file():
      raise DataError(f"{file}: missing shard file of the prepared dataset {self.path}; prepare it again")
    try:
      expected = _npy_header_len(file) + length * dtype.itemsize
      size = file.stat().st_size
      if size != expected:
        raise ValueError(f"{size} bytes, expected {expected}")
      array = np.load(file, mmap_mode="r" if mmap else None, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
      raise DataError(f"{file}: truncated or not a .npy file of {length} {dtype.name} ({e}); "
                      "prepare the dataset again") from None
    if array.dtype != dtype or array.shape != (length,):
      raise DataError(f"{file}: holds {array.dtype}{list(array.shape)}, the manifest says {dtype.name}[{length}]")
    return array

  def __repr__(self) -> str:
    return (f"PreparedDataset({str(self.path)!r}, {self.num_documents} documents, {self.num_tokens} tokens, "
            f"{len(self.shards)} shards, {self.dtype.name})")

  @property
  def doc_offsets(self) -> np.ndarray:
    """int64 start offsets of every document (and the end), over all shards concatenated."""
    if self._doc_offsets is None:
      parts = [offsets[:-1] + start for (_, offsets), start in zip(self.shards, self.shard_token_starts)]
      self._doc_offsets = np.concatenate(parts + [np.array([self.num_tokens], np.int64)]).astype(np.int64)
    return self._doc_offsets

  def tokens_at(self, start: int, n: int) -> np.ndarray:
    """Tokens [start, start + n) of all shards concatenated (a copy, in the dataset's dtype)."""
    if start < 0 or n < 0 or start + n > self.num_tokens:
      raise IndexError(f"tokens [{start}, {start + n}) out of range: the dataset holds {self.num_tokens}")
    out = np.empty(n, self.dtype)
    done = 0
    shard = int(np.searchsorted(self.shard_token_starts, start, side="right")) - 1
    while done < n:
      tokens = self.shards[shard][0]
      lo = start + done - int(self.shard_token_starts[shard])
      take = min(n - done, len(tokens) - lo)
      out[done:done + take] = tokens[lo:lo + take]
      done += take
      shard += 1
    return out

  def document(self, i: int) -> np.ndarray:
    """The tokens of document i (with its EOS when the dataset has one)."""
    if not 0 <= i < self.num_documents:
      raise IndexError(f"document {i} out of range: the dataset holds {self.num_documents}")
    shard = int(np.searchsorted(self.shard_doc_starts, i, side="right")) - 1
    tokens, offsets = self.shards[shard]
    j = i - int(self.shard_doc_starts[shard])
    return np.asarray(tokens[offsets[j]:offsets[j + 1]])

  def tokenizer(self) -> Tokenizer:
    """The tokenizer the dataset was made with (its copy in the directory), eos_id/bos_id as in the manifest."""
    info = self.manifest["tokenizer"]
    file = info.get("file")
    if not file:
      tok: Any = ByteTokenizer()
    elif file.endswith(".json"):
      tok = HFTokenizer(self.path / file)
    else:
      tok = SentencePieceTokenizer(self.path / file, name=info.get("name"))
    tok.eos_id, tok.bos_id = self.eos_id, self.bos_id
    return tok

  def verify(self) -> None:
    """Check every file against the manifest's sha256; DataError naming the first bad file."""
    info = self.manifest["tokenizer"]
    files = [(e[kind], e["sha256"][kind]) for e in self.manifest["shards"] for kind in ("tokens", "offsets")]
    if info.get("file"):
      files.append((info["file"], info["sha256"]))
    files += sorted(info.get("extra_files", {}).items())
    for name, want in files:
      file = self.path / name
      if not file.is_file():
        raise DataError(f"{file}: missing file of the prepared dataset {self.path}; prepare it again")
      got = sha256_file(file)
      if got != want:
        raise DataError(f"{file}: checksum mismatch (sha256 {got[:16]}..., the manifest says {want[:16]}...): "
                        "the file is corrupt; prepare the dataset again")


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
  root = pathlib.Path(path).expanduser()
  file = root / MANIFEST
  if not file.is_file():
    if not root.exists():
      raise DataError(f"prepared dataset {root}: no such directory")
    if (root / PROGRESS).is_file():
      raise DataError(f"{file} is missing: the prepare of {root} did not finish; rerun the same "
                      "tformer-prepare command to resume it")
    raise DataError(f"{file} is missing: {root} is not a prepared dataset (make one with tformer-prepare)")
  try:
    manifest = json.loads(file.read_text(encoding="utf-8"))
  except (OSError, ValueError) as e:
    raise DataError(f"{file}: unreadable manifest ({e}); prepare the dataset again") from None
  if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
    found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
    raise DataError(f"{file}: format {found!r}, expected {FORMAT!r}")
  missing = [k for k in ("dtype", "tokenizer", "num_documents", "num_tokens", "shards") if k not in manifest]
  if missing:
    raise DataError(f"{file}: incomplete manifest (no {', '.join(missing)}); prepare the dataset again")
  return manifest


def open_prepared(path: str | os.PathLike, *, verify: bool = False) -> PreparedDataset:
  """The prepared dataset at `path`, shards memory-mapped. DataError naming the file when the manifest is
  missing or incomplete, a shard is missing or truncated, or (verify=True) a checksum differs."""
  root = pathlib.Path(path).expanduser()
  ds = PreparedDataset(root, read_manifest(root))
  if verify:
    ds.verify()
  return ds


# --- writing: the worker side ------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Recipe:
  """What a worker needs to turn units into tokens (picklable)."""
  tokenizer_kind: str         # byte | spm | hf
  tokenizer_file: str | None
  eos_id: int | None
  dtype: str
  fields: sources_lib.Fields
  on_bad_utf8: str
  txt_split: str


_WORKER: dict[str, Any] = {}


def _load_tokenizer(kind: str, file: str | None) -> Any:
  if kind == "byte":
    return ByteTokenizer()
  if kind == "hf":
    return HFTokenizer(file)
  return SentencePieceTokenizer(file)


def _worker_tokenizer(recipe: _Recipe) -> Any:
  """This process's tokenizer for `recipe` (loaded at its first unit)."""
  if _WORKER.get("recipe") != recipe:
    _WORKER["tok"] = _load_tokenizer(recipe.tokenizer_kind, recipe.tokenizer_file)
    _WORKER["recipe"] = recipe
  return _WORKER["tok"]


def _encode_unit(unit: Unit, recipe: _Recipe) -> tuple[np.ndarray, np.ndarray, int, int]:
  """(tokens of the unit's documents concatenated, per record its token count or NOT_UTF8/EMPTY, UTF-8 bytes
  of the documents, this process's peak RSS in KiB)."""
  tok = _worker_tokenizer(recipe)
  docs = sources_lib.unit_documents(unit, recipe.fields, recipe.on_bad_utf8, recipe.txt_split)
  texts = [d for d in docs if isinstance(d, str)]
  ids = tok.encode_batch(texts) if texts else []
  eos = None if recipe.eos_id is None else np.array([recipe.eos_id], np.int32)
  lengths = np.empty(len(docs), np.int64)
  parts, text_bytes, j = [], 0, 0
  for i, doc in enumerate(docs):
    if not isinstance(doc, str):
      lengths[i] = doc
      continue
    doc_ids = ids[j]
    j += 1
    if len(doc_ids) == 0:
      lengths[i] = EMPTY
      continue
    parts.append(doc_ids)
    if eos is not None:
      parts.append(eos)
    lengths[i] = len(doc_ids) + (eos is not None)
    text_bytes += len(doc.encode("utf-8"))
  tokens = np.concatenate(parts).astype(recipe.dtype) if parts else np.empty(0, recipe.dtype)
  return tokens, lengths, text_bytes, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _exit_with_parent() -> None:
  """Worker initializer: leave when the main process dies (killed, not shut down), instead of lingering."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)    # Ctrl-C reaches the whole group: the main process handles it
  parent = multiprocessing.parent_process()
  if parent is not None:
    def watch() -> None:
      multiprocessing.connection.wait([parent.sentinel])
      os._exit(1)
    threading.Thread(target=watch, daemon=True, name="exit-with-parent").start()


class _Pool:
  """The processes that tokenize: the main process and `workers - 1` spawned ones (spawn, not fork: the
  caller may hold jax's threads). They start before the tokenizer is ready, so their start-up overlaps the
  main process's reading and BPE training, and until they are up the main process tokenizes alone."""

  def __init__(self, workers: int):
    self.workers = workers
    self.units = {"main": 0, "spawned": 0}       # units encoded by each side (stats)
    self.executor: concurrent.futures.ProcessPoolExecutor | None = None
    self._starting: list[concurrent.futures.Future] = []
    if workers > 1:
      ctx = multiprocessing.get_context("spawn")
      # SIGINT ignored while they spawn: a child keeps an ignored signal through exec, so a Ctrl-C to the
      # group never interrupts a starting worker; the main process handles it and stops them
      main = threading.current_thread() is threading.main_thread()
      handler = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
      try:
        self.executor = concurrent.futures.ProcessPoolExecutor(workers - 1, mp_context=ctx,
                                                               initializer=_exit_with_parent)
        self._starting = [self.executor.submit(int) for _ in range(workers - 1)]   # start them all now
      finally:
        if main:
          signal.signal(signal.SIGINT, handler)

  def ready(self) -> bool:
    """Whether the spawned processes are up (then units go to them first)."""
    if self._starting and all(f.done() for f in self._starting):
      self._starting = []
    return self.executor is not None and not self._starting

  def shutdown(self) -> None:
    if self.executor is not None:
      self.executor.shutdown(wait=True, cancel_futures=True)


def _done(result: Any) -> concurrent.futures.Future:
  future: concurrent.futures.Future = concurrent.futures.Future()
  future.set_result(result)
  return future


def _results(units: Iterator[Unit], pool: _Pool, recipe: _Recipe
             ) -> Iterator[tuple[Position, int, tuple[np.ndarray, np.ndarray, int, int]]]:
  """(unit position, unit input bytes, result) in input order. A unit goes to a spawned process while fewer
  than 2 per process are in flight there, else the main process encodes it; at most 2 * workers + 2 units
  are held (bounded memory)."""
  window: collections.deque = collections.deque()
  limit = 2 * pool.workers + 2
  if os.environ.get(WAIT_ENV) and pool.executor is not None:
    concurrent.futures.wait(pool._starting)
  try:
    for unit in units:
      busy = sum(1 for _, _, f in window if not f.done())
      if pool.ready() and busy < 2 * (pool.workers - 1):
        future = pool.executor.submit(_encode_unit, unit, recipe)
        pool.units["spawned"] += 1
      else:
        pool.units["main"] += 1
        tokens, lengths, text_bytes, _ = _encode_unit(unit, recipe)
        future = _done((tokens, lengths, text_bytes, 0))     # (the main process's peak is reported apart)
      window.append((unit.position, unit.input_bytes, future))
      while window and (window[0][2].done() or len(window) >= limit):
        position, nbytes, future = window.popleft()
        yield position, nbytes, future.result()
    while window:
      position, nbytes, future = window.popleft()
      yield position, nbytes, future.result()
  except concurrent.futures.process.BrokenProcessPool as e:
    raise RuntimeError(f"a prepare worker process died ({e}); out of memory? Rerun the same command to resume, "
                       "with fewer --workers") from None
  finally:
    for _, _, future in window:
      future.cancel()
    _WORKER.clear()


# --- writing: shards and progress --------------------------------------------------------------------

def _write(path: pathlib.Path, data: bytes) -> None:
  """write_atomic, readable as an ordinary new file is (write_atomic's temporary file is private: 0600)."""
  write_atomic(path, data)
  umask = os.umask(0)
  os.umask(umask)
  os.chmod(path, 0o666 & ~umask)


def _fsync_dir(path: pathlib.Path) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _write_npy(path: pathlib.Path, chunks: Sequence[np.ndarray], dtype: np.dtype) -> str:
  """A 1-D .npy of the chunks concatenated, written atomically without concatenating; its sha256."""
  n = sum(len(c) for c in chunks)
  header = io.BytesIO()
  np.lib.format.write_array_header_1_0(
      header, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": (n,)})
  h = hashlib.sha256()
  tmp = path.with_name(path.name + ".tmp")
  try:
    with open(tmp, "wb") as f:
      for part in [header.getvalue(), *chunks]:
        data = part if isinstance(part, bytes) else np.ascontiguousarray(part, dtype=dtype).tobytes()
        h.update(data)
        f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    tmp.unlink(missing_ok=True)
    raise
  return h.hexdigest()


class _Writer:
  """Accumulates documents into shards; each closed shard is committed with the progress that follows it."""

  def __init__(self, root: pathlib.Path, dtype: np.dtype, shard_tokens: int, state: dict[str, Any]):
    self.root, self.dtype, self.shard_tokens, self.state = root, dtype, shard_tokens, state
    self.chunks: list[np.ndarray] = []
    self.lengths: list[np.ndarray] = []
    self.tokens = 0
    self.committed_this_run = 0
    self.kill_after = int(os.environ.get(KILL_ENV, "0") or 0)

  def add(self, position: Position, tokens: np.ndarray, lengths: np.ndarray, skip: int) -> None:
    """The records of one unit from record `skip` on."""
    counts = self.state["counts"]
    sizes = np.where(lengths > 0, lengths, 0)
    ends = np.cumsum(sizes)
    n, i = len(lengths), skip
    while i < n:
      base = int(ends[i] - sizes[i])
      j = int(np.searchsorted(ends, base + self.shard_tokens - self.tokens, side="left"))
      last = min(j, n - 1)
      take = lengths[i:last + 1]
      counts["not_utf8"] += int(np.sum(take == NOT_UTF8))
      counts["empty"] += int(np.sum(take == EMPTY))
      docs = take[take > 0]
      if len(docs):
        self.chunks.append(tokens[base:int(ends[last])])
        self.lengths.append(docs)
        self.tokens += int(ends[last]) - base
      if j >= n:
        return
      self.close({"position": position.as_dict(), "record": last + 1})
      i = last + 1

  def close(self, next_position: dict[str, Any] | None) -> None:
    """Commit the open shard (if it holds documents), then the progress."""
    if self.lengths:
      index = len(self.state["shards"])
      tokens_name, offsets_name = shard_files(index)
      lengths = np.concatenate(self.lengths)
      offsets = np.concatenate([[0], np.cumsum(lengths)]).astype("<i8")
      entry = {"tokens": tokens_name, "offsets": offsets_name, "num_documents": int(len(lengths)),
               "num_tokens": int(offsets[-1]),
               "sha256": {"tokens": _write_npy(self.root / tokens_name, self.chunks, self.dtype),
                          "offsets": _write_npy(self.root / offsets_name, [offsets], np.dtype("<i8"))}}
      self.state["shards"].append(entry)
      self.state["counts"]["documents"] += entry["num_documents"]
      self.state["counts"]["tokens"] += entry["num_tokens"]
      self.chunks, self.lengths, self.tokens = [], [], 0
      self.committed_this_run += 1
    self.state["next"] = next_position
    _fsync_dir(self.root)
    write_atomic(self.root / PROGRESS, json.dumps(self.state, indent=1).encode())
    if self.kill_after and self.committed_this_run >= self.kill_after:
      name = os.environ.get(SIGNAL_ENV, "KILL").upper()
      log.warning("%s=%d: SIG%s after %d shards (test hook)", KILL_ENV, self.kill_after, name,
                  self.committed_this_run)
      if name == "KILL":
        os.kill(os.getpid(), signal.SIGKILL)
      else:
        self.kill_after = 0
        os.killpg(os.getpgrp(), getattr(signal, "SIG" + name))


# --- prepare ---------------------------------------------------------------------------------------

def _tokenizer_kind(spec: str) -> str:
  spec = spec.strip()
  if spec == "byte":
    return "byte"
  if spec == "bpe" or spec.startswith("spm:"):
    return "spm"
  if spec.startswith("hf:"):
    return "hf"
  get_tokenizer(spec)        # raises the one-line error naming the known specs
  raise AssertionError(spec)


def sample_texts(srcs: Sequence[sources_lib.Source], fields: sources_lib.Fields, *, max_bytes: int,
                 txt_split: str = "file", on_bad_utf8: str = "skip", seed: int = 0) -> list[str]:
  """About `max_bytes` of document text spread evenly over all sources (deterministic for a seed): each
  document is kept with probability p = max_bytes / (the sources' text), the text estimated from their size
  on disk times the text share of the units read so far (JSON syntax is not text). Only units kept with
  probability min(1, 8p) are parsed (their documents then with p / that), so a small sample of a large
  corpus reads a small part of it."""
  total = sum(s.bytes for s in srcs) or 1
  rng = np.random.default_rng(seed)
  out, size, seen_input, seen_text = [], 0, 0, 0
  for unit in sources_lib.iter_units(srcs, fields, txt_split=txt_split):
    share = seen_text / seen_input if seen_input else 1.0
    p = min(1.0, max_bytes / max(total * share, 1.0))
    q = min(1.0, 8 * p)
    if q < 1.0 and rng.random() >= q:
      continue
    unit_text = 0
    for doc in sources_lib.unit_documents(unit, fields, on_bad_utf8, txt_split):
      if not isinstance(doc, str):
        continue
      n = len(doc.encode("utf-8"))
      unit_text += n
      if p >= 1.0 or rng.random() < p / q:
        out.append(doc)
        size += n
        if size >= max_bytes:
          return out
    if unit.input_bytes:
      seen_input += unit.input_bytes
      seen_text += unit_text
  return out


def _setup_tokenizer(spec: str, srcs: Sequence[sources_lib.Source], fields: sources_lib.Fields, *,
                     bpe_vocab_size: int, sample_bytes: int, txt_split: str, on_bad_utf8: str,
                     cache_dir: str | os.PathLike | None) -> tuple[Any, pathlib.Path | None, dict[str, Any]]:
  """(tokenizer, its file, extra manifest info); 'bpe' is trained on a sample of the sources."""
  kind = _tokenizer_kind(spec)
  extra: dict[str, Any] = {}
  if spec.strip() == "bpe":
    texts = sample_texts(srcs, fields, max_bytes=sample_bytes, txt_split=txt_split, on_bad_utf8=on_bad_utf8)
    corpus = "\n".join(texts).encode("utf-8")
    if not corpus.strip():
      raise DataError("empty dataset: the sources hold no text to train the bpe tokenizer on")
    log.info("training a %d-token BPE on a %.1f MB sample of %d documents", bpe_vocab_size, len(corpus) / 1e6,
             len(texts))
    tok = SentencePieceTokenizer.train(corpus, bpe_vocab_size, cache_dir)
    extra = {"trained_on": {"documents": len(texts), "bytes": len(corpus)}}
  else:
    tok = get_tokenizer(spec)
  file = getattr(tok, "path", None) if kind != "byte" else None
  return tok, file, extra


def _arguments(srcs: Sequence[sources_lib.Source], fields: sources_lib.Fields, tokenizer: str, *,
               shard_tokens: int, on_bad_utf8: str, txt_split: str, bpe_vocab_size: int,
               sample_bytes: int) -> dict[str, Any]:
  """Everything the output depends on (a rerun must match it to resume)."""
  args: dict[str, Any] = {
      "format": FORMAT, "sources": [dict(s.describe(), mtime_ns=s.mtime_ns) for s in srcs],
      "fields": sources_lib.fields_text(fields), "txt_split": txt_split, "tokenizer": tokenizer.strip(),
      "shard_tokens": shard_tokens, "on_bad_utf8": on_bad_utf8}
  spec = tokenizer.strip()
  if spec == "bpe":
    args.update(bpe_vocab_size=bpe_vocab_size, train_tokenizer_sample_bytes=sample_bytes)
  elif spec.startswith(("spm:", "hf:")):
    path = pathlib.Path(spec.split(":", 1)[1]).expanduser()
    if spec.startswith("hf:") and path.is_dir():
      path = path / "tokenizer.json"
    args["tokenizer_sha256"] = sha256_file(path) if path.is_file() else None
  return args


def _differences(a: dict[str, Any], b: dict[str, Any]) -> str:
  keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
  return ", ".join(keys) or "nothing"


def _ours(name: str) -> bool:
  """A name `prepare` may write (it deletes only such files, and only in a directory it owns)."""
  return (name in (MANIFEST, PROGRESS, LOCK, "tokenizer.model", "tokenizer.json", *TOKENIZER_EXTRAS)
          or name.endswith(".tmp") or (name.startswith("shard-") and name.endswith(".npy")))


def _peak_rss_mb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _json_of(file: pathlib.Path) -> Any:
  try:
    return json.loads(file.read_text(encoding="utf-8"))
  except (OSError, ValueError):
    return None


def _owned(root: pathlib.Path) -> bool:
  """Whether `root` holds a prepared dataset, an unfinished prepare or a prepare's lock (ours to write)."""
  manifest, progress, lock = (_json_of(root / n) if (root / n).is_file() else None for n in (MANIFEST, PROGRESS, LOCK))
  return ((isinstance(manifest, dict) and manifest.get("format") == FORMAT)
          or (isinstance(progress, dict) and isinstance(progress.get("arguments"), dict)
              and progress["arguments"].get("format") == FORMAT)
          or (isinstance(lock, dict) and lock.get("format") == FORMAT))


def _clear(root: pathlib.Path) -> None:
  """Delete the files of ours in a directory we own (never the lock: it is held)."""
  for p in root.iterdir():
    if _ours(p.name) and p.name != LOCK and p.is_file():
      p.unlink()


def _refuse_foreign(root: pathlib.Path) -> None:
  """DataError unless `root` is missing, empty or ours with nothing else in it."""
  if not root.exists():
    return
  if not root.is_dir():
    raise DataError(f"output {root} exists and is not a directory")
  names = sorted(p.name for p in root.iterdir())
  if not names:
    return
  foreign = names if not _owned(root) else [n for n in names if not _ours(n)]
  if foreign:
    raise DataError(f"output {root} holds files that are not part of a prepared dataset ({', '.join(foreign[:5])}"
                    f"{', ...' if len(foreign) > 5 else ''}): choose an empty or new directory (tformer-prepare "
                    "writes only into a directory of its own and deletes no file it did not write)")


class _Lock:
  """`root/.prepare.lock`: an flock held while a prepare writes `root` (the kernel drops it when the holder
  dies), the holder's pid and command in the file for the message."""

  def __init__(self, root: pathlib.Path):
    self.path = root / LOCK
    self.fd: int | None = None

  def acquire(self) -> _Lock:
    while True:
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        holder = _json_of(self.path) or {}
        os.close(fd)
        raise DataError(f"output {self.path.parent} is being written by another tformer-prepare (pid "
                        f"{holder.get('pid', '?')} on {holder.get('host', '?')} since {holder.get('started', '?')}): "
                        "wait for it to finish, or choose another --out") from None
      try:
        same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
      except FileNotFoundError:
        same = False
      if same:          # else the holder we waited for removed the file: lock the new one
        break
      os.close(fd)
    info = {"format": FORMAT, "pid": os.getpid(), "host": socket.gethostname(),
            "started": datetime.datetime.now().isoformat(timespec="seconds"), "argv": sys.argv}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(info).encode(), 0)
    self.fd = fd
    return self

  def release(self, remove: bool) -> None:
    if self.fd is None:
      return
    try:
      if remove:
        self.path.unlink(missing_ok=True)
    finally:
      fcntl.flock(self.fd, fcntl.LOCK_UN)
      os.close(self.fd)
      self.fd = None


def _check_out_dir(root: pathlib.Path, args: dict[str, Any], overwrite: bool) -> dict[str, Any] | None:
  """(Under the lock) the progress to resume from; None to start afresh; {'complete': True} for a finished
  dataset of these arguments; {'overwrite': True} to build a replacement beside it. DataError when the
  directory holds something else."""
  _refuse_foreign(root)
  if overwrite and any((root / n).is_file() for n in (MANIFEST, PROGRESS)):
    return {"overwrite": True}
  for name in (MANIFEST, PROGRESS):
    file = root / name
    if not file.is_file():
      continue
    found = _json_of(file)
    if not isinstance(found, dict):
      raise DataError(f"{file} is unreadable: pass --overwrite to prepare {root} again")
    old = found.get("arguments", {})
    if old != args:
      what = "a prepared dataset" if name == MANIFEST else "an unfinished prepare"
      raise DataError(f"output {root} holds {what} made with other arguments (differing: "
                      f"{_differences(old, args)}): pass --overwrite to replace it, or choose another directory")
    if name == MANIFEST:
      return {"complete": True}
    return found
  _clear(root)                                     # only leftovers of a run stopped before its first commit
  return None


def exchange_dirs(a: pathlib.Path, b: pathlib.Path) -> None:
  """Swap directories a and b atomically (renameat2 RENAME_EXCHANGE); two renames where the kernel or the
  filesystem lacks it."""
  try:
    libc = ctypes.CDLL(None, use_errno=True)
    at_fdcwd, rename_exchange = -100, 2
    if libc.renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
      return
    err = ctypes.get_errno()
    if err not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
      raise OSError(err, os.strerror(err), str(b))
  except AttributeError:                           # no renameat2 in this libc
    pass
  aside = a.with_name(a.name + ".old")
  os.rename(b, aside)
  os.rename(a, b)
  os.rename(aside, a)


def _remove_ours(root: pathlib.Path) -> None:
  """Delete `root` (a directory we own) if it then is empty: only our files go."""
  for p in root.iterdir():
    if _ours(p.name) and p.is_file():
      p.unlink()
  try:
    root.rmdir()
  except OSError:
    log.warning("left %s: it holds files that prepare did not write", root)


def _disk_error(root: pathlib.Path, e: OSError) -> DataError:
  where = f" ({e.filename})" if e.filename else ""
  if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
    hint = "free some space, then rerun the same command to resume (the committed shards are kept)"
  elif e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
    hint = "the output is not writable: choose another --out"
  else:
    hint = "the committed shards are kept; rerun the same command to resume"
  return DataError(f"prepare {root}: {e.strerror or e}{where}: {hint}")


def _check_committed(root: pathlib.Path, state: dict[str, Any]) -> None:
  """Before resuming: the committed shards are intact; files past them (an uncommitted shard) are removed."""
  names = set()
  for entry in state["shards"]:
    for kind in ("tokens", "offsets"):
      file = root / entry[kind]
      names.add(entry[kind])
      if not file.is_file() or sha256_file(file) != entry["sha256"][kind]:
        raise DataError(f"{file}: {'missing' if not file.is_file() else 'checksum mismatch'} in the unfinished "
                        f"prepare of {root}; pass --overwrite to start again")
  for p in root.iterdir():
    if p.name.endswith(".tmp") or (p.name.startswith("shard-") and p.name not in names):
      p.unlink()


def prepare(sources: Sequence[str] | str, out_dir: str | os.PathLike, *, tokenizer: str,
            text_field: str | Sequence[str] | None = None, column: str | Sequence[str] | None = None,
            workers: int = 1, shard_tokens: int = DEFAULT_SHARD_TOKENS, on_bad_utf8: str = "skip",
            bpe_vocab_size: int = DEFAULT_BPE_VOCAB, train_tokenizer_sample_bytes: int = DEFAULT_SAMPLE_BYTES,
            txt_split: str = "file", overwrite: bool = False, progress: bool = True,
            cache_dir: str | os.PathLike | None = None, unit_bytes: int = sources_lib.BLOCK_BYTES) -> dict[str, Any]:
  """Tokenize `sources` into the prepared dataset `out_dir` (see the module docstring); resumes an
  interrupted run with the same arguments. `workers` processes tokenize: this one and workers - 1 spawned;
  each task is about `unit_bytes` of input (this changes nothing in the output).
  Returns stats: documents, tokens, bytes (UTF-8 text), seconds (all), tokenizer_seconds (sampling and BPE
  training), encode_seconds (the rest: reading, tokenizing, writing; worker start-up not hidden by the
  tokenizer's), mb_per_s and tokens_per_s (over encode_seconds), skipped, peak_rss_mb (this process),
  worker_peak_rss_mb (the largest spawned process; 0 with 1 worker), shards, resumed."""
  t0 = time.perf_counter()
  if on_bad_utf8 not in ("skip", "fail"):
    raise DataError(f"on_bad_utf8 must be 'skip' or 'fail', got {on_bad_utf8!r}")
  if workers < 1:
    raise DataError(f"workers must be >= 1, got {workers}")
  if shard_tokens < 1:
    raise DataError(f"shard_tokens must be >= 1, got {shard_tokens}")
  if text_field is not None and column is not None:
    raise DataError("pass the text field(s) as text_field (--field) or column (--column), not both")
  if txt_split not in sources_lib.TXT_SPLITS:
    raise DataError(f"txt_split must be one of {', '.join(sources_lib.TXT_SPLITS)}, got {txt_split!r}")
  kind = _tokenizer_kind(tokenizer)
  fields = sources_lib.parse_fields(text_field if text_field is not None else column)
  srcs = sources_lib.resolve_sources(sources)
  sources_lib.check_fields(srcs, fields)
  root = pathlib.Path(out_dir).expanduser()
  # an output inside a source directory: its own files (manifest.json, ...) are not sources
  srcs = [s for s in srcs if not (root.absolute() in pathlib.Path(s.path).parents and _ours(pathlib.Path(s.path).name))]
  if not srcs:
    raise DataError(f"no sources besides the output {root}'s own files")
  args = _arguments(srcs, fields, tokenizer, shard_tokens=shard_tokens, on_bad_utf8=on_bad_utf8,
                    txt_split=txt_split, bpe_vocab_size=bpe_vocab_size, sample_bytes=train_tokenizer_sample_bytes)
  _refuse_foreign(root)                            # before creating anything (the lock) in it
  created = not root.exists()
  try:
    root.mkdir(parents=True, exist_ok=True)
    lock = _Lock(root).acquire()
  except OSError as e:
    found = _json_of(root / MANIFEST) if (root / MANIFEST).is_file() else None
    if not overwrite and isinstance(found, dict) and found.get("arguments") == args:
      return _already_prepared(root, workers)      # finished, on a read-only disk: nothing to write
    raise _disk_error(root, e) from None
  done = started = False
  try:
    state = _check_out_dir(root, args, overwrite)
    if state is not None and state.get("complete"):
      done = True
      return _already_prepared(root, workers)
    target = root
    if state is not None and state.get("overwrite"):   # build beside it, then exchange the two
      target = pathlib.Path(tempfile.mkdtemp(dir=root.parent, prefix=f".{root.name}.overwrite-"))
      state = None
    started = target == root
    pool = _Pool(workers)
    try:
      stats = _prepare(srcs, target, fields, args, state, pool, t0, tokenizer=tokenizer, kind=kind,
                       workers=workers, shard_tokens=shard_tokens, on_bad_utf8=on_bad_utf8,
                       bpe_vocab_size=bpe_vocab_size, sample_bytes=train_tokenizer_sample_bytes,
                       txt_split=txt_split, progress=progress, cache_dir=cache_dir, unit_bytes=unit_bytes)
    except BaseException:
      if target != root:
        _remove_ours(target)
      raise
    finally:
      pool.shutdown()
    if target != root:
      exchange_dirs(target, root)
      _remove_ours(target)                         # the replaced dataset (all ours: checked above)
      _fsync_dir(root.parent)
      stats["path"] = str(root)
    log.info("prepared %s: %d documents, %d tokens in %d shards (%.1f MB/s of text, %.1f s)", root,
             stats["documents"], stats["tokens"], stats["shards"], stats["mb_per_s"], stats["seconds"])
    done = True
    return stats
  except OSError as e:
    raise _disk_error(root, e) from None
  finally:
    _release(root, lock, done, started and not done, created)


def _release(root: pathlib.Path, lock: _Lock, done: bool, failed: bool, created: bool) -> None:
  """A finished dataset is owned by its manifest, an unfinished one by its progress: the lock file goes.
  A run that failed before its first commit leaves nothing of its own (a directory it created goes too)."""
  try:
    if failed and not (root / PROGRESS).is_file() and not (root / MANIFEST).is_file():
      _clear(root)
    lock.release(remove=True)
    if created and not done and not any(root.iterdir()):
      root.rmdir()
  except OSError as e:
    log.warning("prepare %s: could not tidy up (%s)", root, e)


def _already_prepared(root: pathlib.Path, workers: int) -> dict[str, Any]:
  ds = open_prepared(root)
  log.info("%s is already prepared with these arguments (%d documents, %d tokens)", root, ds.num_documents,
           ds.num_tokens)
  return {"documents": ds.num_documents, "tokens": ds.num_tokens, "bytes": 0, "seconds": 0.0, "mb_per_s": 0.0,
          "tokens_per_s": 0.0, "skipped": ds.manifest["skipped_documents"], "peak_rss_mb": _peak_rss_mb(),
          "worker_peak_rss_mb": 0.0, "shards": len(ds.shards), "workers": workers, "resumed": False,
          "already_prepared": True, "path": str(root)}


def _prepare(srcs: Sequence[sources_lib.Source], root: pathlib.Path, fields: sources_lib.Fields,
             args: dict[str, Any], state: dict[str, Any] | None, pool: _Pool, t0: float, *, tokenizer: str, kind: str,
             workers: int, shard_tokens: int, on_bad_utf8: str, bpe_vocab_size: int, sample_bytes: int,
             txt_split: str, progress: bool, cache_dir: str | os.PathLike | None, unit_bytes: int) -> dict[str, Any]:
  resumed = state is not None
  if state is None:
    tok, file, extra = _setup_tokenizer(tokenizer, srcs, fields, bpe_vocab_size=bpe_vocab_size,
                                        sample_bytes=sample_bytes, txt_split=txt_split,
                                        on_bad_utf8=on_bad_utf8, cache_dir=cache_dir)
    dtype = token_dtype(tok.vocab_size)
    copy, extras = None, {}
    if file is not None:
      copy = "tokenizer.json" if kind == "hf" else "tokenizer.model"
      _write(root / copy, pathlib.Path(file).read_bytes())
      for name in TOKENIZER_EXTRAS if kind == "hf" else ():     # its chat template and special tokens travel too
        if (pathlib.Path(file).parent / name).is_file():
          _write(root / name, (pathlib.Path(file).parent / name).read_bytes())
          extras[name] = sha256_file(root / name)
    info = {"spec": tokenizer.strip(), "name": tok.name, "vocab_size": int(tok.vocab_size),
            "sha256": sha256_file(root / copy) if copy else hashlib.sha256(tok.name.encode()).hexdigest(),
            "file": copy, **({"extra_files": extras} if extras else {}), **extra}
    state = {"arguments": args, "tokenizer": info, "eos_id": tok.eos_id, "bos_id": tok.bos_id,
             "dtype": dtype.name, "shards": [], "next": {"position": Position().as_dict(), "record": 0},
             "counts": {"documents": 0, "tokens": 0, "not_utf8": 0, "empty": 0}}
    write_atomic(root / PROGRESS, json.dumps(state, indent=1).encode())
  else:
    _check_committed(root, state)
    log.info("resuming the prepare of %s after %d shards (%d documents)", root, len(state["shards"]),
             state["counts"]["documents"])
  info = state["tokenizer"]
  dtype = np.dtype(state["dtype"])
  recipe = _Recipe(kind, str(root / info["file"]) if info["file"] else None, state["eos_id"], dtype.str, fields,
                   on_bad_utf8, txt_split)
  writer = _Writer(root, dtype, shard_tokens, state)
  start = Position(**state["next"]["position"])
  skip_first = int(state["next"]["record"])
  total_input = sum(s.bytes for s in srcs)
  done_input = sum(s.bytes for s in srcs[:start.source]) + start.offset * (srcs[start.source].format in
                                                                             ("txt", "jsonl"))
  text_bytes, worker_rss_kb, tokens_before = 0, 0, state["counts"]["tokens"]
  bar = tqdm.tqdm(total=total_input, initial=done_input, unit="B", unit_scale=True, disable=not progress,
                  desc=f"prepare {root.name}", dynamic_ncols=True, leave=True)
  t_run = time.perf_counter()
  try:
    units = sources_lib.iter_units(srcs, fields, txt_split=txt_split, start=start, block_bytes=unit_bytes)
    for position, input_bytes, (tokens, lengths, nbytes, rss_kb) in _results(units, pool, recipe):
      writer.add(position, tokens, lengths, skip_first if position == start else 0)
      text_bytes += nbytes
      worker_rss_kb = max(worker_rss_kb, rss_kb)
      if progress:
        dt = max(time.perf_counter() - t_run, 1e-9)
        counts = state["counts"]
        bar.set_postfix_str(f"docs {counts['documents'] + sum(len(x) for x in writer.lengths):,} "
                            f"tokens {counts['tokens'] + writer.tokens:,} text {text_bytes / 1e6 / dt:.1f} MB/s",
                            refresh=False)
        bar.update(input_bytes)
    writer.close(None)
  finally:
    bar.close()
  counts = state["counts"]
  if counts["documents"] == 0:
    _clear(root)
    raise DataError(f"empty dataset: the sources ({', '.join(s.path for s in srcs[:3])}"
                    f"{', ...' if len(srcs) > 3 else ''}) hold no documents ({counts['empty']} empty, "
                    f"{counts['not_utf8']} not UTF-8 skipped)")
  if counts["not_utf8"]:
    log.warning("skipped %d documents that are not valid UTF-8 (on_bad_utf8=skip)", counts["not_utf8"])
  manifest = {
      "format": FORMAT, "dtype": dtype.name, "tokenizer": state["tokenizer"], "eos_id": state["eos_id"],
      "bos_id": state["bos_id"], "convention": _convention(state["eos_id"]),
      "num_documents": counts["documents"], "num_tokens": counts["tokens"],
      "skipped_documents": {"not_utf8": counts["not_utf8"], "empty": counts["empty"]},
      "sources": [s.describe() for s in srcs], "text_field": sources_lib.fields_text(fields) or None,
      "txt_split": txt_split, "shard_tokens": shard_tokens, "shards": state["shards"], "arguments": args}
  _write(root / MANIFEST, (json.dumps(manifest, indent=1, ensure_ascii=False) + "\n").encode("utf-8"))
  (root / PROGRESS).unlink(missing_ok=True)
  _fsync_dir(root)
  seconds = time.perf_counter() - t0
  run_seconds = max(time.perf_counter() - t_run, 1e-9)
  stats = {"documents": counts["documents"], "tokens": counts["tokens"], "bytes": text_bytes,
           "seconds": seconds, "tokenizer_seconds": t_run - t0, "encode_seconds": run_seconds,
           "mb_per_s": text_bytes / 1e6 / run_seconds,
           "tokens_per_s": (counts["tokens"] - tokens_before) / run_seconds,
           "skipped": manifest["skipped_documents"], "peak_rss_mb": _peak_rss_mb(),
           "worker_peak_rss_mb": worker_rss_kb / 1024,
           "shards": len(state["shards"]), "workers": workers, "units": dict(pool.units), "resumed": resumed,
           "already_prepared": False,
           "path": str(root)}
  return stats


# --- the ceiling -----------------------------------------------------------------------------------

def _ceiling_child(kind: str, file: str | None, texts: list[str], threads: int) -> tuple[int, float]:
  os.environ["RAYON_NUM_THREADS"] = str(threads)      # before the library's first parallel call
  tok = _load_tokenizer(kind, file)
  t = time.perf_counter()
  ids = tok.encode_batch(texts, num_threads=threads)
  return sum(len(x) for x in ids), time.perf_counter() - t


def tokenizer_ceiling(texts: Sequence[str], tokenizer: str | Tokenizer, *, threads: int = 1) -> dict[str, Any]:
  """The tokenizer library's own batch encode of `texts` on `threads` threads (sentencepiece's encode of a
  list with num_threads, HF tokenizers' encode_batch on a pool of `threads`): {bytes, tokens, seconds,
  mb_per_s, tokens_per_s, threads}. The throughput `prepare` (reading, parsing, writing included) is
  compared with."""
  tok = get_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
  texts = list(texts)
  nbytes = sum(len(t.encode("utf-8")) for t in texts)
  if isinstance(tok, HFTokenizer) and threads > 1:
    ctx = multiprocessing.get_context("spawn")        # the thread pool's size is fixed at its first use
    with ctx.Pool(1) as pool:
      ntok, seconds = pool.apply(_ceiling_child, ("hf", str(tok.path), texts, threads))
  else:
    t = time.perf_counter()
    ids = tok.encode_batch(texts, num_threads=threads)
    seconds = time.perf_counter() - t
    ntok = sum(len(x) for x in ids)
  seconds = max(seconds, 1e-9)
  return {"bytes": nbytes, "tokens": ntok, "seconds": seconds, "mb_per_s": nbytes / 1e6 / seconds,
          "tokens_per_s": ntok / seconds, "threads": threads}


def remove_prepared(path: str | os.PathLike) -> None:
  """Delete a prepared dataset directory (only one of ours holding nothing but a prepared dataset's files)."""
  root = pathlib.Path(path)
  _refuse_foreign(root)
  if root.is_dir() and any(root.iterdir()) and not _owned(root):
    raise DataError(f"{root} is not a prepared dataset")
  shutil.rmtree(root)


# --- the data a training run reads: identity and a cheap integrity check ----------------------------

RUN_DATA = "data.json"         # in a training workdir: the prepared datasets it trains on, and their check
RUN_DATA_FORMAT = "tformer_jax.run_data/1"


def tokenizer_sha256(spec: str) -> str | None:
  """What identifies tokenizer `spec` without training anything: the sha256 of its file (hf:, spm:), of
  the name for the byte tokenizer (as manifests record it); None for 'bpe' (trained on the data) or a
  file that is not there."""
  spec = str(spec).strip()
  if spec == "byte":
    return hashlib.sha256(b"byte").hexdigest()
  if spec.startswith(("hf:", "spm:")):
    path = pathlib.Path(spec.split(":", 1)[1]).expanduser()
    if spec.startswith("hf:") and path.is_dir():
      path = path / "tokenizer.json"
    return sha256_file(path) if path.is_file() else None
  return None


def tokenizer_spec(ds: PreparedDataset) -> str:
  """The tokenizer spec that loads `ds`'s own tokenizer (its copy in the directory)."""
  file = ds.manifest["tokenizer"].get("file")
  if not file:
    return "byte"
  return f"{'hf' if file.endswith('.json') else 'spm'}:{(ds.path / file).absolute()}"


def dataset_identity(ds: PreparedDataset) -> dict[str, Any]:
  """What a run trained on `ds` depends on: its shards' checksums and its tokenizer (sha256 of them all)."""
  t = ds.manifest["tokenizer"]
  content = [ds.manifest["dtype"], ds.eos_id, t.get("sha256"), [e["sha256"] for e in ds.manifest["shards"]]]
  return {"path": str(ds.path.absolute()), "sha256": hashlib.sha256(json.dumps(content).encode()).hexdigest(),
          "num_tokens": ds.num_tokens, "tokenizer": {k: t.get(k) for k in ("spec", "name", "vocab_size", "sha256")}}


def check_shards(ds: PreparedDataset, known: dict[str, list[int]] | None = None) -> dict[str, list[int]]:
  """Every token shard of `ds` checked against the manifest (sha256, and every id inside the vocabulary)
  unless its size, mtime, ctime and inode match `known` (an earlier check's record); the offsets are
  checked at open.
  DataError naming the shard (and, for an id outside the vocabulary, its offset). Returns the record."""
  out = {}
  for entry in ds.manifest["shards"]:
    file = ds.path / entry["tokens"]
    st = file.stat()
    stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]     # ctime: no write leaves it as it was
    if (known or {}).get(entry["tokens"]) != stamp:
      tokens = ds.shards[len(out)][0]
      if len(tokens) and int(tokens.max()) >= ds.vocab_size:
        at = int(np.argmax(np.asarray(tokens) >= ds.vocab_size))
        raise DataError(f"{file}: token id {int(tokens[at])} at offset {at} is outside the vocabulary "
                        f"({ds.vocab_size} ids): the file is damaged; prepare the dataset again")
      got = sha256_file(file)
      if got != entry["sha256"]["tokens"]:
        raise DataError(f"{file}: checksum mismatch (sha256 {got[:16]}..., the manifest says "
                        f"{entry['sha256']['tokens'][:16]}...): the file is damaged; prepare the dataset again")
    out[entry["tokens"]] = stamp
  return out


def _checked_file(ds: PreparedDataset, cache_dir: str | os.PathLike | None) -> pathlib.Path:
  key = hashlib.sha256(str(ds.path.absolute()).encode()).hexdigest()[:20]
  return cache_root(cache_dir) / "checked" / f"{key}.json"


def check_run_data(workdir: str | os.PathLike, datasets: Sequence[PreparedDataset], *, resuming: bool,
                   cache_dir: str | os.PathLike | None = None) -> dict[str, Any]:
  """Before a run changes anything in `workdir`: a resumed run's prepared datasets are the ones it started
  on (a directory prepared again with other text or another tokenizer is a DataError naming it), and
  each dataset's shards pass `check_shards`: hashed once, then again only when a file changed (the
  record is kept in the workdir and, for other runs on the same data, in the cache). Returns the record
  `write_run_data` keeps in WORKDIR/data.json."""
  file = pathlib.Path(workdir) / RUN_DATA
  old = _json_of(file) if file.is_file() else None
  old = old if isinstance(old, dict) and old.get("format") == RUN_DATA_FORMAT else {}
  before = {d["path"]: d for d in old.get("datasets", [])}
  ids = [dataset_identity(ds) for ds in datasets]
  if resuming:
    for new in ids:
      was = before.get(new["path"])
      if was is not None and was["sha256"] != new["sha256"]:
        what = ("another tokenizer" if was["tokenizer"].get("sha256") != new["tokenizer"].get("sha256")
                else "other text")
        raise DataError(f"prepared:{new['path']} changed since this run started in {workdir}: it was prepared "
                        f"again with {what} ({was['num_tokens']:,} tokens then, {new['num_tokens']:,} now; data "
                        f"sha256 {was['sha256'][:12]} then, {new['sha256'][:12]} now): resume on the data the run "
                        "started on, or start a new --workdir")
  t0 = time.perf_counter()
  known, verified = old.get("verified", {}), {}
  for ds in datasets:
    path = str(ds.path.absolute())
    shared = _checked_file(ds, cache_dir)
    earlier = known.get(path) or (_json_of(shared) if shared.is_file() else None)
    verified[path] = check_shards(ds, earlier if isinstance(earlier, dict) else None)
    if verified[path] != earlier:
      try:
        write_atomic(shared, json.dumps(verified[path]).encode())
      except OSError as e:
        log.warning("data: could not record the check of %s in %s (%s)", path, shared, e)
  if datasets:
    log.info("data: %d prepared dataset(s) checked (%.2f s)", len(datasets), time.perf_counter() - t0)
  return {"format": RUN_DATA_FORMAT, "datasets": ids, "verified": verified}


def write_run_data(workdir: str | os.PathLike, record: dict[str, Any]) -> None:
  if record["datasets"]:
    write_atomic(pathlib.Path(workdir) / RUN_DATA, (json.dumps(record, indent=1) + "\n").encode())


def read_run_data(workdir: str | os.PathLike) -> dict[str, Any] | None:
  """WORKDIR/data.json (the prepared datasets a run trained on), None when there is none."""
  file = pathlib.Path(workdir).expanduser() / RUN_DATA
  found = _json_of(file) if file.is_file() else None
  return found if isinstance(found, dict) and found.get("format") == RUN_DATA_FORMAT else None
