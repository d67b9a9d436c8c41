"""Writing a prepared dataset: files committed atomically (temporary file, fsync, rename) and the shard
writer that commits each closed shard together with the progress that follows it."""
from __future__ import annotations

import hashlib
import io
import json
import os
import pathlib
from typing import Any, Sequence

import numpy as np

from tformer_jax.data.corpora import write_atomic
from tformer_jax.data.prepared.dataset import PROGRESS, shard_files
from tformer_jax.data.sources import EMPTY, NOT_UTF8, Position


def write_file(path: pathlib.Path, data: bytes) -> None:
  """write_atomic, readable as an ordinary new file is (write_atomic's temporary file is private: 0600)."""
  write_atomic(path, data)
  umask = os.umask(0)
  os.umask(umask)
  os.chmod(path, 0o666 & ~umask)


def fsync_dir(path: pathlib.Path) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def write_npy(path: pathlib.Path, chunks: Sequence[np.ndarray], dtype: np.dtype) -> str:
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


class ShardWriter:
  """Accumulates documents into shards; each closed shard is committed with the progress that follows it."""

  def __init__(self, root: pathlib.Path, dtype: np.dtype, shard_tokens: int, state: dict[str, Any]):
    self.root, self.dtype, self.shard_tokens, self.state = root, dtype, shard_tokens, state
    self.chunks: list[np.ndarray] = []
    self.lengths: list[np.ndarray] = []
    self.tokens = 0
    self.committed_this_run = 0

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
               "sha256": {"tokens": write_npy(self.root / tokens_name, self.chunks, self.dtype),
                          "offsets": write_npy(self.root / offsets_name, [offsets], np.dtype("<i8"))}}
      self.state["shards"].append(entry)
      self.state["counts"]["documents"] += entry["num_documents"]
      self.state["counts"]["tokens"] += entry["num_tokens"]
      self.chunks, self.lengths, self.tokens = [], [], 0
      self.committed_this_run += 1
    self.state["next"] = next_position
    fsync_dir(self.root)
    write_atomic(self.root / PROGRESS, json.dumps(self.state, indent=1).encode())
