"""Token spans: a read-only window of a token stream with its document starts, held in memory
(`ArrayTokens`) or read from a prepared dataset's memory-mapped shards (`PreparedTokens`), and the
document-boundary train/validation cut."""
from __future__ import annotations

import mmap
import os
from typing import Any

import numpy as np

from tformer_jax.data import prepared as prepared_lib
from tformer_jax.data.corpora import DataError


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
