"""The CPU speed machinery, behind the backend door (`tformer_jax.backends` re-exports what the rest uses).

  xla_cpu.py     the xla_cpu backend: hand-written VJPs, the fusion barrier, the C++ kernels when on
  kernels/       the C++ CPU kernels as XLA FFI custom calls, built on first use; their sgemm needs the
                 cpu extra (`pip install 'tformer_jax[cpu]'`: OpenBLAS; the mkl and onednn extras add others)
  host_alloc.py  the host allocator: the CLIs' re-exec under tcmalloc, the train loop's free-page releases

Only modules inside tformer_jax/backends import this package (tests/test_backends.py). Importing it imports
no jax: host_alloc runs before a command line imports jax.
"""
