"""C++ CPU kernels as XLA FFI custom calls, built on first use (see build.py).

  chunked_attention_cpu   ops.chunked_attention's algorithm, one custom call per direction
  matmul_cpu              op(a) @ op(b), float32 (sgemm) or bfloat16 (MKL), one block per thread
  swiglu_cpu              silu(g) * u, one pass per direction (float32 or bfloat16)
  adamw_update_cpu        one AdamW step on one float32 array, in place, in one pass
                          (adamw_apply_cpu: the update, with adamw_scalars computed once per step)
  available()             (True, library path) or (False, why not: CPU_EXTRA without the cpu extra)
  load(blas=)             build/load them, calling 'openblas', 'mkl' or 'onednn' gemms (blas_available,
                          bf16_blas_available, blas_in_use; BF16_BLAS: those with a bfloat16 gemm)
  cpu_field(name)         a /proc/cpuinfo field ('model name', 'vendor_id', 'flags')
"""
from tformer_jax.backends.cpu.kernels.adamw import adamw_apply_cpu, adamw_scalars, adamw_update_cpu
from tformer_jax.backends.cpu.kernels.attention import chunk_table, chunked_attention_cpu
from tformer_jax.backends.cpu.kernels.build import (
  BF16_BLAS,
  BLAS,
  CPU_EXTRA,
  KernelUnavailable,
  available,
  bf16_blas_available,
  blas_available,
  blas_in_use,
  cpu_field,
  load,
)
from tformer_jax.backends.cpu.kernels.glu import swiglu_cpu
from tformer_jax.backends.cpu.kernels.matmul import matmul_cpu

__all__ = ["chunked_attention_cpu", "chunk_table", "matmul_cpu", "swiglu_cpu", "adamw_update_cpu", "adamw_apply_cpu",
           "adamw_scalars", "available", "KernelUnavailable", "BLAS", "BF16_BLAS", "CPU_EXTRA", "blas_available",
           "bf16_blas_available", "blas_in_use", "cpu_field", "load"]
