"""The processes that tokenize for `prepare`: the main process and `workers - 1` spawned ones, fed work
units in input order with bounded memory."""
from __future__ import annotations

import collections
import concurrent.futures
import concurrent.futures.process
import dataclasses
import multiprocessing
import multiprocessing.connection
import os
import resource
import signal
import threading
from typing import Any, Iterator

import numpy as np

from tformer_jax.data import sources as sources_lib
from tformer_jax.data.sources import EMPTY, Position, Unit
from tformer_jax.data.tokenizers import ByteTokenizer, HFTokenizer, SentencePieceTokenizer


@dataclasses.dataclass(frozen=True)
class Recipe:
  """What a worker needs to turn units into tokens (picklable)."""
  tokenizer_kind: str         # byte | spm | hf
  tokenizer_file: str | None
  eos_id: int | None
  dtype: str
  fields: sources_lib.Fields
  on_bad_utf8: str
  txt_split: str


_WORKER: dict[str, Any] = {}


def load_tokenizer(kind: str, file: str | None) -> Any:
  if kind == "byte":
    return ByteTokenizer()
  if kind == "hf":
    return HFTokenizer(file)
  return SentencePieceTokenizer(file)


def _worker_tokenizer(recipe: Recipe) -> Any:
  """This process's tokenizer for `recipe` (loaded at its first unit)."""
  if _WORKER.get("recipe") != recipe:
    _WORKER["tok"] = load_tokenizer(recipe.tokenizer_kind, recipe.tokenizer_file)
    _WORKER["recipe"] = recipe
  return _WORKER["tok"]


def _encode_unit(unit: Unit, recipe: Recipe) -> tuple[np.ndarray, np.ndarray, int, int]:
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


class Pool:
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


def results(units: Iterator[Unit], pool: Pool, recipe: Recipe
             ) -> Iterator[tuple[Position, int, tuple[np.ndarray, np.ndarray, int, int]]]:
  """(unit position, unit input bytes, result) in input order. A unit goes to a spawned process while fewer
  than 2 per process are in flight there, else the main process encodes it; at most 2 * workers + 2 units
  are held (bounded memory)."""
  window: collections.deque = collections.deque()
  limit = 2 * pool.workers + 2
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


