"""Seeded synthetic tasks for from-scratch experiments: copy, reverse, sort, associative recall.

Corpus spec: `synthetic:TASK` or `synthetic:TASK:n=8,symbols=32` (`n` items per example, default as
many as fit in seq_len; `symbols` data symbols, default 16).

Vocabulary (`SyntheticVocab`): data symbols 0..S-1, then SEP = S and PAD = S+1, so vocab_size = S+2.
Each example is a token sequence of exactly seq_len+1 tokens, right-padded with PAD:
  copy     x_1..x_n SEP x_1..x_n
  reverse  x_1..x_n SEP x_n..x_1
  sort     x_1..x_n SEP sorted(x)
  recall   k_1 v_1 .. k_n v_n SEP k_q v_q      (distinct keys, so n <= S; the answer is v_q)
Rows are {'inputs': seq[:-1], 'targets': seq[1:], 'loss_mask': float32, 1 exactly where the target is
part of the answer}. Row g of a stream is drawn from np.random.default_rng([seed, stream, g]), so a
stream is a pure function of (seed, index): resumable and identical on every host.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import jax.numpy as jnp
import numpy as np

from tformer_jax.data.corpora import DataError

TASKS = ("copy", "reverse", "sort", "recall")
_ALIASES = {"associative_recall": "recall", "assoc_recall": "recall", "mqar": "recall"}
TRAIN_STREAM, EVAL_STREAM = 0, 1


@dataclasses.dataclass(frozen=True)
class SyntheticVocab:
  """Tokenizer-like view of a synthetic vocabulary: symbols print as numbers, SEP '|', PAD '.'."""
  num_symbols: int
  name: str = "synthetic"

  @property
  def sep(self) -> int:
    return self.num_symbols

  @property
  def pad(self) -> int:
    return self.num_symbols + 1

  @property
  def vocab_size(self) -> int:
    return self.num_symbols + 2

  def encode(self, text: str | bytes) -> np.ndarray:
    text = text.decode() if isinstance(text, bytes) else text
    special = {"|": self.sep, ".": self.pad}
    try:
      ids = [special[t] if t in special else int(t) for t in text.split()]
    except ValueError as e:
      raise DataError(f"synthetic vocab encodes space-separated numbers, '|' and '.', got {text!r}") from e
    if any(not 0 <= i < self.vocab_size for i in ids):
      raise DataError(f"synthetic symbols must be in [0, {self.num_symbols}), got {text!r}")
    return np.asarray(ids, dtype=np.int32)

  def decode(self, ids: Iterable[int]) -> str:
    names = {self.sep: "|", self.pad: "."}
    return " ".join(names.get(int(i), str(int(i))) for i in np.asarray(ids).reshape(-1))


@dataclasses.dataclass(frozen=True)
class SyntheticTask:
  """One task at a fixed seq_len; `row(rng)` draws an example."""
  task: str
  seq_len: int
  num_symbols: int = 16
  n: int = 0                       # items per example; 0 = as many as fit

  def __post_init__(self):
    if self.task not in TASKS:
      raise DataError(f"unknown synthetic task {self.task!r}; known: {', '.join(TASKS)}")
    if self.num_symbols < 2:
      raise DataError(f"synthetic:{self.task}: symbols must be >= 2, got {self.num_symbols}")
    if self.n < 0:
      raise DataError(f"synthetic:{self.task}: n must be >= 0, got {self.n}")
    most = self.max_items
    if most < 1 or self.n > most:
      need = 2 * max(self.n, 1) + (3 if self.task == "recall" else 1) - 1
      raise DataError(f"synthetic:{self.task}: n={self.n or 1} items need seq_len >= {need}"
                      + (f" and n <= symbols={self.num_symbols}" if self.task == "recall" else "")
                      + f"; got seq_len={self.seq_len}")

  @property
  def max_items(self) -> int:
    total = self.seq_len + 1
    if self.task == "recall":
      return min(self.num_symbols, (total - 3) // 2)
    return (total - 1) // 2

  @property
  def items(self) -> int:
    return self.n or self.max_items

  @property
  def vocab(self) -> SyntheticVocab:
    return SyntheticVocab(self.num_symbols, name=f"synthetic-{self.task}-{self.num_symbols}")

  def sequence(self, rng: np.random.Generator) -> tuple[np.ndarray, int, int]:
    """(seq of seq_len+1 tokens, answer start, answer end) with the answer at seq[start:end]."""
    n, s, v = self.items, self.num_symbols, self.vocab
    if self.task == "recall":
      keys = rng.choice(s, size=n, replace=False)
      vals = rng.integers(0, s, size=n)
      q = int(rng.integers(0, n))
      body = np.concatenate([np.stack([keys, vals], 1).reshape(-1), [v.sep, keys[q], vals[q]]])
      start = 2 * n + 2
    else:
      x = rng.integers(0, s, size=n)
      y = {"copy": x, "reverse": x[::-1], "sort": np.sort(x)}[self.task]
      body = np.concatenate([x, [v.sep], y])
      start = n + 1
    seq = np.full(self.seq_len + 1, v.pad, dtype=np.int32)
    seq[:len(body)] = body
    return seq, start, len(body)

  def row(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
    seq, start, end = self.sequence(rng)
    mask = np.zeros(self.seq_len, dtype=np.float32)
    mask[start - 1:end - 1] = 1.0        # target t is seq[t + 1]
    return {"inputs": seq[:-1], "targets": seq[1:], "loss_mask": mask}


def parse_synthetic(spec: str, seq_len: int) -> SyntheticTask:
  """'synthetic:TASK[:n=N,symbols=S]' -> SyntheticTask."""
  parts = spec.split(":")
  if parts[0] != "synthetic" or len(parts) not in (2, 3) or not parts[1]:
    raise DataError(f"bad synthetic corpus {spec!r}; expected 'synthetic:TASK' or "
                    f"'synthetic:TASK:n=8,symbols=16' with TASK in {', '.join(TASKS)}")
  task = _ALIASES.get(parts[1], parts[1])
  opts: dict[str, int] = {}
  for kv in (parts[2].split(",") if len(parts) == 3 and parts[2] else []):
    key, _, val = kv.partition("=")
    if key not in ("n", "symbols") or not val.strip().isdigit():
      raise DataError(f"bad synthetic option {kv!r} in {spec!r}; known: n=INT, symbols=INT")
    opts[key] = int(val)
  return SyntheticTask(task, seq_len, num_symbols=opts.get("symbols", 16), n=opts.get("n", 0))


@dataclasses.dataclass(frozen=True)
class SyntheticRows:
  """Index -> row of stream `stream` (picklable, for grain workers)."""
  task: SyntheticTask
  seed: int
  stream: int = TRAIN_STREAM

  def __call__(self, index: int) -> dict[str, np.ndarray]:
    return self.task.row(np.random.default_rng([self.seed, self.stream, int(index)]))


def stack_rows(rows: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
  return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def exact_match_accuracy(logits_or_predictions: Any, batch: dict[str, Any]) -> Any:
  """Fraction of sequences whose every answer-span target (loss_mask > 0) is predicted exactly.

  Takes logits (B, L, V) (argmax taken) or predicted ids (B, L); without a loss_mask every position
  counts. Works on numpy and jax arrays (jit-friendly); returns a float32 scalar.
  """
  x = jnp.asarray(logits_or_predictions)
  targets = jnp.asarray(batch["targets"])
  pred = jnp.argmax(x, axis=-1) if x.ndim == targets.ndim + 1 else x
  ok = pred.astype(targets.dtype) == targets
  if batch.get("loss_mask") is not None:
    ok = ok | (jnp.asarray(batch["loss_mask"]) <= 0)
  return jnp.mean(jnp.all(ok, axis=-1).astype(jnp.float32))
