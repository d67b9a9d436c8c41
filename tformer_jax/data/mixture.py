"""Mixture maths: the rows each dataset of a mixture holds per block of MIX_BLOCK rows (its weight,
largest-remainder rounded), and global row g -> (dataset, row of that dataset's stream), drawn per
block from rng([seed, block])."""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import numpy as np

from tformer_jax.data.corpora import DataError

MIX_BLOCK = 1000            # mixture rows per block: proportions are exact per block, to 1/MIX_BLOCK


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

