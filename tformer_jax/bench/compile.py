"""Compile time of the train step: scan_layers vs unrolled layers, at several depths.

  python -m tformer_jax.bench compile --layers 2,24 [--config=configs/bench/gpt2_cpu.py --repeats 2 \
      --config.model.remat=full]

For each depth and layout it builds the real train step (tformer_jax.train.step.make_train_step,
state donated) on abstract inputs (jax.eval_shape: nothing is allocated or run) and times
trace + lowering (`jit(...).lower`) and XLA compilation (`.compile()`) separately; with --repeats the
fastest of the repeats counts (cases interleaved). With scan_layers the layer stack is one
`nn.scan`, so compile time should hardly grow with depth: `scan_growth` = total time at the deepest
over the shallowest depth (target <= 1.5); `unrolled_growth` is the same for the unrolled stack.
Prints a table, then one JSON line.
"""
from __future__ import annotations

import sys
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from absl import flags

from tformer_jax import backends, cli_common
from tformer_jax.bench import emit, train as train_bench
from tformer_jax.nn import Transformer
from tformer_jax.train import loop, optim, precision, state as state_lib, step as step_lib


def define_flags(fv: flags.FlagValues) -> None:
  flags.DEFINE_string("layers", "2,24", "comma-separated depths", flag_values=fv)
  flags.DEFINE_string("modes", "scan,unrolled", "scan, unrolled or both (comma-separated)", flag_values=fv)
  flags.DEFINE_integer("repeats", 1, "time each case this many times, keep the fastest", flag_values=fv)
  flags.DEFINE_string("json", None, "also write the result dict to this file", flag_values=fv)


def parse_args(argv: Sequence[str] | None) -> Any:
  return cli_common.parse(argv, define_flags, doc=__doc__, prog="python -m tformer_jax.bench compile",
                          config=train_bench.DEFAULT_CONFIG)


def compile_case(cfg: Any, layers: int, scan: bool) -> dict[str, float]:
  """Trace+lower and compile seconds of the train step for `layers` layers (scanned or not), under the
  backend of cfg.runtime."""
  cfg = cfg.copy_and_resolve_references()
  cfg.model.num_layers, cfg.model.scan_layers = layers, scan
  backend = backends.resolve_runtime(cfg, quiet=True).backend
  m = loop.resolve_model_config(cfg)
  model = Transformer(m)
  tx, schedule = optim.make_optimizer(cfg.optim, int(cfg.train.steps), backend)
  policy = precision.get_policy(cfg.train.precision)
  seq, batch = int(cfg.data.seq_len), int(cfg.data.batch_size)
  init = state_lib.init_fn(model, tx, policy.initial_loss_scale(), seq)
  t0 = time.perf_counter()
  with backends.use(backend):
    abstract = jax.eval_shape(lambda r: state_lib.unbox_plain(init(r)), jax.random.PRNGKey(0))
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    step = step_lib.make_train_step(model, tx, schedule, cfg.optim)
    lowered = jax.jit(step, donate_argnums=(0,)).lower(abstract, {"inputs": tokens, "targets": tokens})
  t1 = time.perf_counter()
  train_bench.compile_with(lowered, {})
  t2 = time.perf_counter()
  return {"trace_lower_s": t1 - t0, "compile_s": t2 - t1, "total_s": t2 - t0}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = parse_args(argv)
  cfg = args.config
  try:
    depths = [int(x) for x in args.layers.split(",") if x]
  except ValueError:
    depths = []
  modes = [x for x in args.modes.split(",") if x]
  if any(x not in ("scan", "unrolled") for x in modes) or not depths:
    cli_common.fail("--modes takes scan and/or unrolled; --layers at least one depth")
  info = train_bench.machine_info()
  print(f"machine: {info['nproc']} cpus ({info['cpu']}), load {info['loadavg']}, backend {info['backend']}, "
        f"jax {info['jax']}; model d_model={cfg.model.d_model}, remat={cfg.model.remat}")
  print(backends.resolve_runtime(cfg, quiet=True).summary())
  best: dict[tuple[str, int], dict[str, float]] = {}
  for _ in range(max(1, args.repeats)):
    for layers in depths:
      for mode in modes:
        r = compile_case(cfg, layers, mode == "scan")
        key = (mode, layers)
        if key not in best or r["total_s"] < best[key]["total_s"]:
          best[key] = r
  print(f"{'layers':>6} {'mode':<9}{'trace+lower s':>14}{'compile s':>11}{'total s':>9}")
  rows = []
  for (mode, layers), r in sorted(best.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    print(f"{layers:>6} {mode:<9}{r['trace_lower_s']:>14.2f}{r['compile_s']:>11.2f}{r['total_s']:>9.2f}")
    rows.append({"layers": layers, "mode": mode, **{k: round(v, 3) for k, v in r.items()}})
  res: dict[str, Any] = {"bench": "compile", "config": args.config_file,
                         "overrides": train_bench.overrides_list(args),
                         "layers": depths, "repeats": args.repeats, "results": rows, "machine": info}
  lo, hi = min(depths), max(depths)
  for mode in modes:
    if lo != hi and (mode, lo) in best and (mode, hi) in best:
      growth = best[(mode, hi)]["total_s"] / best[(mode, lo)]["total_s"]
      res[f"{mode}_growth"] = round(growth, 3)
      print(f"{mode}: {hi} layers take {growth:.2f}x the time of {lo}" +
            (" (target <= 1.5x)" if mode == "scan" else ""))
  return emit(res, args.json)


if __name__ == "__main__":
  sys.exit(cli_common.run_main(main))
