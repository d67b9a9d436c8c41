#!/usr/bin/env python
"""Length extrapolation of position schemes: train at L on Shakespeare, evaluate at L, 2L, 4L, 8L.

  tformer-extrapolate --train-len 64 --steps 300 --d-model 128 --layers 2 --out runs/extrapolate

Writes extrapolation.md (table), extrapolation.json and extrapolation.png to --out.
See tformer_jax/experiments/extrapolate.py for the method and docs/long_context.md for results.
"""
from __future__ import annotations

import pathlib
import time
from typing import Sequence

from absl import flags

from tformer_jax import cli_common
from tformer_jax.experiments import extrapolate


def define_flags(fv: flags.FlagValues) -> None:
  flags.DEFINE_integer("train-len", 64, "training length L", flag_values=fv)
  flags.DEFINE_integer("steps", 300, "training steps per scheme", flag_values=fv)
  flags.DEFINE_integer("d-model", 128, "model width", flag_values=fv)
  flags.DEFINE_integer("layers", 2, "layers", flag_values=fv)
  flags.DEFINE_integer("heads", 4, "attention heads", flag_values=fv)
  flags.DEFINE_integer("batch-size", 16, "sequences per training step", flag_values=fv)
  flags.DEFINE_float("lr", 2e-3, "peak learning rate", flag_values=fv)
  flags.DEFINE_string("mults", "1,2,4,8", "evaluation lengths as multiples of --train-len", flag_values=fv)
  flags.DEFINE_integer("eval-windows", 32, "validation windows per length", flag_values=fv)
  flags.DEFINE_string("schemes", ",".join(extrapolate.SCHEMES), "comma-separated position schemes",
                      flag_values=fv)
  flags.DEFINE_integer("seed", 0, "data order and init seed", flag_values=fv)
  flags.DEFINE_string("out", "runs/extrapolate", "output directory", flag_values=fv)


def main(argv: Sequence[str] | None = None) -> None:
  a = cli_common.parse(argv, define_flags, doc=__doc__, prog="tformer-extrapolate")
  try:
    mults = [int(k) for k in a.mults.split(",")]
  except ValueError:
    cli_common.fail(f"--mults takes comma-separated integers, not {a.mults!r}")
  t0 = time.perf_counter()
  result = extrapolate.run(
      schemes=[s for s in a.schemes.split(",") if s], train_len=a.train_len, steps=a.steps,
      d_model=a.d_model, layers=a.layers, heads=a.heads, batch_size=a.batch_size, lr=a.lr,
      eval_mults=mults, eval_windows=a.eval_windows, seed=a.seed, out=pathlib.Path(a.out))
  print()
  print(extrapolate.markdown_table(result))
  print(f"wall time {time.perf_counter() - t0:.0f} s; outputs in {a.out}")



def entry() -> None:
  """The `tformer-extrapolate` console command."""
  cli_common.exit_process(cli_common.run_main(main))   # bounded: no thread left behind holds the exit


if __name__ == "__main__":
  entry()
