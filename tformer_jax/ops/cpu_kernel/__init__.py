"""C++ CPU kernels as XLA FFI custom calls, built on first use (see build.py).

  chunked_attention_cpu   ops.chunked_attention's algorithm, one custom call per direction
  matmul_cpu              op(a) @ op(b) in float32, one OpenBLAS block per thread (weight gradients)
  available()             (True, library path) or (False, why not)
"""
from tformer_jax.ops.cpu_kernel.attention import chunked_attention_cpu, chunk_table
from tformer_jax.ops.cpu_kernel.build import KernelUnavailable, available
from tformer_jax.ops.cpu_kernel.matmul import matmul_cpu

__all__ = ["chunked_attention_cpu", "chunk_table", "matmul_cpu", "available", "KernelUnavailable"]
