"""Build, cache and register the C++ CPU kernels (XLA FFI custom calls) on first use.

The source ships with the package (`*.cc` next to this file). `load()` compiles it once per source,
jaxlib and CPU with the system C++ compiler (`$CXX`, else g++/c++/clang++) against the FFI headers
jaxlib ships, caches the shared library under `$TFORMER_JAX_KERNEL_CACHE` (default
~/.cache/tformer_jax/kernels), points it at a CBLAS sgemm and registers the FFI targets for the
'cpu' platform. Any missing piece raises `KernelUnavailable` naming it.

The sgemm (`use_blas`, chosen per run by runtime.cpu_blas): OpenBLAS from the `scipy-openblas32` wheel
(the cpu extra, `pip install 'tformer_jax[cpu]'`: without it the kernels are unavailable and nothing is
compiled), Intel's oneMKL from the `mkl` wheel (its sequential layer, LP64), or oneDNN's gemm API from the
`onednn-cpu-gomp` wheel (the mkl and onednn extras, added to the cpu one). Each is forced single-threaded:
the kernels split the work over XLA's threads themselves. MKL is the fastest on Intel CPUs and the slowest
on AMD ones (docs/benchmarks.md). The bfloat16 kernels need a bfloat16 gemm: MKL's (fast on Intel only) or
oneDNN's (AVX512-BF16 on AMD Zen 4 too); OpenBLAS's wheel has none.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from typing import Any

import jax

SOURCES = ("attention.cc", "matmul.cc", "adamw.cc", "glu.cc")
HEADERS = ("common.h",)
TARGETS = {"tfj_chunked_attention_fwd": "TfjChunkedAttentionFwd",
           "tfj_chunked_attention_bwd": "TfjChunkedAttentionBwd",
           "tfj_chunked_attention_fwd_bf16": "TfjChunkedAttentionFwdBf16",
           "tfj_chunked_attention_bwd_bf16": "TfjChunkedAttentionBwdBf16",
           "tfj_matmul": "TfjMatmul",
           "tfj_matmul_bf16": "TfjMatmulBf16",
           "tfj_matmul_bf16_bf16": "TfjMatmulBf16ToBf16",
           "tfj_adamw": "TfjAdamW",
           "tfj_swiglu_fwd": "TfjSwigluFwd",
           "tfj_swiglu_bwd": "TfjSwigluBwd",
           "tfj_swiglu_fwd_bf16": "TfjSwigluFwdBf16",
           "tfj_swiglu_bwd_bf16": "TfjSwigluBwdBf16"}
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno", "-fopenmp-simd",
         "-w")


class KernelUnavailable(RuntimeError):
  """The CPU kernels cannot be built or loaded here; the message says which piece is missing."""


_lock = threading.Lock()
_state: dict = {}


def _compiler() -> str:
  for cand in filter(None, (os.environ.get("CXX"), "g++", "c++", "clang++")):
    path = shutil.which(cand)
    if path:
      return path
  raise KernelUnavailable("no C++ compiler found (set $CXX or install g++, e.g. "
                          "`apt-get install g++`)")


def cpu_field(name: str) -> str:
  """The first value of /proc/cpuinfo's `name` line ('vendor_id' -> 'GenuineIntel', 'model name' -> ...);
  '' where there is none."""
  try:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
      if line.split(":", 1)[0].strip() == name:
        return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return ""


def _cpu_tag() -> str:
  """What -march=native depends on: the CPU model and its feature flags."""
  try:
    info = pathlib.Path("/proc/cpuinfo").read_text()
    lines = [l for l in info.splitlines() if l.startswith(("model name", "flags"))][:2]
    return "\n".join(lines)
  except OSError:
    return platform.processor() or platform.machine()


def cache_dir() -> pathlib.Path:
  root = os.environ.get("TFORMER_JAX_KERNEL_CACHE") or os.path.join(
      os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tformer_jax", "kernels")
  return pathlib.Path(root)


def _build(cxx: str) -> pathlib.Path:
  here = pathlib.Path(__file__).parent
  srcs = [here / s for s in SOURCES]
  h = hashlib.sha256()
  for s in [*srcs, *(here / x for x in HEADERS)]:
    h.update(s.read_bytes())
  h.update(" ".join(FLAGS).encode() + cxx.encode() + jax.__version__.encode() + _cpu_tag().encode())
  out = cache_dir() / f"tfj_kernels_{h.hexdigest()[:16]}.so"
  if out.exists():
    return out
  try:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
  except OSError as e:
    raise KernelUnavailable(f"cannot write the kernel cache {out.parent} ({e}); set "
                            "$TFORMER_JAX_KERNEL_CACHE to a writable directory") from e
  os.close(fd)
  cmd = [cxx, *FLAGS, "-isystem", jax.ffi.include_dir(), *map(str, srcs), "-o", tmp]
  proc = subprocess.run(cmd, capture_output=True, text=True)
  if proc.returncode:
    os.unlink(tmp)
    raise KernelUnavailable(
        f"compiling the CPU kernels failed ({' '.join(cmd)}):\n{proc.stderr[:3000]}")
  os.replace(tmp, out)  # atomic: a concurrent build of the same source writes the same bytes
  return out


BLAS = ("openblas", "mkl", "onednn")
BF16_BLAS = ("mkl", "onednn")   # the BLASes with a bfloat16 x bfloat16 -> float32 gemm


# Why the kernels are unavailable without the cpu extra (its scipy-openblas32 wheel); resolve_runtime names
# the extra in the run's log line then.
CPU_EXTRA = "the C++ CPU kernels need the cpu extra: pip install 'tformer_jax[cpu]'"


def _openblas() -> tuple[int, ctypes.CDLL]:
  try:
    import scipy_openblas32  # noqa: PLC0415 (kernel load only: a missing wheel is KernelUnavailable)
  except ImportError as e:
    raise KernelUnavailable(f"{CPU_EXTRA} (OpenBLAS, the scipy-openblas32 wheel)") from e
  lib = ctypes.CDLL(str(pathlib.Path(scipy_openblas32.get_lib_dir()) /
                        f"lib{scipy_openblas32.get_library()}.so"))
  lib.scipy_openblas_set_num_threads(1)
  return ctypes.cast(lib.scipy_cblas_sgemm, ctypes.c_void_p).value, lib


def _env_lib(blas: str, names: tuple[str, ...], wheel: str) -> ctypes.CDLL:
  """The first of `names` in the environment's lib/ (where the `mkl` and `onednn-*` wheels install theirs)."""
  dirs = dict.fromkeys(pathlib.Path(d) / "lib" for d in (sys.prefix, sysconfig.get_config_var("prefix") or sys.prefix))
  found = [d / n for d in dirs for n in names if (d / n).is_file()]
  if not found:
    raise KernelUnavailable(f"runtime.cpu_blas {blas!r}: no {names[-1]} in {', '.join(map(str, dirs))}: "
                            f"`pip install {wheel}`")
  return ctypes.CDLL(str(found[0]))


