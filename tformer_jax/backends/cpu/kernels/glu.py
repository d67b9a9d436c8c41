"""`swiglu_cpu`: SwiGLU's gated activation silu(g) * u as one C++ custom call per direction (glu.cc).

float32 or bfloat16 (computed in float32, each output rounded once), any shape, CPU backend only. Same values
as `jax.nn.silu(g) * u` up to float32 rounding (its exp is a polynomial with relative error < 2e-7); in
bfloat16 it rounds once where XLA's bfloat16 path rounds silu(g) and then the product.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from tformer_jax.backends.cpu.kernels import build

Array = jnp.ndarray


@jax.custom_vjp
def _swiglu(g: Array, u: Array) -> Array:
  call = jax.ffi.ffi_call(build.target("tfj_swiglu_fwd", g.dtype), jax.ShapeDtypeStruct(g.shape, g.dtype),
                          vmap_method="broadcast_all")
  return call(g, u)


def _swiglu_fwd(g, u):
  return _swiglu(g, u), (g, u)


def _swiglu_bwd(res, dy):
  g, u = res
  out = jax.ShapeDtypeStruct(g.shape, g.dtype)
  call = jax.ffi.ffi_call(build.target("tfj_swiglu_bwd", g.dtype), (out, out), vmap_method="broadcast_all")
  return call(g, u, dy.astype(g.dtype))


_swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def swiglu_cpu(g: Array, u: Array) -> Array:
  """silu(g) * u for g and u of one shape and one dtype, float32 or bfloat16, on the CPU backend."""
  if g.shape != u.shape or g.dtype != u.dtype or g.dtype not in (jnp.float32, jnp.bfloat16):
    raise ValueError(f"swiglu_cpu takes g and u of one shape and one dtype, float32 or bfloat16; got "
                     f"{g.shape} {g.dtype} and {u.shape} {u.dtype}")
  if jax.default_backend() != "cpu":
    raise ValueError(f"swiglu_cpu is a CPU kernel; the default backend is {jax.default_backend()!r}")
  build.load()
  return _swiglu(g, u)
