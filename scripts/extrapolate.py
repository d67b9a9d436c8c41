#!/usr/bin/env python
"""Length extrapolation of position schemes: train at L on Shakespeare, evaluate at L, 2L, 4L, 8L.

  python scripts/extrapolate.py --train-len 64 --steps 300 --d-model 128 --layers 2 --out runs/extrapolate

Writes extrapolation.md (table), extrapolation.json and extrapolation.png to --out.
See tformer_jax/experiments/extrapolate.py for the method and docs/long_context.md for results.
"""
from __future__ import annotations

import argparse
import pathlib
import time

from tformer_jax.experiments import extrapolate


def main(argv: list[str] | None = None) -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--train-len", type=int, default=64)
  p.add_argument("--steps", type=int, default=300)
  p.add_argument("--d-model", type=int, default=128)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--batch-size", type=int, default=16)
  p.add_argument("--lr", type=float, default=2e-3)
  p.add_argument("--mults", default="1,2,4,8", help="evaluation lengths as multiples of --train-len")
  p.add_argument("--eval-windows", type=int, default=32, help="validation windows per length")
  p.add_argument("--schemes", default=",".join(extrapolate.SCHEMES))
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/extrapolate"))
  a = p.parse_args(argv)
  t0 = time.perf_counter()
  result = extrapolate.run(
      schemes=[s for s in a.schemes.split(",") if s], train_len=a.train_len, steps=a.steps,
      d_model=a.d_model, layers=a.layers, heads=a.heads, batch_size=a.batch_size, lr=a.lr,
      eval_mults=[int(k) for k in a.mults.split(",")], eval_windows=a.eval_windows, seed=a.seed,
      out=a.out)
  print()
  print(extrapolate.markdown_table(result))
  print(f"wall time {time.perf_counter() - t0:.0f} s; outputs in {a.out}")


if __name__ == "__main__":
  main()
