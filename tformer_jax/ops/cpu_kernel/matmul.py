"""`matmul_cpu`: a float32 2-D matmul as one C++ custom call (OpenBLAS, one block per thread).

Used for the weight gradients of `nn.common.project` on CPU (`model.weight_grad_impl`), where XLA's
Eigen contraction is slowest: dW = X^T dY contracted over the batch * length rows. Same values as
`op(a) @ op(b)` up to float32 summation order; differentiable (its VJP is two XLA dots).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from tformer_jax.ops.cpu_kernel import build

Array = jnp.ndarray


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _matmul(a: Array, b: Array, transpose_a: bool, transpose_b: bool) -> Array:
  m = a.shape[1] if transpose_a else a.shape[0]
  n = b.shape[0] if transpose_b else b.shape[1]
  call = jax.ffi.ffi_call("tfj_matmul", jax.ShapeDtypeStruct((m, n), jnp.float32),
                          vmap_method="sequential")
  return call(a, b, transpose_a=np.bool_(transpose_a), transpose_b=np.bool_(transpose_b))


def _matmul_fwd(a, b, transpose_a, transpose_b):
  return _matmul(a, b, transpose_a, transpose_b), (a, b)


def _matmul_bwd(transpose_a, transpose_b, res, g):
  a, b = res
  op_a = a.T if transpose_a else a
  op_b = b.T if transpose_b else b
  da, db = g @ op_b.T, op_a.T @ g          # cotangents of op(a), op(b)
  return (da.T if transpose_a else da), (db.T if transpose_b else db)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def matmul_cpu(a: Array, b: Array, *, transpose_a: bool = False,
               transpose_b: bool = False) -> Array:
  """op(a) @ op(b) for 2-D float32 arrays on the CPU backend; op transposes when asked."""
  if a.ndim != 2 or b.ndim != 2:
    raise ValueError(f"matmul_cpu takes 2-D operands, got {a.shape} and {b.shape}")
  if a.dtype != jnp.float32 or b.dtype != jnp.float32:
    raise ValueError(f"matmul_cpu is float32 only, got {a.dtype} and {b.dtype}")
  k_a = a.shape[0] if transpose_a else a.shape[1]
  k_b = b.shape[1] if transpose_b else b.shape[0]
  if k_a != k_b:
    raise ValueError(f"matmul_cpu: contracting dimensions differ ({k_a} vs {k_b}) for shapes "
                     f"{a.shape}{'^T' if transpose_a else ''} @ {b.shape}"
                     f"{'^T' if transpose_b else ''}")
  if jax.default_backend() != "cpu":
    raise ValueError(f"matmul_cpu is a CPU kernel; the default backend is "
                     f"{jax.default_backend()!r}")
  build.load()
  return _matmul(a, b, bool(transpose_a), bool(transpose_b))
