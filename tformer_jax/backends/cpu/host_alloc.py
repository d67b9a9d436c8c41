"""The host allocator under XLA:CPU: why the CLIs run under tcmalloc, and how.

XLA:CPU mallocs each executable's temp buffer on every call (hundreds of MB for a train step).
glibc serves a request that large with a fresh `mmap` and unmaps it on `free`, so every step
page-faults the whole buffer in again. tcmalloc keeps freed spans and hands the same pages back.
Without tcmalloc, glibc's `glibc.malloc.hugetlb=1` tunable (glibc >= 2.35: those mmaps get
transparent 2 MB pages) cuts the faults. docs/benchmarks.md ('Host allocator') has the measurements.

Both must be chosen when the process starts (`LD_PRELOAD`, `GLIBC_TUNABLES`), so `backends.maybe_reexec()`
re-executes the current command once with them set, silently (`backends.resolve_runtime` logs the
allocator a run got). The CLIs (`scripts/train.py`, `tformer-train`, `python -m tformer_jax.bench`,
`benchmarks/compare_torch.py`) call it first thing; library code never does. Only CPU runs: where a
GPU or TPU plugin for JAX is installed (and JAX_PLATFORMS does not say cpu) nothing happens, nor for
`--help`. TFORMER_JAX_ALLOCATOR=auto (default: tcmalloc if installed, else the hugetlb tunable) |
tcmalloc | hugetlb | system (change nothing). tcmalloc on Debian/Ubuntu: `apt-get install
libtcmalloc-minimal4`.
"""
from __future__ import annotations

import ctypes
import functools
import glob
import importlib.util
import os
import sys
from typing import Callable, Mapping, Sequence

ENV_CHOICE = "TFORMER_JAX_ALLOCATOR"
ENV_DONE = "TFORMER_JAX_ALLOCATOR_SET"  # set in the re-executed process: never loop
CHOICES = ("auto", "tcmalloc", "hugetlb", "system")
TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libtcmalloc_minimal.so", "libtcmalloc.so")
LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
            "/usr/local/lib")
HUGETLB = "glibc.malloc.hugetlb=1"
# JAX's accelerator plugins: with one installed the run is (most likely) not an XLA:CPU run.
ACCELERATOR_MODULES = ("jax_cuda13_plugin", "jax_cuda12_plugin", "jax_rocm7_plugin", "jax_rocm60_plugin",
                       "libtpu")
# libtpu is also installed on CPU hosts for ahead-of-time compilation (the tpu-aot extra): it counts
# only where this host has TPU devices.
TPU_DEVICE_GLOBS = ("/dev/accel*", "/dev/vfio/[0-9]*")
HELP_FLAGS = ("-h", "--help", "--helpfull", "--helpshort", "--helpxml")


def cpu_run(env: Mapping[str, str], argv: Sequence[str]) -> bool:
  """Whether this command is an XLA:CPU run worth re-executing: not a --help, and JAX_PLATFORMS says
  cpu or no accelerator plugin is installed."""
  if any(a in HELP_FLAGS for a in argv[1:]):
    return False
  platforms = env.get("JAX_PLATFORMS", "").strip().lower()
  if platforms:
    return platforms.split(",")[0] == "cpu"
  return not any(importlib.util.find_spec(m) and (m != "libtpu" or _tpu_devices()) for m in ACCELERATOR_MODULES)


def _tpu_devices() -> bool:
  return any(glob.glob(g) for g in TPU_DEVICE_GLOBS)


def idle_libtpu(env: Mapping[str, str] | None = None) -> bool:
  """libtpu installed (the tpu-aot extra) on a host with no TPU devices and no other accelerator plugin,
  JAX_PLATFORMS unset: jax would probe libtpu and print its start-up errors, for nothing. The CLIs then
  select the CPU platform (cli_common.parse)."""
  env = os.environ if env is None else env
  if env.get("JAX_PLATFORMS") or importlib.util.find_spec("libtpu") is None:
    return False
  if any(importlib.util.find_spec(m) for m in ACCELERATOR_MODULES if m != "libtpu"):
    return False                                  # a GPU host: its plugin chooses
  return not _tpu_devices()


def find_tcmalloc(dirs: tuple[str, ...] = LIB_DIRS) -> str | None:
  """Path of an installed tcmalloc shared library, or None."""
  for d in dirs:
    for name in TCMALLOC_NAMES:
      path = os.path.join(d, name)
      if os.path.isfile(path):
        return path
  return None


def glibc_version() -> tuple[int, int] | None:
  try:
    name, ver = os.confstr("CS_GNU_LIBC_VERSION").split()
    major, minor = ver.split(".")[:2]
    return (int(major), int(minor)) if name == "glibc" else None
  except (ValueError, OSError, AttributeError):
    return None


def loaded_allocator() -> str:
  """'tcmalloc', 'jemalloc', 'glibc+hugetlb' or 'glibc': what this process runs with."""
  try:
    maps = open("/proc/self/maps").read()
  except OSError:
    maps = ""
  for name in ("tcmalloc", "jemalloc"):
    if name in maps:
      return name
  return "glibc+hugetlb" if HUGETLB in os.environ.get("GLIBC_TUNABLES", "") else "glibc"


