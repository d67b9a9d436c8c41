#!/usr/bin/env python
r"""Short trainings over the cartesian product of config sweeps: a results table and loss curves.

  python scripts/ablate.py --config=configs/shakespeare_char.py --sweep model.num_heads=1,4,8 \
      --sweep model.position=none,sinusoidal,rope,alibi --steps 300 --out ablations/heads_pos \
      [--config.model.d_model=128 ...]

Writes OUT/results.md and OUT/results.json (per run: parameters, final train loss, validation
loss/perplexity/token accuracy, exact match for synthetic:* tasks, loss roughness, tokens/s, wall
time) and OUT/loss_curves.png; each run's workdir is OUT/runs/<name>. See
tformer_jax/diagnostics/ablate.py.
"""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
  from tformer_jax.diagnostics import ablate
  from tformer_jax.diagnostics.cli import load_config, split_config_args
  path, overrides, rest = split_config_args(sys.argv[1:] if argv is None else argv)
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--sweep", action="append", default=[], help="KEY=V1,V2,... (repeatable)")
  p.add_argument("--steps", type=int, default=200)
  p.add_argument("--out", default="ablations/run")
  p.add_argument("--title", default="")
  args = p.parse_args(rest)
  if not path:
    p.error("pass --config=configs/<name>.py")
  logging.basicConfig(level=logging.WARNING)
  cfg = load_config(path, overrides)
  sweeps = [ablate.parse_sweep(s) for s in args.sweep]
  results = ablate.run_ablation(cfg, sweeps, args.steps, args.out)
  paths = ablate.write_results(results, args.out, args.title or ", ".join(k for k, _ in sweeps))
  print("\n" + ablate.markdown_table(results))
  print(f"\nwritten: {paths['md']}, {paths['json']}, {paths['png']}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
