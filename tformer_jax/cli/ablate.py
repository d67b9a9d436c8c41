#!/usr/bin/env python
r"""Short trainings over the cartesian product of config sweeps: a results table and loss curves.

  tformer-ablate --config=shakespeare_char --sweep model.num_heads=1,4,8 \
      --sweep model.position=none,sinusoidal,rope,alibi --steps 300 --out ablations/heads_pos \
      [--config.model.d_model=128 ...]

Writes OUT/results.md and OUT/results.json (per run: parameters, final train loss, validation
loss/perplexity/token accuracy, exact match for synthetic:* tasks, loss roughness, tokens/s, wall
time) and OUT/loss_curves.png; each run's workdir is OUT/runs/<name>. See
tformer_jax/diagnostics/ablate.py.
"""
from __future__ import annotations

import logging
from typing import Sequence

from absl import flags

from tformer_jax import cli_common
from tformer_jax.diagnostics import ablate


def define_flags(fv: flags.FlagValues) -> None:
  flags.DEFINE_multi_string("sweep", [], "KEY=V1,V2,...: one sweep (runs are the cartesian "
                            "product); each value set as --config.KEY=V would set it", flag_values=fv)
  flags.DEFINE_integer("steps", 200, "training steps per run", flag_values=fv)
  flags.DEFINE_string("out", "ablations/run", "output directory", flag_values=fv)
  flags.DEFINE_string("title", "", "title of the table and plot (default: the swept keys)", flag_values=fv)


def main(argv: Sequence[str] | None = None) -> int:
  args = cli_common.parse(argv, define_flags, doc=__doc__, prog="tformer-ablate", config="required")
  try:
    sweeps = [ablate.parse_sweep(s) for s in args.sweep]
    for combo in ablate.grid(sweeps):    # every value parses before the first run trains
      cli_common.override(args.config, combo)
  except (ValueError, cli_common.UsageError) as e:
    cli_common.fail(str(e))
  cli_common.setup_logging(logging.WARNING, logging.BASIC_FORMAT)
  results = ablate.run_ablation(args.config, sweeps, args.steps, args.out)
  paths = ablate.write_results(results, args.out, args.title or ", ".join(k for k, _ in sweeps))
  print("\n" + ablate.markdown_table(results))
  print(f"\nwritten: {paths['md']}, {paths['json']}, {paths['png']}")
  return 0



def entry() -> None:
  """The `tformer-ablate` console command."""
  cli_common.exit_process(cli_common.run_main(main))   # bounded: no thread left behind holds the exit


if __name__ == "__main__":
  entry()
