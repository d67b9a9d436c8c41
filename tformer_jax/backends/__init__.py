"""Execution backends: the one door between the model and how it runs (see backends/base.py).

  backend = resolve_runtime(cfg).backend    # once per run: logs what it chose and why
  with backends.use(backend):               # modules read it at trace time, like axis rules
    ... jit(train_step) ...

Without a `use` block the modules get `Backend()`: the reference backend (plain jnp, ordinary
autodiff, forward mode included, reference attention) - what a library user of `nn/` gets.
A jitted function keeps the backend it was traced under: enter `use` before the first call.

The CPU speed machinery (backends/cpu: the xla_cpu backend, the C++ kernels of the cpu extra, the host
allocator) is reached only through the names below. Each name is imported on first use, so that the host's
(`maybe_reexec`, `idle_libtpu`), which the command lines call before they import jax, import no jax.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
  from tformer_jax.backends.base import ATTENTION_IMPLS, AdamWSpec, Backend
  from tformer_jax.backends.cpu.host_alloc import (
    ReleaseOnGrowth,
    idle_libtpu,
    loaded_allocator,
    maybe_reexec,
    release_free_memory,
  )
  from tformer_jax.backends.cpu.kernels import BF16_BLAS, chunked_attention_cpu, cpu_field
  from tformer_jax.backends.cpu.xla_cpu import XlaCpuBackend
  from tformer_jax.backends.runtime import Runtime, enable_compilation_cache, resolve_runtime

# name -> the module (under backends/) that defines it
_NAMES = {
    **dict.fromkeys(("ATTENTION_IMPLS", "AdamWSpec", "Backend"), "base"),
    **dict.fromkeys(("Runtime", "resolve_runtime", "enable_compilation_cache"), "runtime"),
    "XlaCpuBackend": "cpu.xla_cpu",
    # the host (no jax): the CLIs' allocator re-exec, the libtpu probe, the train loop's free-page releases
    **dict.fromkeys(("maybe_reexec", "idle_libtpu", "loaded_allocator", "release_free_memory", "ReleaseOnGrowth"),
                    "cpu.host_alloc"),
    # the C++ kernels, for the benchmarks and the estimator
    **dict.fromkeys(("chunked_attention_cpu", "BF16_BLAS", "cpu_field"), "cpu.kernels"),
}


def __getattr__(name: str) -> Any:
  if name not in _NAMES:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  value = getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
  globals()[name] = value
  return value


_CURRENT: contextvars.ContextVar[Backend | None] = contextvars.ContextVar("tformer_jax_backend",
                                                                           default=None)


@functools.cache
def _default() -> Backend:
  from tformer_jax.backends.base import Backend  # noqa: PLC0415 (jax: on first use, see the module doc)
  return Backend()


def current() -> Backend:
  """The backend the modules use now."""
  return _CURRENT.get() or _default()


@contextlib.contextmanager
def use(backend: Backend) -> Iterator[Backend]:
  """Run (trace) the model with `backend` inside this block."""
  token = _CURRENT.set(backend)
  try:
    yield backend
  finally:
    _CURRENT.reset(token)


__all__ = ["ATTENTION_IMPLS", "AdamWSpec", "Backend", "XlaCpuBackend", "Runtime", "resolve_runtime",
           "enable_compilation_cache", "current", "use", "maybe_reexec", "idle_libtpu", "loaded_allocator",
           "release_free_memory", "ReleaseOnGrowth", "chunked_attention_cpu", "BF16_BLAS", "cpu_field"]
