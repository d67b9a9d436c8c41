r"""Step time of model variants: the real compiled train step, timed in interleaved rounds.

  python -m tformer_jax.diagnostics.timing --config=configs/experiments/remat_cost.py \
      --sweep model.remat=none,full,dots --batch 8 --seq 256 --rounds 7 --steps 5

Each variant's step is compiled once and warmed up; then every round times `steps` steps of each
variant in turn (the order rotates between rounds), so a shared machine's load changes hit every
variant alike. Reported: the median and minimum ms/step over the rounds and the ratio to the first
variant's median.
"""
from __future__ import annotations

import statistics
import sys
import time
from typing import Any, Sequence

import jax
import ml_collections


def time_train_steps(cfgs: dict[str, ml_collections.ConfigDict], batch: int, seq: int, *, rounds: int = 5,
                     steps: int = 5, seed: int = 0) -> dict[str, dict[str, Any]]:
  """{variant: {'median_ms', 'min_ms', 'samples_ms', 'compile_s'}} for one (batch, seq) shape."""
  from tformer_jax.config import validate
  from tformer_jax.nn import Transformer
  from tformer_jax.train import optim, precision, state as state_lib, step as step_lib
  runners = {}
  for name, cfg in cfgs.items():
    m = validate(cfg)
    model = Transformer(m)
    tx, schedule = optim.make_optimizer(cfg.optim, 1000)
    init = state_lib.init_fn(model, tx, precision.get_policy("float32").initial_loss_scale(), seq)
    state = jax.jit(lambda r, init=init: state_lib.unbox_plain(init(r)))(jax.random.PRNGKey(seed))
    tok = jax.random.randint(jax.random.PRNGKey(seed + 1), (batch, seq + 1), 0, m.vocab_size)
    data = {"inputs": tok[:, :-1], "targets": tok[:, 1:]}
    t0 = time.perf_counter()
    step = jax.jit(step_lib.make_train_step(model, tx, schedule, cfg.optim), donate_argnums=(0,))
    step = step.lower(state, data).compile()
    compile_s = time.perf_counter() - t0
    for _ in range(2):
      state, metrics = step(state, data)
    jax.block_until_ready(metrics)
    runners[name] = {"step": step, "state": state, "data": data, "samples": [], "compile_s": compile_s}
  names = list(cfgs)
  for r in range(rounds):
    for name in names[r % len(names):] + names[:r % len(names)]:
      run = runners[name]
      t0 = time.perf_counter()
      for _ in range(steps):
        run["state"], metrics = run["step"](run["state"], run["data"])
      jax.block_until_ready(metrics)
      run["samples"].append(1e3 * (time.perf_counter() - t0) / steps)
  return {n: {"median_ms": statistics.median(r["samples"]), "min_ms": min(r["samples"]),
              "samples_ms": r["samples"], "compile_s": r["compile_s"]} for n, r in runners.items()}


def format_table(results: dict[str, dict[str, Any]]) -> str:
  first = next(iter(results.values()))["median_ms"]
  lines = ["| variant | median ms/step | min ms/step | vs first | compile s |", "|---|---|---|---|---|"]
  for name, r in results.items():
    lines.append(f"| {name} | {r['median_ms']:.1f} | {r['min_ms']:.1f} | {r['median_ms'] / first:.2f}x | "
                 f"{r['compile_s']:.1f} |")
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
  import argparse
  import json
  from tformer_jax.diagnostics import ablate
  from tformer_jax.diagnostics.cli import apply_overrides, load_config, split_config_args
  path, overrides, rest = split_config_args(sys.argv[1:] if argv is None else argv)
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--sweep", action="append", default=[])
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--seq", type=int, default=128)
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--steps", type=int, default=5)
  p.add_argument("--json", dest="json_out", default=None)
  args = p.parse_args(rest)
  base = load_config(path, overrides)
  combos = ablate.grid([ablate.parse_sweep(s) for s in args.sweep]) or [{}]
  cfgs = {ablate.run_name(c): apply_overrides(base, c) for c in combos}
  res = time_train_steps(cfgs, args.batch, args.seq, rounds=args.rounds, steps=args.steps)
  print(format_table(res))
  if args.json_out:
    with open(args.json_out, "w") as f:
      json.dump(res, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
