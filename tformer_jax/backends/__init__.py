"""Execution backends: the one door between the model and how it runs (see backends/base.py).

  backend = resolve_runtime(cfg).backend    # once per run: logs what it chose and why
  with backends.use(backend):               # modules read it at trace time, like axis rules
    ... jit(train_step) ...

Without a `use` block the modules get `Backend()`: the reference backend (plain jnp, ordinary
autodiff, forward mode included, reference attention) - what a library user of `nn/` gets.
A jitted function keeps the backend it was traced under: enter `use` before the first call.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

from tformer_jax.backends.base import ATTENTION_IMPLS, AdamWSpec, Backend
from tformer_jax.backends.runtime import Runtime, enable_compilation_cache, resolve_runtime
from tformer_jax.backends.xla_cpu import XlaCpuBackend

_DEFAULT = Backend()
_CURRENT: contextvars.ContextVar[Backend | None] = contextvars.ContextVar("tformer_jax_backend",
                                                                           default=None)


def current() -> Backend:
  """The backend the modules use now."""
  return _CURRENT.get() or _DEFAULT


@contextlib.contextmanager
def use(backend: Backend) -> Iterator[Backend]:
  """Run (trace) the model with `backend` inside this block."""
  token = _CURRENT.set(backend)
  try:
    yield backend
  finally:
    _CURRENT.reset(token)


__all__ = ["ATTENTION_IMPLS", "AdamWSpec", "Backend", "XlaCpuBackend", "Runtime", "resolve_runtime",
           "enable_compilation_cache", "current", "use"]
