"""The executables decoding compiles: lowered and compiled once per shapes, kept (bounded), logged.

`lower` + `Compiling` compile several functions at once on threads (XLA compiles without holding the
GIL), so a first call that needs a prefill and a step loop lowers one while the other compiles, and
waits for the longer compile rather than their sum (the machine's cores permitting)."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import Any, Callable

import flax.linen as nn
import jax
import numpy as np

# (name, seconds) for every lower+compile done here; the benchmark reports compile time from it.
COMPILE_LOG: list[tuple[str, float]] = []
_COMPILED: dict[Any, Any] = {}
_MAX_COMPILED = 64  # executables kept (oldest dropped first)


def _model_key(model: nn.Module) -> Any:
  try:
    hash(model)
    return model
  except TypeError:
    return id(model)


@dataclasses.dataclass
class Lowered:
  """A function lowered for one argument signature, not compiled yet."""
  name: str
  full_key: Any
  lowered: Any      # jax.stages.Lowered (its out_info: the result's shapes)
  lower_s: float


def _full_key(name: str, key: Any, args: tuple[Any, ...]) -> Any:
  leaves, tree = jax.tree_util.tree_flatten(args)
  avals = tuple((np.shape(x), str(getattr(x, "dtype", None) or np.result_type(x))) for x in leaves)
  return (name, key, tree, avals)


def lower(name: str, key: Any, fn: Callable, *args: Any, donate: tuple[int, ...] = ()) -> Lowered | None:
  """`fn` lowered for these arguments (arrays or jax.ShapeDtypeStruct), or None if it is compiled."""
  full_key = _full_key(name, key, args)
  if full_key in _COMPILED:
    return None
  t0 = time.perf_counter()
  low = jax.jit(fn, donate_argnums=donate).lower(*args)
  return Lowered(name, full_key, low, time.perf_counter() - t0)


class Compiling:
  """Compiles the lowered functions handed to `add` on threads as they come (XLA compiles without the
  GIL, so the caller lowers the next function while the last one compiles); leaving the `with` block
  waits for them all and keeps them. Each is logged in COMPILE_LOG with its own lower + compile
  seconds (their sum exceeds the wall time when they overlap)."""

  def __enter__(self) -> "Compiling":
    self._pool = concurrent.futures.ThreadPoolExecutor(4)
    self._futures: list[Any] = []
    return self

  def add(self, pending: Lowered | None) -> None:
    if pending is not None:
      self._futures.append(self._pool.submit(_compile, pending))

  def __exit__(self, *exc: Any) -> None:
    done = [f.result() for f in self._futures]
    self._pool.shutdown()
    for p, exe, compile_s in done:
      _keep(p, exe, compile_s)


def _compile(p: Lowered) -> tuple[Lowered, Any, float]:
  t0 = time.perf_counter()
  return p, p.lowered.compile(), time.perf_counter() - t0


def _keep(p: Lowered, exe: Any, compile_s: float) -> None:
  COMPILE_LOG.append((p.name, p.lower_s + compile_s))
  if len(_COMPILED) >= _MAX_COMPILED:
    _COMPILED.pop(next(iter(_COMPILED)))
  _COMPILED[p.full_key] = exe


def _aot(name: str, key: Any, fn: Callable, *args: Any, donate: tuple[int, ...] = ()) -> Any:
  """Lower+compile `fn` once per (name, key, argument shapes/dtypes); cached in `_COMPILED`.
  donate: argument positions whose buffers the executable may reuse (then invalid after the call)."""
  pending = lower(name, key, fn, *args, donate=donate)
  if pending is not None:
    _keep(*_compile(pending))
  return _COMPILED[_full_key(name, key, args)]
