"""Continuous batching over a fixed number of cache slots.

Each slot is one sequence's cache (`decode.slot_caches`: independent one-row caches, each with its own
index, so sequences of any lengths share a step). A background thread loops: admit waiting requests
into free slots (one prefill each, `decode.append_tokens`), then run ONE compiled step for all slots
(`decode.slot_step`: sample every slot's next token with its own seed and settings, feed it), hand
each live request its token, free the slots of finished or cancelled requests. A request joins at the
next step and never waits for another to finish; the step's shapes never change, so it compiles once.
"""
from __future__ import annotations

import collections
import contextvars
import dataclasses
import threading
import time
from typing import Any, Callable

import flax.linen as nn
import jax
import numpy as np

from tformer_jax import decode


class EngineError(ValueError):
  """A request the engine refuses (too long, queue full): the server answers 4xx with the message."""


@dataclasses.dataclass
class Job:
  """One generation request and its progress. `on_token(job, token_id)` is called from the engine
  thread for every token; `on_done(job)` once at the end (finish_reason set)."""
  prompt: list[int]
  max_tokens: int
  temperature: float = 1.0
  top_p: float = 1.0
  seed: int = 0
  stop_ids: tuple[int, ...] = ()
  on_token: Callable[["Job", int], None] = lambda job, tok: None
  on_done: Callable[["Job"], None] = lambda job: None
  out: list[int] = dataclasses.field(default_factory=list)
  finish_reason: str | None = None    # 'stop' | 'length' | 'cancelled' | 'error'
  error: str | None = None
  cancelled: bool = False              # set by the server (client gone, stop string): freed at the next step

  def cancel(self) -> None:
    self.cancelled = True


