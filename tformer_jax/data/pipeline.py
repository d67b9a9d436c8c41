"""Grain batch pipelines over prepared (memory-mapped) token data or a synthetic task, resumable and
process-sharded.

Every text corpus is read as a prepared dataset (tformer_jax/data/prepared: token shards and a
document index, memory-mapped, never loaded whole): `prepared:DIR` directly, and the named corpora
(shakespeare, kjv, text:PATH) prepared once into the cache (data/cache.py), so there is one pipeline.
`build_dataset(data_cfg)` (data/datasets.py) opens and splits into token spans (data/tokens.py);
`train_iterator` yields {'inputs', 'targets'} int32 (batch_size // process_count, seq_len),
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
  mixture  (data.mixture 'SPEC=W,SPEC=W'; data/mixture.py): blocks of MIX_BLOCK rows hold each dataset's quota of
           rows (its weight, largest-remainder rounded) in an order drawn from rng([seed, block]);
           row g is row n of its dataset's own stream (random/packed as above, seeded per dataset)
Process p of P takes rows g = p, p+P, p+2P, ... and batches them, so the processes' shards are
disjoint and together they form the global batch rows [step*B, (step+1)*B) whatever P is. The
iterator (`BatchIterator`, a grain DatasetIterator) resumes exactly: its state is the batch index.
"""
from __future__ import annotations

import dataclasses
import logging
import sys
from typing import Any, Iterator, Sequence

import grain
import numpy as np
from absl import flags

from tformer_jax.config import parse_mixture
from tformer_jax.data import synthetic
from tformer_jax.data.cache import prepared_path
from tformer_jax.data.corpora import DataError
from tformer_jax.data.datasets import Dataset, MixPart, build_dataset, prepared_datasets, tokenizer_for
from tformer_jax.data.mixture import MIX_BLOCK, Mixture, mixture_quotas
from tformer_jax.data.settings import PACKINGS, SAMPLINGS, setting
from tformer_jax.data.tokens import ArrayTokens, PreparedTokens, Tokens, split_documents

log = logging.getLogger(__name__)

MIX_LOG_EVERY = 1000        # batches between two log lines of a mixture's realised proportions


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



@dataclasses.dataclass(frozen=True)
class _MixedRow:
  mixture: Mixture
  parts: tuple[grain.MapDataset, ...]

  def __call__(self, g: int):
    i, n = self.mixture.locate(g)
    return self.parts[i][n]


def _global_rows(ds: Dataset, data_cfg: Any) -> tuple[grain.MapDataset, Mixture | None]:
  seq_len, seed = int(setting(data_cfg, "seq_len")), int(setting(data_cfg, "seed"))
  infinite = grain.MapDataset.range(sys.maxsize)
  if ds.task is not None:
    return infinite.map(synthetic.SyntheticRows(ds.task, seed, synthetic.TRAIN_STREAM)), None
  sampling = str(setting(data_cfg, "sampling"))
  document = str(setting(data_cfg, "packing")) == "document"
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
  bsz = int(setting(data_cfg, "batch_size"))
  local = _local_batch(bsz, process_index, process_count)
  rows, mix = _global_rows(ds, data_cfg)
  batch_fn = synthetic.stack_rows if ds.task is not None else _stack
  batches = rows[process_index::process_count].batch(local, drop_remainder=True, batch_fn=batch_fn)
  if mix is not None:
    log.info("data mixture: %s (rows per block of %d: %s)",
             ", ".join(f"{p.name} {p.weight:.4f}" for p in ds.mixture), sum(mix.quotas),
             ", ".join(map(str, mix.quotas)))
  return BatchIterator(batches, workers=int(setting(data_cfg, "worker_count")), mixture=mix,
                       names=[p.name for p in ds.mixture], global_batch=bsz)


def eval_batches(ds: Dataset, data_cfg: Any, num_batches: int, *, process_index: int = 0,
                 process_count: int = 1) -> list[dict[str, np.ndarray]]:
  """`num_batches` fixed validation batches: evenly spaced windows over the whole validation split
  (a mixture: over each dataset's validation split, as many windows as its weight's share).

  Global row g of batch i is window i*B + g of the num_batches*B windows; process p gets rows
  p, p+P, ... like `train_iterator`. Synthetic tasks draw from a separate eval stream.
  """
  bsz = int(setting(data_cfg, "batch_size"))
  local = _local_batch(bsz, process_index, process_count)
  total = num_batches * bsz
  mine = [np.arange(i * bsz + process_index, (i + 1) * bsz, process_count)
          for i in range(num_batches)]
  if ds.task is not None:
    rows = synthetic.SyntheticRows(ds.task, int(setting(data_cfg, "seed")), synthetic.EVAL_STREAM)
    return [synthetic.stack_rows([rows(g) for g in idx]) for idx in mine]
  seq_len = int(setting(data_cfg, "seq_len"))
  document = str(setting(data_cfg, "packing")) == "document"
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


__all__ = ["MIX_BLOCK", "PACKINGS", "SAMPLINGS", "ArrayTokens", "BatchIterator", "Dataset", "MixPart", "Mixture",
           "PreparedTokens", "Tokens", "build_dataset", "eval_batches", "iterate", "mixture_quotas", "parse_mixture",
           "prepared_datasets", "prepared_path", "split_documents", "tokenizer_for", "train_iterator"]
