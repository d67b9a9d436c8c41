"""Grain batch pipelines over a tokenized corpus (or a synthetic task), resumable and process-sharded.

`build_dataset(data_cfg)` loads + tokenizes + splits (all cached); `train_iterator` yields
{'inputs', 'targets'} int32 (batch_size // process_count, seq_len), targets = inputs shifted by one
(each row is a window of seq_len+1 tokens). Text batches carry no 'loss_mask' (every position counts:
use `batch.get('loss_mask')`); synthetic batches add a float32 'loss_mask' over the answer span.

The pipeline is a grain MapDataset of global rows: row g of the run is a pure function of (seed, g):
  random   window start drawn from np.random.default_rng([seed, g]) over the train split
  packed   consecutive windows (stride seq_len) in an order reshuffled every epoch (grain shuffle)
Process p of P takes rows g = p, p+P, p+2P, ... and batches them, so the processes' shards are
disjoint and together they form the global batch rows [step*B, (step+1)*B) whatever P is. The
iterator (`BatchIterator`, a grain DatasetIterator) resumes exactly: its state is the batch index.
"""
from __future__ import annotations

import dataclasses
import logging
import sys
from typing import Any, Iterator

import grain
import numpy as np
from absl import flags

from tformer_jax.data import synthetic
from tformer_jax.data.corpora import DataError, load_corpus, split_tokens
from tformer_jax.data.tokenizers import Tokenizer, encode_corpus, get_tokenizer

log = logging.getLogger(__name__)

_FIELDS = dict(corpus="shakespeare", tokenizer="byte", bpe_vocab_size=2048, seq_len=256,
               batch_size=32, val_fraction=0.05, sampling="random", cache_dir="", worker_count=0,
               seed=0)


def _cfg(data_cfg: Any, name: str) -> Any:
  try:
    return data_cfg[name]
  except (KeyError, AttributeError):
    return _FIELDS[name]


@dataclasses.dataclass
class Dataset:
  """A tokenized corpus split in two, or (train/val_tokens None) a synthetic task."""
  tokenizer: Tokenizer
  train_tokens: np.ndarray | None
  val_tokens: np.ndarray | None
  task: synthetic.SyntheticTask | None = None

  @property
  def vocab_size(self) -> int:
    return self.tokenizer.vocab_size


def build_dataset(data_cfg: Any) -> Dataset:
  """Load, tokenize and split `data_cfg.corpus` (cached); errors when a split can't hold one window."""
  spec, seq_len = str(_cfg(data_cfg, "corpus")), int(_cfg(data_cfg, "seq_len"))
  if seq_len <= 0:
    raise DataError(f"data.seq_len must be positive, got {seq_len}")
  if spec.startswith("synthetic:"):
    task = synthetic.parse_synthetic(spec, seq_len)
    return Dataset(task.vocab, None, None, task=task)
  cache_dir = _cfg(data_cfg, "cache_dir") or None
  corpus = load_corpus(spec, cache_dir)
  tok = get_tokenizer(str(_cfg(data_cfg, "tokenizer")), corpus=corpus,
                      vocab_size=int(_cfg(data_cfg, "bpe_vocab_size")), cache_dir=cache_dir)
  tokens = encode_corpus(tok, corpus, cache_dir)
  val_fraction = float(_cfg(data_cfg, "val_fraction"))
  train, val = split_tokens(tokens, val_fraction)
  if min(len(train), len(val)) < seq_len + 1:
    raise DataError(
        f"corpus {spec!r} is too short: {len(tokens)} tokens with tokenizer {tok.name!r} split into "
        f"train={len(train)} and validation={len(val)} (val_fraction={val_fraction}); each split "
        f"needs at least seq_len+1={seq_len + 1} tokens. Use more text, a smaller seq_len or a "
        "larger val_fraction.")
  log.info("data: %s, %d tokens (train %d, val %d), tokenizer %s (vocab %d)", spec, len(tokens),
           len(train), len(val), tok.name, tok.vocab_size)
  return Dataset(tok, train, val)


@dataclasses.dataclass(frozen=True)
class _RandomWindow:
  """Global row g -> a window of seq_len+1 tokens at a start drawn from rng([seed, g])."""
  tokens: np.ndarray
  seq_len: int
  seed: int

  def __call__(self, g: int) -> np.ndarray:
    high = len(self.tokens) - self.seq_len       # starts 0 .. len - (seq_len+1)
    start = int(np.random.default_rng([self.seed, int(g)]).integers(0, high))
    return self.tokens[start:start + self.seq_len + 1]


