"""Test setup, before jax is imported: 8 fake CPU devices (for the sharding tests), XLA:CPU's LLVM
backend at -O0 without its expensive passes and without its MLIR fusion emitters, float32 matmuls.

-O0: the suite compiles hundreds of small programs and runs each briefly, so compiling dominates; at
-O0 LLVM emits the same computation with fewer optimisation passes. From a cold compilation cache on
the 2-core machine, `.ci/run` from a clean clone took 20 min 32 s at XLA's default (a46f9eb) and
12 min 52 s at -O0 (a204899, 2026-12-02), every test passing with its own tolerance. LLVM's expensive
passes are off too (what jax_disable_most_optimizations sets besides -O0): test_model.py and
test_losses.py from a cold start, alone, 112 s -> 104 s. Compiling is still ~80% of a worker's time
(test_model, test_lora, test_decode and test_losses: backend compile 229 s, tracing 47 s, lowering 27 s of
368 s), most of it in the fusions' MLIR emitters, so those are off too (xla_cpu_use_fusion_emitters=false:
fusions through the elemental IR emitter, one LLVM module, not split for parallel codegen): a tiny model's
value_and_grad compiles in 0.23-0.48 s instead of 0.7-1.3 s and runs about 10% slower. None of these is
fast-math: each op computes the same function. They do not apply outside the suite: the CLIs, benchmarks
and AOT figures compile with XLA's defaults.
Subprocesses the tests start inherit it (tests/train_utils.env keeps it for those that set their own
device count). A test whose time is in running one program many times, not in compiling it, compiles that
program optimised (train_utils.RUN_HEAVY, jax.jit's compiler_options).

The commands' persistent compilation cache (backends.enable_compilation_cache: every tformer-train a test
runs, in a subprocess or in-process) keeps compiles of 0.05 s and more in the suite, not only those over 1 s:
most are under 1 s with the fusion emitters off, and the suite's many tiny runs compile the same programs
(test_train, test_workdir and test_cli from an empty cache: 111 s -> 102 s). It starts empty on a clean
machine. Turning it on in the workers themselves as well helped five compile-heavy files (146 -> 133 s) but
not the whole suite (17 min 06 s from a clean clone, against 15 min 27 s and 16 min 12 s without): it is not on.
"""
import importlib.util
import mmap
import os
import pathlib


def _xla_known(flags: tuple[str, ...]) -> list[str]:
  """Those of `flags` the installed jaxlib has (their names in jaxlib's shared libraries, each library read
  once): XLA aborts the process on an unknown flag in XLA_FLAGS, so a speed flag that a jaxlib of the pinned
  range lacks is left out."""
  names = {f: f.lstrip("-").split("=")[0].encode() for f in flags}
  spec = importlib.util.find_spec("jaxlib")
  libs = sorted(pathlib.Path(spec.origin).parent.glob("*.so"), key=lambda f: -f.stat().st_size) if spec else []
  found: set[str] = set()
  for lib in libs:
    with open(lib, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as m:
      found |= {f for f, name in names.items() if f not in found and m.find(name) >= 0}
    if len(found) == len(flags):
      break
  return [f for f in flags if f in found]


_FLAGS = ("--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0",
          "--xla_llvm_disable_expensive_passes=true",
          *_xla_known(("--xla_cpu_use_fusion_emitters=false", "--xla_cpu_parallel_codegen_split_count=1")))
_given = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join([_given, *(f for f in _FLAGS if f.split("=")[0] not in _given)]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.05")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# The files, longest first, by their time in one cold clean-clone run (`pytest --durations=0` summed per file,
# 2026-12-03): every file of 10 s or more. scripts/test.sh runs `-n 2 --dist loadfile --no-loadscope-reorder`:
# each worker takes the next file in collection order, so longest-first leaves the two workers to finish within
# about one short file of each other (with only the heaviest 14 listed, one worker ended 30 s before the other,
# its last file a 42 s one). xdist's default order (most tests first) put the few-test heavy files such as
# test_recipe.py last, one worker running them alone. Unlisted files keep their order after these; a stale
# entry costs only balance, never a result.
HEAVY_FIRST = (
    "test_reliability_checkpoint.py", "test_recipe.py", "test_train.py", "test_parallel.py", "test_gpu_check.py",
    "test_decode.py", "test_gguf.py", "test_moe_parallel.py", "test_lora.py", "test_context_parallel.py",
    "test_workdir.py", "test_doctor.py", "test_model.py", "test_optim.py", "test_long_context.py", "test_aot.py",
    "test_diagnostics.py", "test_backends.py", "test_hf_interop.py", "test_losses.py", "test_harness.py",
    "test_hf_export.py", "test_config_errors.py", "test_splash.py", "test_kv_quant.py", "test_moe.py",
    "test_moe_model.py", "test_real_model_path.py", "test_config.py", "test_cli.py", "test_hf_import_faults.py",
    "test_prepared_data.py", "test_linear_attention.py", "test_fused_adamw.py", "test_sparse_masks.py",
    "test_estimate.py", "test_blockwise.py", "test_chunked_attention.py", "test_cpu_kernel.py", "test_finetune.py",
    "test_attention.py", "test_objectives.py", "test_bench.py", "test_sampling.py",
)


def pytest_collection_modifyitems(session, config, items):
  rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: unlisted files keep their order


_ROOT_LEVEL = None


@pytest.fixture(autouse=True)
def _no_command_log_handler():
  """A command run in-process sets the root logger up for the process (cli_common.setup_logging: INFO to the
  stderr of the moment), and a module-scoped fixture may run one before a file's first test: each test starts
  and ends without that handler and at the root level the session began with, so a test's captured stderr
  holds only what its own command writes (tests counting one `error:` line saw other commands' INFO lines)."""
  import logging  # noqa: PLC0415

  from tformer_jax.cli_common.errors import _Stderr  # noqa: PLC0415
  global _ROOT_LEVEL
  root = logging.getLogger()
  if _ROOT_LEVEL is None:
    _ROOT_LEVEL = root.level

  def reset():
    for h in [h for h in root.handlers if isinstance(h, _Stderr)]:
      root.removeHandler(h)
    root.setLevel(_ROOT_LEVEL)

  reset()
  yield
  reset()
