"""`tformer-doctor --config=NAME [--workdir=RUN] [--config.a.b=v ...]` (NAME: a shipped config or a file)

First prints the platform, the devices and the kernels a run of the config would choose there (attention,
MoE exchange and grouped matmul, the C++ CPU kernels, with the reasons; --platform=gpu|tpu asks for another
target than this host, --kernels_only stops there). Then runs the articles' troubleshooting checklists as
automatic checks and prints a PASS/WARN/FAIL table with the suggested action for every WARN/FAIL. Exit
status: 0 without FAIL, 1 with one, 2 on usage or config errors. With --workdir=RUN the checks use the
checkpoint's parameters, and the run's config.json when --config is absent.
"""
from __future__ import annotations

import json
import sys
from typing import Any, Sequence

from absl import flags

from tformer_jax import backends, cli_common
from tformer_jax.checkpoint import restore_params
from tformer_jax.config import ConfigError
from tformer_jax.doctor import checks, faults, platform as platform_lib


def define_flags(fv: flags.FlagValues) -> None:
  flags.DEFINE_string("workdir", None, "use the checkpoint's parameters (and its config.json when "
                      "--config is absent)", flag_values=fv)
  flags.DEFINE_string("only", "", "comma-separated checks to run (data scale padding causal rows "
                      "kv_cache order activations lr head_dim overfit); default all", flag_values=fv)
  flags.DEFINE_string("skip", "", "comma-separated checks to leave out", flag_values=fv)
  flags.DEFINE_string("plant", "", "plant one of tformer_jax/doctor/faults.py's faults, to see it caught",
                      flag_values=fv)
  flags.DEFINE_string("json", None, "also write the results as JSON to this file", flag_values=fv)
  flags.DEFINE_integer("seed", 0, "initialisation and batch seed", flag_values=fv)
  flags.DEFINE_enum("platform", None, list(platform_lib.PLATFORMS), "the target whose kernel choices to report "
                    "(default: this host's); the checks run here", flag_values=fv)
  flags.DEFINE_bool("kernels_only", False, "print the platform, devices and kernels, run no checks", flag_values=fv)


def main(argv: Sequence[str] | None = None) -> int:
  args = cli_common.parse(argv, define_flags, doc=__doc__, prog="tformer-doctor",
                          config="required", from_workdir=True)
  try:
    kernels = platform_lib.kernel_report(args.config, args.platform)
  except (ConfigError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"tformer_jax doctor: {args.config_file}: what a run would choose\n"
        + platform_lib.format_kernel_report(kernels))
  if args.kernels_only:
    return 0
  try:
    cfg = args.config
    params = None
    if args.workdir:
      _, params = restore_params(args.workdir)
    ctx = checks.make_context(cfg, params, args.seed)
    inject: dict[str, dict[str, Any]] = {}
    if args.plant:
      extra, inject = faults.plant(args.plant, ctx)
      if extra:
        ctx = checks.make_context(cli_common.override(cfg, extra), params, args.seed)
  except (ConfigError, ValueError, FileNotFoundError, cli_common.UsageError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  only = [c for c in args.only.split(",") if c] or list(checks.CHECKS)
  skip = {c for c in args.skip.split(",") if c}
  try:
    runtime = backends.resolve_runtime(ctx.cfg, quiet=True)
    with backends.use(runtime.backend):   # the probes that read attention pick their own backend
      results = checks.run_checks(ctx, [c for c in only if c not in skip], inject)
  except (ConfigError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  src = f"checkpoint {args.workdir}" if args.workdir else "fresh init"
  print(f"tformer_jax doctor: {args.config_file} ({src})" + (f", planted fault {args.plant}" if args.plant else ""))
  print(checks.format_table(results))
  if args.json:
    with open(args.json, "w") as f:
      json.dump([r.to_dict() for r in results], f, indent=2)
  return 1 if any(r.status == checks.FAIL for r in results) else 0


def entry() -> None:
  """The `tformer-doctor` console command."""
  cli_common.exit_process(cli_common.run_main(main))   # bounded: no thread left behind holds the exit

