"""`tformer-bench {train,attention,compile,decode,serve,moe,data,compare} [args]` (or python -m tformer_jax.bench).

  train      throughput, FLOP/s and MFU of the real train step       (tformer_jax/bench/train.py)
  attention  memory and time of attention impls, fwd + bwd            (tformer_jax/bench/attention.py)
  compile    compile time of the train step, scan_layers vs unrolled  (tformer_jax/bench/compile.py)
  decode     KV-cache vs recompute generation                         (tformer_jax/bench/decode.py)
  serve      HTTP server tokens/s at 1/4/16 clients vs sequential       (tformer_jax/bench/serve.py)
  moe        MoE FFN fwd + bwd throughput and memory vs dense         (tformer_jax/bench/moe.py)
  data       prepare / loader throughput, peak RSS on a 2 GB corpus   (tformer_jax/bench/data.py)
  compare    JAX vs PyTorch eager / torch.compile, interleaved        (benchmarks/compare_torch.py)

Each prints human-readable lines, then one JSON line; `... <name> --help` for its flags.
"""
from __future__ import annotations

import importlib
import importlib.util
import pathlib
import sys
from typing import Any, Callable, Sequence

from tformer_jax import cli_common

REPO = pathlib.Path(__file__).resolve().parents[2]          # a checkout: benchmarks/ beside the package
MODULES = {
    "train": "tformer_jax.bench.train",
    "attention": "tformer_jax.bench.attention",
    "compile": "tformer_jax.bench.compile",
    "decode": "tformer_jax.bench.decode",
    "serve": "tformer_jax.bench.serve",
    "moe": "tformer_jax.bench.moe",
    "data": "tformer_jax.bench.data",
}


def _compare_main() -> Callable[[Sequence[str]], Any]:
  path = REPO / "benchmarks" / "compare_torch.py"
  if not path.is_file():
    raise ModuleNotFoundError(f"{path} not found (it lives in the repository, not the installed package)")
  spec = importlib.util.spec_from_file_location("compare_torch", path)
  mod = importlib.util.module_from_spec(spec)
  sys.modules["compare_torch"] = mod
  spec.loader.exec_module(mod)
  return mod.main


def available() -> dict[str, bool]:
  """Which subcommands have their module present (decode/moe/attention are written separately)."""
  out = {name: importlib.util.find_spec(mod) is not None for name, mod in MODULES.items()}
  out["compare"] = (REPO / "benchmarks" / "compare_torch.py").is_file()
  return out


def usage() -> str:
  lines = [__doc__.strip(), "", "available here:"]
  for name, ok in available().items():
    lines.append(f"  {name:<10} {'yes' if ok else 'MISSING (module not present in this checkout)'}")
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> Any:
  argv = sys.argv[1:] if argv is None else list(argv)
  if not argv or argv[0] in ("-h", "--help", "help"):
    print(usage())
    return None
  name, rest = argv[0], argv[1:]
  if name == "compare":
    return _compare_main()(rest)
  if name not in MODULES:
    print(f"error: unknown benchmark {name!r}\n\n{usage()}", file=sys.stderr)
    sys.exit(2)
  if not available()[name]:
    print(f"error: {MODULES[name]} is not present in this checkout", file=sys.stderr)
    sys.exit(2)
  return importlib.import_module(MODULES[name]).main(rest)


def entry() -> None:
  """The `tformer-bench` console command."""
  from tformer_jax.backends import maybe_reexec  # noqa: PLC0415 (before anything imports jax)
  maybe_reexec()  # tcmalloc / hugetlb: see tformer_jax/backends/cpu/host_alloc.py
  cli_common.exit_process(cli_common.run_main(main))   # bounded: no thread left behind holds the exit