@dataclasses.dataclass(frozen=True)
class _Window:
  """Window index k -> tokens[k*seq_len : k*seq_len + seq_len + 1]."""
  tokens: np.ndarray
  seq_len: int

  def __call__(self, k: int) -> np.ndarray:
    s = int(k) * self.seq_len
    return self.tokens[s:s + self.seq_len + 1]


def num_windows(tokens: np.ndarray, seq_len: int) -> int:
  """Non-overlapping windows (stride seq_len, seq_len+1 tokens each) in `tokens`."""
  return (len(tokens) - 1) // seq_len


def _text_batch(rows: list[np.ndarray]) -> dict[str, np.ndarray]:
  w = np.stack(rows).astype(np.int32)
  return {"inputs": w[:, :-1], "targets": w[:, 1:]}


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


def _global_rows(ds: Dataset, data_cfg: Any) -> grain.MapDataset:
  seq_len, seed = int(_cfg(data_cfg, "seq_len")), int(_cfg(data_cfg, "seed"))
  infinite = grain.MapDataset.range(sys.maxsize)
  if ds.task is not None:
    return infinite.map(synthetic.SyntheticRows(ds.task, seed, synthetic.TRAIN_STREAM))
  sampling = str(_cfg(data_cfg, "sampling"))
  if sampling == "random":
    return infinite.map(_RandomWindow(ds.train_tokens, seq_len, seed))
  if sampling == "packed":
    n = num_windows(ds.train_tokens, seq_len)
    return (grain.MapDataset.range(n).shuffle(seed=seed).repeat()
            .map(_Window(ds.train_tokens, seq_len)))
  raise DataError(f"unknown data.sampling {sampling!r}; expected 'random' or 'packed'")


class BatchIterator(grain.DatasetIterator):
  """Batches of an index-addressable grain MapDataset; the state is just the next batch index.

  Restoring builds a fresh grain pipeline from that index, so a state is portable across
  worker_count values (grain's own multiprocess states are not). A grain DatasetIterator, so
  `grain.checkpoint.CheckpointSave/Restore` and Orbax checkpoint it like any other.
  """

  def __init__(self, batches: grain.MapDataset, workers: int = 0, start: int = 0):
    super().__init__()
    self._batches, self._workers, self._next = batches, workers, int(start)
    self._it: grain.DatasetIterator | None = None

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
    return batch

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
  local = _local_batch(int(_cfg(data_cfg, "batch_size")), process_index, process_count)
  rows = _global_rows(ds, data_cfg)[process_index::process_count]
  batch_fn = synthetic.stack_rows if ds.task is not None else _text_batch
  batches = rows.batch(local, drop_remainder=True, batch_fn=batch_fn)
  return BatchIterator(batches, workers=int(_cfg(data_cfg, "worker_count")))


def eval_batches(ds: Dataset, data_cfg: Any, num_batches: int, *, process_index: int = 0,
                 process_count: int = 1) -> list[dict[str, np.ndarray]]:
  """`num_batches` fixed validation batches: evenly spaced windows over the whole validation split.

  Global row g of batch i is window i*B + g of the num_batches*B evenly spaced windows; process p
  gets rows p, p+P, ... like `train_iterator`. Synthetic tasks draw from a separate eval stream.
  """
  bsz = int(_cfg(data_cfg, "batch_size"))
  local = _local_batch(bsz, process_index, process_count)
  total = num_batches * bsz
  mine = [np.arange(i * bsz + process_index, (i + 1) * bsz, process_count)
          for i in range(num_batches)]
  if ds.task is not None:
    rows = synthetic.SyntheticRows(ds.task, int(_cfg(data_cfg, "seed")), synthetic.EVAL_STREAM)
    return [synthetic.stack_rows([rows(g) for g in idx]) for idx in mine]
  seq_len, val = int(_cfg(data_cfg, "seq_len")), ds.val_tokens
  last = len(val) - (seq_len + 1)
  if last < 0:
    raise DataError(f"validation split has {len(val)} tokens, fewer than seq_len+1={seq_len + 1}")
  starts = np.linspace(0, last, total).round().astype(np.int64) if total > 1 else np.zeros(1, int)
  out = []
  for idx in mine:
    assert len(idx) == local
    out.append(_text_batch([val[s:s + seq_len + 1] for s in starts[idx]]))
  return out


def iterate(it: Iterator[dict[str, np.ndarray]], n: int) -> list[dict[str, np.ndarray]]:
  """The next `n` batches of `it` (a small helper for tests and notebooks)."""
  return [next(it) for _ in range(n)]
