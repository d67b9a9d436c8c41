"""MoE FFN benchmark: throughput and compiled memory of one layer, forward + backward.

  python -m tformer_jax.bench moe --tokens 4096 --d-model 256 --experts 8 --top-k 2 --json OUT.json

Cases: the MoEFFN layer with capacity dispatch (one-hot einsums, or scatter/gather:
'capacity_scatter'), with dropless (sort + ragged_dot) dispatch, and a dense FFN with the same active
parameters per token (hidden = top_k * F). Each case jits grad(sum(y) + aux losses) w.r.t. the input
and all weights, reads `memory_analysis()` (temporaries) and `cost_analysis()` (flops) of the
compiled step, then times it (median of --repeats runs after a warm-up). Prints one line per case
and, last, one JSON line.

'expert_parallel' (not in the default cases): on a (expert=--ep-devices) mesh of fake CPU devices (set
before jax starts), for each --ep-experts count at the same active parameters per token (top_k
experts of hidden F), the dropless layer expert parallel ('ep': ops/moe_parallel.py, all_to_all
exchange, receive buffer --ep-buffer-factor x the balanced load) and with the global dispatch
('global': GSPMD replicates the expert work), against the dense FFN of hidden top_k * F split over
the same devices (data parallel): tokens/s and the ratios to the dense row, one run.

  python -m tformer_jax.bench moe --cases=expert_parallel --ep-experts=8,16,64 --tokens=8192
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from absl import flags
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from tformer_jax import backends, cli_common
from tformer_jax.config import ModelConfig, MoEConfig
from tformer_jax.nn.moe import MoEFFN, collect_aux_loss, expert_hidden
from tformer_jax.ops import moe as moe_ops
from tformer_jax.parallel import mesh as mesh_lib

CASES = ("capacity", "capacity_scatter", "dropless", "dense")
ALL_CASES = CASES + ("expert_parallel",)


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


def _timed(fn: Callable, *args: Any, repeats: int) -> tuple[float, Any]:
  out = jax.block_until_ready(fn(*args))     # warm-up
  times = []
  for _ in range(max(1, repeats)):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times), out


def _ep_step(mod: nn.Module, variables: Any, x: Any, mesh: Any, rules: Any, backend: Any) -> Callable:
  def loss(v, x):
    y, mut = mod.apply(v, x, mutable=["aux_loss", "moe_metrics"])
    dropped = jnp.mean(jnp.stack([jnp.mean(d) for d in jax.tree.leaves(mut["moe_metrics"]["dropped_fraction"])]))
    return jnp.sum(y.astype(jnp.float32)) + collect_aux_loss(mut), dropped
  with backends.use(backend):
    return jax.jit(mesh_lib.traced_under(jax.grad(loss, argnums=(0, 1), has_aux=True), mesh, rules))


def expert_parallel_rows(args: Any) -> list[dict[str, Any]]:
  """The 'expert_parallel' case: see the module docstring."""
  p = args.ep_devices
  if len(jax.devices()) < p:
    raise cli_common.UsageError(f"--ep-devices={p}: only {len(jax.devices())} devices; on CPU run with "
                                f"XLA_FLAGS=--xla_force_host_platform_device_count={p}")
  mesh = jax.make_mesh((p,), ("expert",), axis_types=(AxisType.Auto,), devices=jax.devices()[:p])
  rules = (("batch", "expert"), ("expert", "expert"))
  x = jax.device_put(jax.random.normal(jax.random.key(1), (p, args.tokens // p, args.d_model)),
                     NamedSharding(mesh, P("expert")))
  dense_loss, dense_params, info = _case("dense", args)
  t_dense, _ = _timed(jax.jit(jax.grad(dense_loss, argnums=(0, 1))), dense_params, x, repeats=args.repeats)
  rows = [{"case": "dense", "experts": 0, "hidden": info["hidden"], "time_s": round(t_dense, 5),
           "tokens_per_s": round(args.tokens / t_dense, 1)}]
  try:
    counts = [int(v) for v in args.ep_experts.split(",") if v.strip()]
  except ValueError:
    raise cli_common.UsageError(f"--ep-experts: comma-separated integers, got {args.ep_experts!r}") from None
  for e in counts:
    cfg = dataclasses.replace(_cfg(args, "dropless"), moe=MoEConfig(
        num_experts=e, top_k=args.top_k, d_ff=args.d_ff, ep_buffer_factor=args.ep_buffer_factor))
    mod = MoEFFN(cfg)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
      boxed = jax.jit(mod.init)(jax.random.key(0), x)
      variables = jax.device_put(nn.unbox(boxed), nn.unbox(nn.logical_to_mesh_sharding(
          nn.get_partition_spec(boxed), mesh, rules)))
    for kind, backend in (("ep", backends.Backend(moe_exchange="all_to_all")), ("global", backends.Backend())):
      t, (_, dropped) = _timed(_ep_step(mod, variables, x, mesh, rules, backend), variables, x,
                               repeats=args.repeats)
      rows.append({"case": f"moe_{kind}", "experts": e, "hidden": expert_hidden(cfg), "time_s": round(t, 5),
                   "tokens_per_s": round(args.tokens / t, 1), "dropped_fraction": float(dropped),
                   "vs_dense": round(t_dense / t, 3)})
  return rows


def define_flags(fv: flags.FlagValues) -> None:
  flags.DEFINE_integer("tokens", 4096, "tokens per step (one row)", lower_bound=1, flag_values=fv)
  flags.DEFINE_integer("d-model", 256, "model width", lower_bound=1, flag_values=fv)
  flags.DEFINE_integer("experts", 8, "number of experts", lower_bound=1, flag_values=fv)
  flags.DEFINE_integer("top-k", 2, "experts per token", lower_bound=1, flag_values=fv)
  flags.DEFINE_integer("d-ff", 0, "expert hidden size; 0 = ModelConfig.ff", lower_bound=0, flag_values=fv)
  flags.DEFINE_string("activation", "swiglu", "FFN activation", flag_values=fv)
  flags.DEFINE_float("capacity-factor", 1.25, "capacity dispatch: slots per expert over the even share",
                     lower_bound=0.0, flag_values=fv)
  flags.DEFINE_string("dtype", "float32", "compute dtype", flag_values=fv)
  flags.DEFINE_integer("repeats", 5, "timed runs after the warm-up (median)", lower_bound=1, flag_values=fv)
  flags.DEFINE_string("cases", ",".join(CASES), f"comma-separated, from {', '.join(ALL_CASES)}", flag_values=fv)
  flags.DEFINE_string("ep-experts", "8,16,64", "expert_parallel: expert counts (same active parameters)",
                      flag_values=fv)
  flags.DEFINE_integer("ep-devices", 8, "expert_parallel: devices of the expert axis", lower_bound=1, flag_values=fv)
  flags.DEFINE_float("ep-buffer-factor", 1.25, "expert_parallel: model.moe.ep_buffer_factor (0 = worst case)",
                     lower_bound=0.0, flag_values=fv)
  flags.DEFINE_string("json", "", "also write the result dict to this file", flag_values=fv)


def parse_args(argv: Sequence[str] | None) -> Any:
  return cli_common.parse(argv, define_flags, doc=__doc__, prog="python -m tformer_jax.bench moe")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = parse_args(argv)
  cases = cli_common.choices(args.cases, ALL_CASES, "case")
  config = {k: v for k, v in vars(args).items() if k != "json"}
  config["backend"] = jax.default_backend()
  print(f"MoE FFN fwd+bwd: tokens={args.tokens} d_model={args.d_model} experts={args.experts} "
        f"top_k={args.top_k} activation={args.activation} dtype={args.dtype} "
        f"capacity_factor={args.capacity_factor} on {jax.default_backend()}", flush=True)
  rows = []
  for c in cases:
    if c == "expert_parallel":
      for row in expert_parallel_rows(args):
        rows.append(row)
        print(f"  {row['case']:10s} experts={row['experts']:3d} hidden={row['hidden']:5d} "
              f"{row['tokens_per_s']:12.1f} tok/s  x{row.get('vs_dense', 1.0):.3f} of dense  "
              f"dropped {row.get('dropped_fraction', 0.0):.4f}", flush=True)
      continue
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
