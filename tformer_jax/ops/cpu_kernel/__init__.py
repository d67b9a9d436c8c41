"""C++ CPU kernels as XLA FFI custom calls, built on first use (see build.py).

  chunked_attention_cpu   ops.chunked_attention's algorithm, one custom call per direction
  available()             (True, library path) or (False, why not)
"""
from tformer_jax.ops.cpu_kernel.attention import chunked_attention_cpu, chunk_table
from tformer_jax.ops.cpu_kernel.build import KernelUnavailable, available

__all__ = ["chunked_attention_cpu", "chunk_table", "available", "KernelUnavailable"]
