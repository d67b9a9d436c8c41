"""`matmul_cpu`: a 2-D matmul as one C++ custom call (the run's BLAS, one block per thread): float32
operands (sgemm), or bfloat16 ones with float32 accumulation and output (oneMKL's or oneDNN's gemm_bf16bf16f32).

Used for the weight gradients of `nn.common.project` on CPU (`model.weight_grad_impl`), where XLA's
Eigen contraction is slowest: dW = X^T dY contracted over the batch * length rows. Same values as
`op(a) @ op(b)` up to float32 summation order; differentiable (its VJP is two XLA dots).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from tformer_jax.backends.cpu.kernels import build

Array = jnp.ndarray


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _matmul(a: Array, b: Array, transpose_a: bool, transpose_b: bool, out_dtype: str = "float32") -> Array:
  m = a.shape[1] if transpose_a else a.shape[0]
  n = b.shape[0] if transpose_b else b.shape[1]
  target = ("tfj_matmul" if a.dtype == jnp.float32 else
            "tfj_matmul_bf16_bf16" if out_dtype == "bfloat16" else "tfj_matmul_bf16")
  call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((m, n), jnp.dtype(out_dtype)),
                          vmap_method="sequential")
  return call(a, b, transpose_a=np.bool_(transpose_a), transpose_b=np.bool_(transpose_b))


def _matmul_fwd(a, b, transpose_a, transpose_b, out_dtype):
  return _matmul(a, b, transpose_a, transpose_b, out_dtype), (a, b)


def _matmul_bwd(transpose_a, transpose_b, out_dtype, res, g):
  a, b = res
  op_a = a.T if transpose_a else a
  op_b = b.T if transpose_b else b
  da, db = g @ op_b.T, op_a.T @ g          # cotangents of op(a), op(b)
  return (da.T if transpose_a else da).astype(a.dtype), (db.T if transpose_b else db).astype(b.dtype)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def matmul_cpu(a: Array, b: Array, *, transpose_a: bool = False, transpose_b: bool = False,
               out_dtype: jnp.dtype | str = jnp.float32) -> Array:
  """op(a) @ op(b) for 2-D arrays, both float32 or both bfloat16 (the latter needs a BLAS with a bfloat16
  gemm, `build.has_bf16_gemm()`: oneMKL, oneDNN), on the CPU backend; op transposes when asked. Accumulated in
  float32; out_dtype float32, or bfloat16 for bfloat16 operands (rounded in the kernel, to nearest even)."""
  out_dtype = jnp.dtype(out_dtype)
  if out_dtype not in (jnp.float32, jnp.bfloat16) or (out_dtype == jnp.bfloat16 and a.dtype != jnp.bfloat16):
    raise ValueError(f"matmul_cpu: out_dtype float32, or bfloat16 for bfloat16 operands; got {out_dtype} "
                     f"for {a.dtype}")
  if a.ndim != 2 or b.ndim != 2:
    raise ValueError(f"matmul_cpu takes 2-D operands, got {a.shape} and {b.shape}")
  if a.dtype != b.dtype or a.dtype not in (jnp.float32, jnp.bfloat16):
    raise ValueError(f"matmul_cpu takes two float32 or two bfloat16 operands, got {a.dtype} and {b.dtype}")
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
  if a.dtype == jnp.bfloat16:
    build.require_bf16_gemm("matmul_cpu")
  return _matmul(a, b, bool(transpose_a), bool(transpose_b), out_dtype.name)