def _mkl() -> tuple[int, ctypes.CDLL]:
  """oneMKL's cblas_sgemm from the `mkl` wheel's libmkl_rt (installed under the environment's lib/)."""
  lib = _env_lib("mkl", ("libmkl_rt.so.3", "libmkl_rt.so.2", "libmkl_rt.so"), "mkl")
  lib.MKL_Set_Threading_Layer(1)   # MKL_THREADING_SEQUENTIAL: no OpenMP runtime, the caller's thread
  lib.MKL_Set_Interface_Layer(0)   # MKL_INTERFACE_LP64: 32-bit integers, as tfj::Sgemm declares
  return ctypes.cast(lib.cblas_sgemm, ctypes.c_void_p).value, lib


def _onednn() -> tuple[int, ctypes.CDLL]:
  """oneDNN's dnnl_sgemm from the `onednn-cpu-gomp` wheel's libdnnl (the environment's lib/); the kernels call
  it, and its dnnl_gemm_bf16bf16f32, through tfj_set_dnnl (matmul.cc), one OpenMP thread a call, with
  omp_set_num_threads / omp_get_max_threads from the libgomp it links (by soname: torch's copy where torch
  was imported first)."""
  lib = _env_lib("onednn", ("libdnnl.so.3", "libdnnl.so"), "onednn-cpu-gomp")
  lib.omp = ctypes.CDLL("libgomp.so.1")   # the soname libdnnl resolved: the same runtime
  return ctypes.cast(lib.dnnl_sgemm, ctypes.c_void_p).value, lib


def _blas(name: str) -> tuple[int, ctypes.CDLL]:
  if name not in BLAS:
    raise ValueError(f"cpu_blas: {name!r} is not one of {BLAS}")
  if name not in _state.setdefault("blas_libs", {}):
    _state["blas_libs"][name] = {"openblas": _openblas, "mkl": _mkl, "onednn": _onednn}[name]()
  return _state["blas_libs"][name]


