r"""Step time of model variants: the real compiled train step, timed in interleaved rounds.

  python -m tformer_jax.diagnostics.timing --config=configs/experiments/remat_cost.py \
      --sweep model.remat=none,full,dots --batch 8 --seq 256 --rounds 7 --steps 5

Each variant's step is compiled once and warmed up; then every round times `steps` steps of each
variant in turn (the order rotates between rounds), so a shared machine's load changes hit every
variant alike. Reported: the median and minimum ms/step over the rounds and the ratio to the first
variant's median.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any, Sequence

import jax
import ml_collections
from absl import flags

from tformer_jax import backends, cli_common
from tformer_jax.config import validate
from tformer_jax.diagnostics import ablate
from tformer_jax.nn import Transformer
from tformer_jax.train import optim, precision, state as state_lib, step as step_lib


def time_train_steps(cfgs: dict[str, ml_collections.ConfigDict], batch: int, seq: int, *, rounds: int = 5,
                     steps: int = 5, seed: int = 0) -> dict[str, dict[str, Any]]:
  """{variant: {'median_ms', 'min_ms', 'samples_ms', 'compile_s'}} for one (batch, seq) shape; each
  variant's step runs with the backend of its cfg.runtime, as in the training loop."""
  runners = {}
  for name, cfg in cfgs.items():
    m = validate(cfg, check_paths=False)   # the architecture only: a run's files need not exist here
    backend = backends.resolve_runtime(cfg, quiet=True).backend
    model = Transformer(m)
    tx, schedule = optim.make_optimizer(cfg.optim, 1000, backend)
    init = state_lib.init_fn(model, tx, precision.get_policy("float32").initial_loss_scale(), seq)
    tok = jax.random.randint(jax.random.PRNGKey(seed + 1), (batch, seq + 1), 0, m.vocab_size)
    data = {"inputs": tok[:, :-1], "targets": tok[:, 1:]}
    with backends.use(backend):
      state = jax.jit(lambda r, init=init: state_lib.unbox_plain(init(r)))(jax.random.PRNGKey(seed))
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


def define_flags(fv: flags.FlagValues) -> None:
  flags.DEFINE_multi_string("sweep", [], "KEY=V1,V2,...: variants, the cartesian product of the sweeps"
                            "; each value set as --config.KEY=V would set it", flag_values=fv)
  flags.DEFINE_integer("batch", 8, "sequences per step", flag_values=fv)
  flags.DEFINE_integer("seq", 128, "sequence length", flag_values=fv)
  flags.DEFINE_integer("rounds", 5, "interleaved rounds", flag_values=fv)
  flags.DEFINE_integer("steps", 5, "timed steps per variant per round", flag_values=fv)
  flags.DEFINE_string("json", None, "also write the results to this file", flag_values=fv)


def main(argv: Sequence[str] | None = None) -> int:
  args = cli_common.parse(argv, define_flags, doc=__doc__, prog="python -m tformer_jax.diagnostics.timing",
                          config="required")
  try:
    combos = ablate.grid([ablate.parse_sweep(s) for s in args.sweep]) or [{}]
    cfgs = {ablate.run_name(c): cli_common.override(args.config, c) for c in combos}
  except (ValueError, cli_common.UsageError) as e:
    cli_common.fail(str(e))
  res = time_train_steps(cfgs, args.batch, args.seq, rounds=args.rounds, steps=args.steps)
  print(format_table(res))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(res, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(cli_common.run_main(main))
