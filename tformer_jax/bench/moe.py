"""MoE FFN benchmark: throughput and compiled memory of one layer, forward + backward.

  python -m tformer_jax.bench moe --tokens 4096 --d-model 256 --experts 8 --top-k 2 --json OUT.json

Cases: the MoEFFN layer with capacity dispatch (one-hot einsums, or scatter/gather:
'capacity_scatter'), with dropless (sort + ragged_dot) dispatch, and a dense FFN with the same active
parameters per token (hidden = top_k * F). Each case jits grad(sum(y) + aux losses) w.r.t. the input
and all weights, reads `memory_analysis()` (temporaries) and `cost_analysis()` (flops) of the
compiled step, then times it (median of --repeats runs after a warm-up). Prints one line per case
and, last, one JSON line.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from absl import flags

from tformer_jax import cli_common
from tformer_jax.config import ModelConfig, MoEConfig
from tformer_jax.nn.moe import MoEFFN, collect_aux_loss, expert_hidden
from tformer_jax.ops import moe as moe_ops

CASES = ("capacity", "capacity_scatter", "dropless", "dense")


def _cfg(args: Any, dispatch: str) -> ModelConfig:
  return ModelConfig(d_model=args.d_model, d_ff=args.d_ff, activation=args.activation,
                     dtype=args.dtype, moe=MoEConfig(num_experts=args.experts, top_k=args.top_k,
                                                     dispatch=dispatch,
                                                     capacity_factor=args.capacity_factor))


def _case(name: str, args: Any) -> tuple[Callable, Any, dict[str, Any]]:
  """(loss(params, x), params, info) for one case; grad of loss is what gets timed."""
  x_shape = (1, args.tokens, args.d_model)
  key = jax.random.key(0)
  if name == "dense":
    cfg = _cfg(args, "dropless")
    f = args.top_k * expert_hidden(cfg)
    names = moe_ops.expert_param_names(args.activation)
    keys = jax.random.split(key, len(names))
    params = {n: cfg.init_std * jax.random.normal(k, (f, args.d_model) if n in ("w_down", "w_out")
                                                  else (args.d_model, f))
              for n, k in zip(names, keys)}

    def loss(params, x):
      x_TxD = x.reshape(-1, args.d_model).astype(jnp.dtype(args.dtype))
      y = moe_ops.dense_ffn(x_TxD, params, activation=args.activation)
      return jnp.sum(y.astype(jnp.float32))
    return loss, params, {"hidden": f}

  dispatch = "capacity" if name.startswith("capacity") else name
  cfg = _cfg(args, dispatch)
  mod = MoEFFN(cfg, capacity_impl="scatter" if name == "capacity_scatter" else "einsum")
  params = nn.unbox(jax.jit(mod.init)(key, jnp.zeros(x_shape))["params"])

  def loss(params, x):
    y, mut = mod.apply({"params": params}, x, mutable=["aux_loss", "moe_metrics"])
    return jnp.sum(y.astype(jnp.float32)) + collect_aux_loss(mut)
  info = {"hidden": expert_hidden(cfg)}
  if dispatch == "capacity":
    info["capacity"] = moe_ops.capacity(args.tokens, args.experts, args.top_k, args.capacity_factor)
  return loss, params, info


def _analysis(compiled: Any) -> dict[str, Any]:
  out: dict[str, Any] = {"temp_bytes": None, "flops": None}
  try:
    ma = compiled.memory_analysis()
    if ma is not None:
      out["temp_bytes"] = int(getattr(ma, "temp_size_in_bytes", 0) or 0)
  except Exception:  # noqa: BLE001 - not every backend reports it
    pass
  try:
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    if ca and "flops" in ca:
      out["flops"] = float(ca["flops"])
  except Exception:  # noqa: BLE001
    pass
  return out


def run_case(name: str, args: Any) -> dict[str, Any]:
  loss, params, info = _case(name, args)
  x = jax.random.normal(jax.random.key(1), (1, args.tokens, args.d_model), jnp.float32)
  step = jax.jit(jax.grad(loss, argnums=(0, 1)))
  t0 = time.perf_counter()
  compiled = step.lower(params, x).compile()
  row: dict[str, Any] = {"case": name, "compile_s": round(time.perf_counter() - t0, 3), **info}
  row["params"] = int(sum(p.size for p in jax.tree.leaves(params)))
  row.update(_analysis(compiled))
  jax.block_until_ready(compiled(params, x))   # warm-up
  times = []
  for _ in range(max(1, args.repeats)):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(params, x))
    times.append(time.perf_counter() - t0)
  row["time_s"] = round(statistics.median(times), 5)
  row["tokens_per_s"] = round(args.tokens / row["time_s"], 1)
  return row


def define_flags(fv: flags.FlagValues) -> None:
  flags.DEFINE_integer("tokens", 4096, "tokens per step (one row)", flag_values=fv)
  flags.DEFINE_integer("d-model", 256, "model width", flag_values=fv)
  flags.DEFINE_integer("experts", 8, "number of experts", flag_values=fv)
  flags.DEFINE_integer("top-k", 2, "experts per token", flag_values=fv)
  flags.DEFINE_integer("d-ff", 0, "expert hidden size; 0 = ModelConfig.ff", flag_values=fv)
  flags.DEFINE_string("activation", "swiglu", "FFN activation", flag_values=fv)
  flags.DEFINE_float("capacity-factor", 1.25, "capacity dispatch: slots per expert over the even share",
                     flag_values=fv)
  flags.DEFINE_string("dtype", "float32", "compute dtype", flag_values=fv)
  flags.DEFINE_integer("repeats", 5, "timed runs after the warm-up (median)", flag_values=fv)
  flags.DEFINE_string("cases", ",".join(CASES), f"comma-separated, from {', '.join(CASES)}", flag_values=fv)
  flags.DEFINE_string("json", "", "also write the result dict to this file", flag_values=fv)


def parse_args(argv: Sequence[str] | None) -> Any:
  return cli_common.parse(argv, define_flags, doc=__doc__, prog="python -m tformer_jax.bench moe")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = parse_args(argv)
  cases = cli_common.choices(args.cases, CASES, "case")
  config = {k: v for k, v in vars(args).items() if k != "json"}
  config["backend"] = jax.default_backend()
  print(f"MoE FFN fwd+bwd: tokens={args.tokens} d_model={args.d_model} experts={args.experts} "
        f"top_k={args.top_k} activation={args.activation} dtype={args.dtype} "
        f"capacity_factor={args.capacity_factor} on {jax.default_backend()}", flush=True)
  rows = []
  for c in cases:
    row = run_case(c, args)
    rows.append(row)
    mib = "n/a" if row["temp_bytes"] is None else f"{row['temp_bytes'] / 2 ** 20:8.1f} MiB"
    gf = "n/a" if row["flops"] is None else f"{row['flops'] / 1e9:7.2f} GFLOP"
    print(f"  {c:16s} hidden={row['hidden']:5d} params={row['params']:9d} "
          f"{row['tokens_per_s']:12.1f} tok/s  {row['time_s'] * 1e3:9.2f} ms  temp {mib}  {gf}",
          flush=True)
  result = {"config": config, "rows": rows}
  line = json.dumps(result)
  print(line, flush=True)
  if args.json:
    with open(args.json, "w") as fh:
      fh.write(line + "\n")
  return result


if __name__ == "__main__":
  sys.exit(cli_common.run_main(main))
