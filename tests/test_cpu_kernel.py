"""The C++ CPU attention kernel (backends/cpu/kernels: the xla_cpu backend's 'chunked' attention with
runtime.cpu_kernels on, backends/cpu/xla_cpu.py) equals dense dot_product_attention: outputs and q/k/v
gradients on every case of the blockwise suite that it supports (all but segment ids), two chunk
sizes; plus vmap, fully padded rows, argument errors and the build step's errors.

Tolerance: float32, atol = rtol = 1e-5 (the kernel's exp is a polynomial with relative error < 2e-7).
bfloat16 (on MKL's bfloat16 gemm): against the float32 kernel on the same bfloat16 values, 2e-2 of the
largest entry (the stored probabilities and outputs are rounded to bfloat16, 2^-8 relative).
Skipped, with the reason, only where no C++ compiler exists (CI machines have g++).
"""
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_blockwise import CASES, _inputs, assert_matches_reference, case_and_reference

from tformer_jax.backends.cpu.kernels import KernelUnavailable, build, chunk_table, chunked_attention_cpu, swiglu_cpu
from tformer_jax.ops import masks
from tformer_jax.ops.attention import dot_product_attention

pytestmark = pytest.mark.skipif(
    not any(shutil.which(c) for c in filter(None, (os.environ.get("CXX"), "g++", "c++", "clang++"))),
    reason="no C++ compiler: the CPU kernels cannot be built here")

TOL = dict(atol=1e-5, rtol=1e-5)
SUPPORTED = {n: c for n, c in CASES.items() if not c[-1].get("segments")}


def _no_segments(op_kw):
  assert all(v is None for k, v in op_kw.items() if "segment" in k)
  return {k: v for k, v in op_kw.items() if "segment" not in k}


@pytest.mark.parametrize("chunk", [16, 7])
@pytest.mark.parametrize("name", list(SUPPORTED))
def test_matches_dense(name, chunk):
  (q, k, v, ct), op_kw, ref = case_and_reference(*SUPPORTED[name])
  op_kw = _no_segments(op_kw)
  fn = lambda q, k, v: chunked_attention_cpu(q, k, v, **op_kw, chunk=chunk)  # noqa: E731
  assert_matches_reference(fn, ref, q, k, v, ct)


def test_alibi_causal_without_segments():
  b, l, s, h, kh, d, kw = CASES["alibi_causal_segments"]
  (q, k, v, ct), op_kw, ref = case_and_reference(b, l, s, h, kh, d, dict(kw, segments=False))
  op_kw = _no_segments(op_kw)
  assert_matches_reference(lambda q, k, v: chunked_attention_cpu(q, k, v, **op_kw, chunk=16),
                           ref, q, k, v, ct)


def test_fully_padded_rows_are_zero_not_nan():
  q, k, v, ct = _inputs(2, 12, 12, 4, 2, 8)
  valid = jnp.asarray(np.arange(12)[None] >= np.array([[0], [12]]))  # row 1: every key is padding
  f = lambda q, k, v: chunked_attention_cpu(q, k, v, causal=False, kv_valid_BxS=valid, chunk=5)  # noqa
  o, vjp = jax.vjp(f, q, k, v)
  grads = vjp(ct)
  assert np.all(np.asarray(o[1]) == 0) and np.all(np.isfinite(np.asarray(o)))
  for g in grads:
    assert np.all(np.isfinite(np.asarray(g)))
  assert np.all(np.asarray(grads[0][1]) == 0)


def test_vmap_and_jit():
  """vmap runs the custom call once per element ("sequential"): same as a loop."""
  q, k, v, _ = _inputs(3, 20, 20, 4, 4, 8)
  f = jax.jit(jax.vmap(lambda q, k, v: chunked_attention_cpu(q[None], k[None], v[None], chunk=8)[0]))
  ref = dot_product_attention(q, k, v, mask=masks.causal_mask(20))
  np.testing.assert_allclose(np.asarray(f(q, k, v)), np.asarray(ref), **TOL)


def test_chunk_table_covers_every_query_once():
  t = chunk_table(45, 45, causal=True, window=0, q_offset=0, chunk=16)
  assert t.dtype == np.int32 and t.shape == (3, 4)
  np.testing.assert_array_equal(t, [[0, 16, 0, 16], [16, 32, 0, 32], [32, 45, 0, 45]])


def test_bad_arguments_are_clear_errors():
  q, k, v, _ = _inputs(1, 8, 8, 2, 1, 4)
  with pytest.raises(ValueError, match="float32 or bfloat16 q, k and v of one dtype"):
    chunked_attention_cpu(q.astype(jnp.bfloat16), k, v)
  with pytest.raises(ValueError, match="float32 or bfloat16"):
    chunked_attention_cpu(*(x.astype(jnp.float16) for x in (q, k, v)))
  before = build.blas_in_use()
  build.load(blas="openblas")
  try:
    with pytest.raises(ValueError, match="bfloat16 gemm"):
      chunked_attention_cpu(*(x.astype(jnp.bfloat16) for x in (q, k, v)))
  finally:
    build.load(blas=before)
  with pytest.raises(ValueError, match="static"):
    jax.jit(lambda off: chunked_attention_cpu(q, k, v, q_offset=off))(jnp.int32(3))
  with pytest.raises(ValueError, match="bad shapes"):
    chunked_attention_cpu(q, k[:, :, :, :2], v)
  with pytest.raises(ValueError, match="chunk > 0"):
    chunked_attention_cpu(q, k, v, chunk=0)