def load(blas: str | None = None) -> None:
  """Build (or reuse), load and register the kernels, with `blas`'s sgemm (default: the one in use, at
  first OpenBLAS); idempotent and thread-safe. Switching the BLAS applies to every later call of the
  kernels, compiled executables included, and to calls still running: switch only while none is in flight
  (dispatch is async: block on earlier results first; a bf16 kernel left running across a switch to
  OpenBLAS finds no bf16 gemm)."""
  with _lock:
    if "error" in _state:
      raise KernelUnavailable(_state["error"])
    if "lib" not in _state:
      try:
        _blas("openblas")   # first: without the cpu extra nothing is compiled
        path = _build(_compiler())
        lib = ctypes.CDLL(str(path))
      except (KernelUnavailable, OSError) as e:
        _state["error"] = str(e)
        raise KernelUnavailable(str(e)) from e
      for name, symbol in TARGETS.items():
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
      _state.update(lib=lib, path=path, blas=None)
    want = blas or _state["blas"] or "openblas"
    if want != _state["blas"]:
      try:
        sgemm, lib = _blas(want)
      except (OSError, AttributeError) as e:   # a library that does not load, or lacks a symbol
        raise KernelUnavailable(f"runtime.cpu_blas {want!r}: cannot load it ({e})") from e
      if want == "onednn":
        _state["lib"].tfj_set_dnnl(ctypes.c_void_p(sgemm), ctypes.c_void_p(_gemm_bf16(want)),
                                   ctypes.cast(lib.omp.omp_set_num_threads, ctypes.c_void_p),
                                   ctypes.cast(lib.omp.omp_get_max_threads, ctypes.c_void_p))
      else:
        _state["lib"].tfj_set_sgemm(ctypes.c_void_p(sgemm))
        _state["lib"].tfj_set_gemm_bf16(ctypes.c_void_p(_gemm_bf16(want)))
      _state["blas"] = want


def _gemm_bf16(name: str) -> int | None:
  """The address of `name`'s bfloat16 x bfloat16 -> float32 gemm: oneMKL's cblas_gemm_bf16bf16f32, oneDNN's
  dnnl_gemm_bf16bf16f32; None for OpenBLAS (scipy-openblas32 exports no sbgemm), and where the library's
  gemm does not run on this CPU (`_bf16_gemm_runs`: oneDNN's answers 'unimplemented' without AVX-512)."""
  symbol = {"mkl": "cblas_gemm_bf16bf16f32", "onednn": "dnnl_gemm_bf16bf16f32"}.get(name)
  fn = getattr(_blas(name)[1], symbol, None) if symbol else None
  if fn is None or not _bf16_gemm_runs(name, fn):
    return None
  return ctypes.cast(fn, ctypes.c_void_p).value


def _bf16_gemm_runs(name: str, fn: Any) -> bool:
  """Whether `name`'s bfloat16 gemm runs on this CPU: oneDNN's needs AVX-512 (without it the call answers
  'unimplemented' and leaves its output alone), read from /proc/cpuinfo's flags, never by calling it."""
  del fn
  return name != "onednn" or "avx512f" in cpu_field("flags").split()


def bf16_blas_available(name: str) -> tuple[bool, str]:
  """(True, '') when the kernels load here with `name` and its bfloat16 gemm runs on this CPU, else (False,
  why); leaves the BLAS in use as it was."""
  ok, why = blas_available(name)
  if not ok:
    return ok, why
  with _lock:
    if _gemm_bf16(name) is None:
      return False, f"{name}'s bfloat16 gemm does not run on this CPU (or is absent)"
  return True, ""


def has_bf16_gemm() -> bool:
  """Whether the BLAS in use has a bfloat16 gemm (`matmul_cpu` on bfloat16 operands): oneMKL and oneDNN do."""
  return _state.get("blas") is not None and _gemm_bf16(_state["blas"]) is not None


def require_bf16_gemm(what: str) -> None:
  """A one-line ValueError unless the BLAS in use has a bfloat16 gemm (`what`: the kernel asked for)."""
  if not has_bf16_gemm():
    raise ValueError(f"{what} in bfloat16 needs a BLAS with a bfloat16 gemm (runtime.cpu_blas 'mkl' or "
                     f"'onednn'); the one in use is {blas_in_use()!r}")


def target(name: str, dtype) -> str:
  """The FFI target of kernel `name` for operands of `dtype`: the '_bf16' variant for bfloat16."""
  return name + ("_bf16" if jax.numpy.dtype(dtype) == jax.numpy.bfloat16 else "")


def blas_in_use() -> str | None:
  """The BLAS the kernels call now ('openblas' | 'mkl' | 'onednn'), None before they load."""
  return _state.get("blas")


def blas_available(name: str) -> tuple[bool, str]:
  """(True, '') when the kernels load here with `name`'s sgemm, else (False, why); leaves the BLAS in use
  as it was."""
  try:
    load()
    with _lock:
      _blas(name)
    return True, ""
  except (KernelUnavailable, OSError, AttributeError) as e:
    return False, str(e)


def available() -> tuple[bool, str]:
  """(True, path) when the kernels load here, else (False, why)."""
  try:
    load()
    return True, str(_state["path"])
  except KernelUnavailable as e:
    return False, str(e)