class Engine:
  """Serve `model` with `num_slots` slots of `max_len` tokens each; at most `max_queue` jobs wait."""

  def __init__(self, model: Any, params: Any, *, num_slots: int = 8, max_len: int | None = None,
               max_queue: int = 64, scan_layers: bool | None = None, cache_dtype: str | None = None):
    cfg = decode._cfg(model)
    self.max_len = int(max_len or cfg.max_len)
    if num_slots < 1 or self.max_len < 2:
      raise ValueError(f"need num_slots >= 1 and max_len >= 2, got {num_slots}, {self.max_len}")
    if cfg.position == "learned" and self.max_len > cfg.max_len:   # no step may read past the table
      raise ValueError(f"max_len={self.max_len} exceeds the model's max_len={cfg.max_len} (learned positions "
                       "cannot extrapolate)")
    self.model, self.params = decode.decode_layout(decode.with_cache_dtype(model, cache_dtype),
                                                   nn.unbox(params), scan_layers)
    self.vocab_size, self.num_slots, self.max_queue = cfg.vocab_size, int(num_slots), int(max_queue)
    self.caches = decode.slot_caches(self.model, self.num_slots, self.max_len)
    self.logits = np.zeros((self.num_slots, self.vocab_size), np.float32)
    self.keys = np.zeros((self.num_slots, 2), np.uint32)
    self.temps = np.zeros((self.num_slots,), np.float32)
    self.top_p = np.ones((self.num_slots,), np.float32)
    self.slots: list[Job | None] = [None] * self.num_slots
    self.waiting: collections.deque[Job] = collections.deque()
    self.steps = 0
    self.finished: collections.Counter[str] = collections.Counter()   # jobs ended, by finish reason
    self._cv = threading.Condition()
    self._stop = False
    self._thread: threading.Thread | None = None

  # ------------------------------------------------------------------------------- public

  def start(self) -> "Engine":
    """Start the engine thread, in a copy of the caller's context (its `backends.use` backend)."""
    ctx = contextvars.copy_context()
    self._thread = threading.Thread(target=ctx.run, args=(self._loop,), name="tformer-serve-engine", daemon=True)
    self._thread.start()
    return self

  def close(self) -> None:
    with self._cv:
      self._stop = True
      self._cv.notify_all()
    if self._thread is not None and self._thread.is_alive():
      self._thread.join(timeout=30)

  def check(self, prompt: list[int], max_tokens: int) -> None:
    """EngineError unless the prompt and max_tokens fit a slot."""
    if not prompt:
      raise EngineError("the prompt is empty: it must hold at least one token")
    bad = [t for t in prompt if not 0 <= t < self.vocab_size]
    if bad:
      raise EngineError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
    if len(prompt) + max_tokens > self.max_len:
      raise EngineError(f"the prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) = "
                        f"{len(prompt) + max_tokens} exceeds the server's max_len of {self.max_len} tokens")

  def submit(self, job: Job) -> Job:
    """Queue a job (EngineError if it does not fit or the queue is full); it joins a free slot at the
    next step."""
    self.check(job.prompt, job.max_tokens)
    with self._cv:
      if len(self.waiting) >= self.max_queue:
        raise EngineError(f"the server's queue is full ({self.max_queue} waiting requests); retry later")
      self.waiting.append(job)
      self._cv.notify_all()
    return job

  def stats(self) -> dict[str, int]:
    with self._cv:
      return dict(slots=self.num_slots, busy=sum(j is not None for j in self.slots),
                  waiting=len(self.waiting), steps=self.steps, max_len=self.max_len,
                  completed=sum(self.finished.values()), cancelled=self.finished["cancelled"])

  def warmup(self) -> None:
    """Compile the prefill (shortest prompt bucket) and the step for every slot bucket before serving
    (afterwards no request compiles a step)."""
    fresh = decode.init_cache(self.model, None, 1, self.max_len)
    decode.append_tokens(self.model, self.params, fresh, np.zeros((1, 1), np.int32), 0)
    for k in decode.slot_buckets(self.num_slots):
      active = np.arange(self.num_slots) == k - 1                          # compiles bucket k
      self.caches, _, _ = decode.slot_step(self.model, self.params, self.caches, self.logits, self.keys,
                                           np.zeros((self.num_slots,), np.int32), self.temps, self.top_p,
                                           active)
    self.caches = decode.slot_caches(self.model, self.num_slots, self.max_len)   # back to empty

  # ------------------------------------------------------------------------------ the loop

  def _admit(self) -> None:
    """Prefill waiting jobs into free slots."""
    while True:
      with self._cv:
        free = [i for i, j in enumerate(self.slots) if j is None]
        while self.waiting and self.waiting[0].cancelled:
          self._finish(self.waiting.popleft(), "cancelled")
        if not free or not self.waiting:
          return
        job, i = self.waiting.popleft(), free[0]
        self.slots[i] = job
      fresh = decode.init_cache(self.model, None, 1, self.max_len)
      cache, logits = decode.append_tokens(self.model, self.params, fresh, np.asarray([job.prompt]), 0)
      self.caches = decode.set_slot(self.caches, np.int32(i), cache)
      self.logits[i] = np.asarray(logits[0])
      self.keys[i] = np.asarray(jax.random.PRNGKey(job.seed % (2 ** 31)), np.uint32)
      self.temps[i], self.top_p[i] = job.temperature, job.top_p

  def _finish(self, job: Job, reason: str) -> None:
    job.finish_reason = reason
    self.finished[reason] += 1
    try:
      job.on_done(job)
    except Exception:   # a callback must not stop the engine
      pass

  def _step(self) -> None:
    active = np.array([j is not None and not j.cancelled for j in self.slots])
    counts = np.array([len(j.out) if j is not None else 0 for j in self.slots], np.int32)
    self.caches, logits, toks = decode.slot_step(self.model, self.params, self.caches, self.logits,
                                                 self.keys, counts, self.temps, self.top_p, active)
    self.logits, toks = np.array(logits), np.asarray(toks)   # a writable copy: _admit sets rows
    self.steps += 1
    for i, job in enumerate(self.slots):
      if job is None:
        continue
      if job.cancelled:
        self._release(i, "cancelled")
        continue
      tok = int(toks[i])
      job.out.append(tok)
      try:
        job.on_token(job, tok)
      except Exception:
        job.cancelled = True
      if tok in job.stop_ids:
        self._release(i, "stop")
      elif len(job.out) >= job.max_tokens:
        self._release(i, "length")
      elif job.cancelled:
        self._release(i, "cancelled")

  def _release(self, i: int, reason: str) -> None:
    job = self.slots[i]
    with self._cv:
      self.slots[i] = None
    self._finish(job, reason)

  def _loop(self) -> None:
    while True:
      with self._cv:
        while not self._stop and not self.waiting and all(j is None for j in self.slots):
          self._cv.wait(timeout=1.0)
        if self._stop:
          break
      try:
        self._admit()
        if any(j is not None for j in self.slots):
          self._step()
      except Exception as e:   # never die silently: fail every live job with the error
        for i, job in enumerate(self.slots):
          if job is not None:
            job.error = f"{type(e).__name__}: {e}"
            self._release(i, "error")
        time.sleep(0.1)
    for i, job in enumerate(self.slots):
      if job is not None:
        self._release(i, "cancelled")
    while self.waiting:
      self._finish(self.waiting.popleft(), "cancelled")