def test_build_errors_name_the_problem(tmp_path, monkeypatch):
  monkeypatch.setenv("TFORMER_JAX_KERNEL_CACHE", str(tmp_path))
  with pytest.raises(KernelUnavailable, match="compiling the CPU kernels failed"):
    build._build("/bin/false")
  assert not list(tmp_path.iterdir())  # no half-written library left in the cache
  blocked = tmp_path / "file"
  blocked.write_text("")
  monkeypatch.setenv("TFORMER_JAX_KERNEL_CACHE", str(blocked / "sub"))  # parent is a file
  with pytest.raises(KernelUnavailable, match="TFORMER_JAX_KERNEL_CACHE"):
    build._build(shutil.which("g++") or "/bin/false")
  monkeypatch.setenv("CXX", "/nonexistent/c++")
  monkeypatch.setenv("PATH", str(tmp_path))
  with pytest.raises(KernelUnavailable, match="no C\\+\\+ compiler"):
    build._compiler()


def test_fresh_process_builds_into_an_empty_cache(tmp_path):
  """A new cache directory gets one library; a second process reuses it (same file, same mtime)."""
  code = ("import tformer_jax.backends.cpu.kernels as c; ok, path = c.available(); assert ok, path; "
          "print(path)")
  env = dict(os.environ, TFORMER_JAX_KERNEL_CACHE=str(tmp_path), JAX_PLATFORMS="cpu")
  first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
  assert first.returncode == 0, first.stderr[-2000:]
  lib = first.stdout.strip().splitlines()[-1]
  assert os.path.dirname(lib) == str(tmp_path) and os.path.exists(lib)
  mtime = os.path.getmtime(lib)
  second = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
  assert second.returncode == 0 and second.stdout.strip().splitlines()[-1] == lib
  assert os.path.getmtime(lib) == mtime and len(list(tmp_path.iterdir())) == 1


BF16_BLAS = [pytest.param(blas, marks=pytest.mark.skipif(not ok, reason=f"no {blas} (a bfloat16 gemm): {why}"))
             for blas, (ok, why) in ((b, build.bf16_blas_available(b)) for b in build.BF16_BLAS)]


@pytest.mark.parametrize("blas", BF16_BLAS)
@pytest.mark.parametrize("name", list(SUPPORTED))
def test_bf16_matches_the_float32_kernel(name, blas):
  """bfloat16 q, k, v (the '_bf16' targets): output and q/k/v gradients in bfloat16, equal to the float32
  kernel's on the same (bfloat16-rounded) values within bfloat16's rounding."""
  (q, k, v, ct), op_kw, _ = case_and_reference(*SUPPORTED[name])
  op_kw = _no_segments(op_kw)
  q, k, v, ct = (x.astype(jnp.bfloat16) for x in (q, k, v, ct))

  def run(dtype):
    f = lambda q, k, v: chunked_attention_cpu(q, k, v, **op_kw, chunk=16)  # noqa: E731
    o, vjp = jax.vjp(f, *(x.astype(dtype) for x in (q, k, v)))
    return (o, *vjp(ct.astype(dtype)))

  before = build.blas_in_use()
  build.load(blas=blas)
  try:   # (computed before the BLAS switches back: the kernels read it when they run, and dispatch is async)
    got, want = jax.block_until_ready((run(jnp.bfloat16), run(jnp.float32)))
  finally:
    build.load(blas=before)
  for g, w in zip(got, want):
    assert g.dtype == jnp.bfloat16
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    np.testing.assert_allclose(g, w, rtol=0, atol=2e-2 * max(1.0, np.abs(w).max()))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_swiglu_matches_silu_times_up(dtype):
  """swiglu_cpu (the xla_cpu backend's glu for 'swiglu'): silu(g) * u and its gradients, against XLA's
  jax.nn.silu(g) * u in the same dtype; g with large magnitudes (+-100, -88.5: no overflow in exp). float32:
  1e-6 of the largest entry; bfloat16: 2e-2 (one rounding where XLA's path rounds twice: a few bf16 ulps)."""
  r = np.random.default_rng(0)
  g = jnp.asarray(r.standard_normal((3, 37, 50)) * 4, dtype)
  g = g.at[0, 0, :4].set(jnp.asarray([100., -100., 0., -88.5], dtype))
  u = jnp.asarray(r.standard_normal((3, 37, 50)), dtype)
  c = jnp.asarray(r.standard_normal((3, 37, 50)), jnp.float32)
  loss = lambda f: lambda g, u: jnp.sum(f(g, u).astype(jnp.float32) * c)  # noqa: E731
  ours, ref = (lambda g, u: swiglu_cpu(g, u)), (lambda g, u: jax.nn.silu(g) * u)
  assert "tfj_swiglu_bwd" in jax.jit(jax.grad(loss(ours), (0, 1))).lower(g, u).as_text()
  tol = 1e-6 if dtype == "float32" else 2e-2
  got = [jax.jit(ours)(g, u), *jax.jit(jax.grad(loss(ours), (0, 1)))(g, u)]
  want = [ref(g, u), *jax.grad(loss(ref), (0, 1))(g, u)]
  for a, b in zip(got, want):
    assert a.dtype == jnp.dtype(dtype) and np.all(np.isfinite(np.asarray(a, np.float32)))
    b = np.asarray(b, np.float32)
    np.testing.assert_allclose(np.asarray(a, np.float32), b, rtol=0, atol=tol * np.abs(b).max())
  with pytest.raises(ValueError, match="one shape and one dtype"):
    swiglu_cpu(g, u[:, :3])
  with pytest.raises(ValueError, match="float32 or bfloat16"):
    swiglu_cpu(g.astype(jnp.float16), u.astype(jnp.float16))
