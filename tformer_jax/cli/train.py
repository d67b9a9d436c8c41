"""`tformer-train --config=NAME --workdir=runs/x [--config.a.b=v ...]` (NAME: a shipped config or a file).

The command line is every tool's (tformer_jax/cli_common/). The whole config is validated here,
before jax is imported: a bad value is one line `error: <field>: <rule>` and exit status 2 within a
second, with nothing compiled and the workdir untouched. Later errors a user can cause (data,
checkpoints, distributed start-up, a run stopped by non-finite steps) are one line and status 2 too
(`cli_common.run_main`); anything else keeps its traceback.
"""
from __future__ import annotations

import logging
from typing import Sequence

from absl import flags
from tqdm.contrib.logging import logging_redirect_tqdm

from tformer_jax import cli_common
from tformer_jax.backends import maybe_reexec
from tformer_jax.config import parse_loggers, validate

PROG = "tformer-train"


def define_flags(fv: flags.FlagValues) -> None:
  flags.DEFINE_string("workdir", None, "run directory: checkpoints, metrics, config.json (required)",
                      flag_values=fv)
  flags.DEFINE_bool("distributed", False, "call jax.distributed.initialize (multi-host)", flag_values=fv)
  flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (multi-host)", flag_values=fv)
  flags.DEFINE_integer("num_processes", None, "total processes (multi-host)", flag_values=fv)
  flags.DEFINE_integer("process_id", None, "this process's id (multi-host)", flag_values=fv)


def main(argv: Sequence[str] | None = None) -> int:
  """Parse, validate, then (only then) import jax and train. Errors propagate to `run_main`."""
  args = cli_common.parse(argv, define_flags, doc=__doc__, prog=PROG, config="required")
  if not args.workdir:
    cli_common.fail("pass --workdir=RUN (the run directory)")
  train_cfg = args.config.get("train", {})
  if "wandb" in parse_loggers(train_cfg.get("loggers", "jsonl,tensorboard")):
    cli_common.require_extra(f"{PROG} with train.loggers=...wandb", "trackers")
  if str(train_cfg.get("eval_tasks", "") or "").strip(",\t "):
    cli_common.require_extra(f"{PROG} with train.eval_tasks", "eval")
  validate(args.config)  # every rule, before jax is imported, anything compiles or the workdir changes
  cli_common.setup_logging(logging.INFO)   # once, replacing whatever an import installed (orbax: WARNING)
  for name in ("absl", "jax"):   # their INFO lines (e.g. "Unable to initialize backend 'tpu'") are noise here
    logging.getLogger(name).setLevel(logging.WARNING)
  if args.distributed or args.coordinator_address:
    from tformer_jax.parallel.distributed import initialize  # noqa: PLC0415 (jax: only after maybe_reexec)
    initialize(args.coordinator_address, args.num_processes, args.process_id)
  from tformer_jax.eval.in_training import HarnessEval  # noqa: PLC0415 (jax: only after maybe_reexec)
  from tformer_jax.train.loop import train  # noqa: PLC0415 (jax: only after maybe_reexec)
  with logging_redirect_tqdm():            # log lines and the progress bar do not interleave
    # cli_common.parse resolved init_from; train.eval_tasks' harness evaluator is passed down (train < eval)
    train(args.config, args.workdir, source_resolved=True, eval_hook=HarnessEval)
  return 0


def entry() -> None:
  """The `tformer-train` console command."""
  maybe_reexec()  # tcmalloc / hugetlb: see tformer_jax/backends/cpu/host_alloc.py
  cli_common.exit_process(cli_common.run_main(main))   # no hang on threads a failed save left


if __name__ == "__main__":
  entry()