def plan(env: Mapping[str, str], tcmalloc: str | None, glibc: tuple[int, int] | None,
         platform: str = sys.platform) -> dict[str, str] | None:
  """The environment changes to re-execute with, or None to run as is. Pure: tested directly.

  Raises ValueError for an unknown TFORMER_JAX_ALLOCATOR, or 'tcmalloc' asked for but not installed."""
  choice = env.get(ENV_CHOICE, "auto").strip().lower() or "auto"
  if choice not in CHOICES:
    raise ValueError(f"{ENV_CHOICE}={choice!r}: expected one of {', '.join(CHOICES)}")
  if choice == "system" or env.get(ENV_DONE) or not platform.startswith("linux"):
    return None
  preload = env.get("LD_PRELOAD", "")
  if "tcmalloc" in preload or "jemalloc" in preload:
    return None  # the user chose an allocator already
  if choice in ("auto", "tcmalloc") and tcmalloc:
    return {"LD_PRELOAD": f"{tcmalloc}:{preload}" if preload else tcmalloc, ENV_DONE: "tcmalloc"}
  if choice == "tcmalloc":
    raise ValueError(f"{ENV_CHOICE}=tcmalloc but no tcmalloc library in {', '.join(LIB_DIRS)} "
                     "(apt-get install libtcmalloc-minimal4)")
  tunables = env.get("GLIBC_TUNABLES", "")
  if glibc is None or glibc < (2, 35) or HUGETLB in tunables:
    return None
  return {"GLIBC_TUNABLES": f"{tunables}:{HUGETLB}" if tunables else HUGETLB, ENV_DONE: "hugetlb"}


def release_free_memory() -> str | None:
  """Hand the allocator's free pages back to the system, so that RSS falls to what is allocated:
  tcmalloc's MallocExtension_ReleaseFreeMemory, glibc's malloc_trim(0). Returns which ran (None: neither).
  tcmalloc keeps every freed span mapped, so one-off transients (loading a checkpoint or HF weights,
  compiling, the first steps' buffers before the allocator settles) stay in RSS for the whole run; the
  train loop calls this after them and after each evaluation, never every step (the step's temp buffer
  would then fault in again): between those, `ReleaseOnGrowth`."""
  try:
    lib = ctypes.CDLL(None)
  except OSError:
    return None
  for name, args in (("MallocExtension_ReleaseFreeMemory", ()), ("malloc_trim", (0,))):
    fn = getattr(lib, name, None)
    if fn is not None:
      fn(*args)
      return name
  return None


@functools.cache
def _numeric_property() -> Callable[..., int] | None:
  """tcmalloc's MallocExtension_GetNumericProperty, looked up once (the loop asks after every step)."""
  try:
    fn = getattr(ctypes.CDLL(None), "MallocExtension_GetNumericProperty", None)
  except OSError:
    return None
  if fn is not None:
    fn.argtypes, fn.restype = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_size_t)], ctypes.c_int
  return fn


def free_bytes() -> int | None:
  """Bytes the allocator holds freed but still mapped (tcmalloc's page heap: what RSS counts beyond the
  live heap), or None where that is not known (glibc)."""
  fn = _numeric_property()
  if fn is None:
    return None
  value = ctypes.c_size_t(0)
  return int(value.value) if fn(b"tcmalloc.pageheap_free_bytes", ctypes.byref(value)) else None


class ReleaseOnGrowth:
  """Between the loop's fixed releases, hands free pages back only when the free heap has grown by more
  than `slack` over what a step leaves free. A step frees its temp buffer and the next one reuses it, so
  the free heap after a step is normally level; when a span cannot be reused whole (another allocation
  landed in it), the next step maps a second one and RSS holds both: that growth is what this releases,
  so the usual step pays no page faults. `check()` after each step; `reset()` after any other release."""

  def __init__(self, slack_bytes: int = 256 << 20, free: Callable[[], int | None] | None = None,
               release: Callable[[], object] | None = None):
    self.slack, self.level = int(slack_bytes), None
    self.free, self.release = free or free_bytes, release or release_free_memory

  def reset(self) -> None:
    self.level = None

  def check(self) -> bool:
    """True when it released."""
    free = self.free()
    if free is None:
      return False
    if self.level is None or free < self.level:
      self.level = free
      return False
    if free > self.level + self.slack:
      self.release()
      self.level = None
      return True
    return False


def maybe_reexec() -> None:
  """Re-execute this CPU run under tcmalloc (or glibc's hugetlb tunable) once; see the module doc.
  Call it before anything heavy (it replaces the process; nothing after it runs the first time)."""
  if not cpu_run(os.environ, sys.argv):
    return
  try:
    changes = plan(os.environ, find_tcmalloc(), glibc_version())
  except ValueError as e:      # a usage error: one line, exit status 2 (as every command's)
    print(f"error: {e}", file=sys.stderr)
    raise SystemExit(2) from None
  if not changes:
    return
  argv = list(getattr(sys, "orig_argv", [])) or [sys.executable] + sys.argv
  sys.stdout.flush()
  os.execve(sys.executable, argv, {**os.environ, **changes})
