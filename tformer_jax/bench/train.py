"""Training-step throughput with honest accounting: tokens/s, FLOP/s and MFU of the real train step.

  python -m tformer_jax.bench train --config=configs/bench/gpt2_cpu.py --steps 20 --warmup 3 --json OUT
  python -m tformer_jax.bench train --config.model.num_layers=2 --config.data.batch_size=2   # overrides

What is measured. The step is `tformer_jax.train.step.make_train_step` (forward, backward, clipping,
AdamW, the non-finite guard) on the state of `train.state.init_fn`, jitted with the state donated,
fed synthetic random tokens already on the device (no input pipeline). Compilation is timed apart
(`compile_s`) and excluded; then --warmup untimed steps; then --steps timed steps, each dispatched
before the previous step's metrics are read (the training loop's pattern), blocking only on those
metrics and, at the end, on the state. tokens_per_s = steps * batch * seq / wall time of the timed
steps; step_ms_median is the median interval between consecutive step completions.

FLOPs (tformer_jax/analysis/flops.py): flops = 6*N_matmul*T + 12*n_layers*n_heads*head_dim*seq*T
(causal-naive attention, fwd + bwd; --attn-flops causal halves the attention term), T = batch*seq.
peak_gflops is a jitted float32 (or --peak-dtype) NxN @ NxN matmul measured in the same process,
interleaved with the timed steps (--chunks chunks, --peak-reps calls before each and after the last):
the fastest call; mfu = achieved / peak. peak_gflops_sustained (all matmul FLOPs over all matmul
time) and mfu_vs_sustained are less sensitive to a shared machine's fluctuating load. With
--nominal-peak-tflops (e.g. 989 for an H100/H200 in dense bf16), mfu uses that figure and
mfu_measured_peak keeps the measured one.
Host allocator: run as a command, this re-runs itself under tcmalloc when it is installed (else
glibc's hugetlb tunable; backends/cpu/host_alloc.py, TFORMER_JAX_ALLOCATOR=system to skip): XLA:CPU's
per-step temp buffer otherwise page-faults every step. machine.allocator in the JSON says which ran.
Prints human-readable lines, then one JSON line (the returned dict).
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from tformer_jax import backends, cli_common
from tformer_jax.analysis import flops as flops_lib
from tformer_jax.bench import emit, op_profile
from tformer_jax.nn import Transformer
from tformer_jax.train import loop, optim, precision, setup, state as state_lib, step as step_lib

DEFAULT_CONFIG = "configs/bench/gpt2_cpu.py"
JSON_KEYS = ("tokens_per_s", "step_ms_median", "compile_s", "params", "flops_per_step",
             "flops_formula", "achieved_gflops", "peak_gflops", "mfu")


def parse_xla_options(items: Sequence[str]) -> dict[str, Any]:
  """['name=value', ...] -> {name: bool | int | str} for `Lowered.compile(compiler_options=...)`."""
  out: dict[str, Any] = {}
  for item in items:
    name, sep, raw = item.partition("=")
    if not sep:
      cli_common.fail(f"--xla-option {item!r} is not NAME=VALUE")
    low = raw.lower()
    value: Any = int(raw) if raw.isdigit() else raw
    out[name.lstrip("-")] = (low == "true") if low in ("true", "false") else value
  return out


def compile_with(lowered: Any, options: dict[str, Any]) -> Any:
  """lowered.compile(options); an option this jaxlib does not know is an error naming it."""
  try:
    return lowered.compile(compiler_options=options or None)
  except Exception as e:  # noqa: BLE001 - jaxlib raises a plain runtime error for unknown options
    if options and "compile option" in str(e):
      raise ValueError(f"XLA rejected the compile options {options}: "
                       f"{str(e).splitlines()[0][:200]}") from e
    raise


class TrainBench:
  """The real train step on synthetic tokens: compile once, then run timed rounds of k steps.

  The step runs with the backend `backends.resolve_runtime` makes of cfg.runtime (as the training
  loop, one device). compiler_options: XLA options for this step's compilation (default none: as the
  training loop)."""

  def __init__(self, cfg: Any, seed: int = 0, num_batches: int = 4,
               compiler_options: dict[str, Any] | None = None, donate: bool = True):
    self.cfg = cfg
    self.compiler_options = dict(compiler_options or {})
    self.runtime = backends.resolve_runtime(cfg, quiet=True)
    self.m = loop.resolve_model_config(cfg)
    self.batch, self.seq = int(cfg.data.batch_size), int(cfg.data.seq_len)
    self.tokens_per_step = self.batch * self.seq
    model = Transformer(self.m)
    tx, schedule = optim.make_optimizer(cfg.optim, int(cfg.train.steps), self.runtime.backend)
    policy = precision.get_policy(cfg.train.precision)
    init = state_lib.init_fn(model, tx, policy.initial_loss_scale(), self.seq)
    with backends.use(self.runtime.backend):
      self.state = jax.jit(lambda r: state_lib.unbox_plain(init(r)))(jax.random.PRNGKey(seed))
    self.params = state_lib.param_count(self.state.params)
    step = step_lib.make_train_step(model, tx, schedule, cfg.optim, **setup.train_step_options(cfg))
    self._jit = jax.jit(step, donate_argnums=(0,) if donate else ())
    rng = np.random.default_rng(seed)
    self.batches = []
    for _ in range(num_batches):
      toks = rng.integers(0, self.m.vocab_size, (self.batch, self.seq + 1), dtype=np.int32)
      self.batches.append({"inputs": jnp.asarray(toks[:, :-1]), "targets": jnp.asarray(toks[:, 1:])})
    self.compiled = None
    self.compile_s = float("nan")
    self.steps_done = 0
    self.last_metrics: dict[str, Any] = {}

  def compile(self) -> float:
    t0 = time.perf_counter()
    with backends.use(self.runtime.backend):    # traced (lowered) under the run's backend
      lowered = self._jit.lower(self.state, self.batches[0])
    self.compiled = compile_with(lowered, self.compiler_options)
    self.compile_s = time.perf_counter() - t0
    return self.compile_s

  def xla_flops(self) -> float | None:
    """XLA's own FLOP count of the compiled step (cost_analysis), for a cross-check."""
    try:
      ca = self.compiled.cost_analysis()
      ca = ca[0] if isinstance(ca, (list, tuple)) else ca
      return float(ca.get("flops")) if ca and ca.get("flops") is not None else None
    except Exception:  # noqa: BLE001 - not every backend reports it
      return None

  def run(self, steps: int) -> tuple[float, list[float]]:
    """Run `steps` steps pipelined; returns (wall seconds, per-step completion intervals)."""
    if self.compiled is None:
      self.compile()
    t0 = time.perf_counter()
    marks, pending = [], None
    for i in range(steps):
      self.state, metrics = self.compiled(self.state, self.batches[(self.steps_done + i) % len(self.batches)])
      if pending is not None:
        pending["loss"].block_until_ready()
        marks.append(time.perf_counter())
      pending = metrics
    jax.block_until_ready((self.state, pending))
    marks.append(time.perf_counter())
    self.steps_done += steps
    self.last_metrics = pending
    wall = marks[-1] - t0
    intervals = list(np.diff([t0] + marks))
    return wall, intervals

  def final_loss(self) -> float:
    return float(self.last_metrics["loss"]) if self.last_metrics else float("nan")


def matmul_rates(n: int = 2048, reps: int = 5, dtype: str = "float32",
                 option_sets: Sequence[dict[str, Any]] = ({},)) -> dict[str, float]:
  """GFLOP/s of a jitted n x n @ n x n matmul (2 n^3 FLOPs) over `reps` timed calls after a warm-up:
  'best' (fastest call), 'median', and 'mean' (all FLOPs over all time: the sustained rate).
  With several XLA option sets (e.g. the default and the step's), each is timed and the fastest set
  (by its mean) is reported, so the peak is never lower than what XLA's default reaches. A set
  given twice (the step's options are often XLA's defaults) is timed once."""
  option_sets = [o for i, o in enumerate(option_sets) if o not in option_sets[:i]]
  if len(option_sets) > 1:
    return max((matmul_rates(n, reps, dtype, [o]) for o in option_sets), key=lambda r: r["mean"])
  ka, kb = jax.random.split(jax.random.PRNGKey(0))
  a = jax.random.normal(ka, (n, n), jnp.dtype(dtype))
  b = jax.random.normal(kb, (n, n), jnp.dtype(dtype))
  f = compile_with(jax.jit(lambda x, y: x @ y).lower(a, b), dict(option_sets[0]))
  f(a, b).block_until_ready()
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    f(a, b).block_until_ready()
    times.append(time.perf_counter() - t0)
  fl = 2 * n ** 3 / 1e9
  return {"best": fl / min(times), "median": fl / statistics.median(times),
          "mean": fl * len(times) / sum(times)}


def machine_info() -> dict[str, Any]:
  """nproc, CPU model, load average, jax backend and device: what a figure was measured on."""
  dev = jax.devices()[0]
  return {"nproc": os.cpu_count(), "cpu": backends.cpu_field("model name"),
          "loadavg": [round(x, 2) for x in os.getloadavg()],
          "backend": jax.default_backend(), "device": getattr(dev, "device_kind", str(dev)),
          "jax": jax.__version__, "allocator": backends.loaded_allocator(),
          "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def define_flags(fv: flags.FlagValues) -> None:
  flags.DEFINE_integer("steps", 20, "timed steps", lower_bound=1, flag_values=fv)
  flags.DEFINE_integer("warmup", 3, "untimed steps after compilation", lower_bound=0, flag_values=fv)
  flags.DEFINE_enum("attn-flops", "full", ["full", "causal"], "attention FLOP count: every (query, key) "
                    "pair, or the causal half", flag_values=fv)
  flags.DEFINE_integer("peak-n", 2048, "matmul size for the peak (0: skip)", lower_bound=0, flag_values=fv)
  flags.DEFINE_integer("peak-reps", 3, "matmul calls per measurement", lower_bound=1, flag_values=fv)
  flags.DEFINE_integer("chunks", 4, "timed steps run in this many chunks, the matmul measured before each "
                       "and after the last", lower_bound=1, flag_values=fv)
  flags.DEFINE_string("peak-dtype", "float32", "dtype of the peak matmul", flag_values=fv)
  flags.DEFINE_float("nominal-peak-tflops", 0.0, "a datasheet peak to compute mfu against (e.g. 989 for "
                     "H100/H200 dense bf16)", lower_bound=0.0, flag_values=fv)
  flags.DEFINE_multi_string("xla-option", [], "NAME=VALUE: an XLA debug option for this step's "
                            "compilation only, e.g. xla_cpu_enable_concurrency_optimized_scheduler=true",
                            flag_values=fv)
  flags.DEFINE_bool("no-donate", False, "do not donate the state (the training loop donates; on CPU XLA "
                    "then copies the AdamW moments it updates in place, ~5% of a step)", flag_values=fv)
  flags.DEFINE_string("profile", None, "DIR: trace 3 extra steps with jax.profiler into DIR and print the "
                      "step's time by op kind (matmuls, elementwise fusions, each custom call) and the "
                      "slowest ops (tformer_jax/bench/op_profile.py)", flag_values=fv)
  flags.DEFINE_string("json", None, "also write the result dict to this file", flag_values=fv)


def parse_args(argv: Sequence[str] | None) -> Any:
  return cli_common.parse(argv, define_flags, doc=__doc__, prog="python -m tformer_jax.bench train",
                          config=DEFAULT_CONFIG)


def overrides_list(args: Any) -> list[str]:
  """The applied --config.a.b=v overrides, as 'a.b=v' strings for the result JSON."""
  return [f"{k}={v}" for k, v in args.overrides.items()]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = parse_args(argv)
  cfg = args.config
  options = parse_xla_options(args.xla_option)
  bench = TrainBench(cfg, compiler_options=options, donate=not args.no_donate)
  peak_option_sets = [{}, options]
  m = bench.m
  fl = flops_lib.flops_per_step(m, bench.batch, bench.seq, args.attn_flops)
  info = machine_info()
  print(f"machine: {info['nproc']} cpus ({info['cpu']}), load {info['loadavg']}, backend {info['backend']} "
        f"({info['device']}), jax {info['jax']}, allocator {info['allocator']}")
  print(f"model: {bench.params / 1e6:.2f}M params (N_matmul {fl['n_matmul'] / 1e6:.2f}M), "
        f"layers={m.num_layers} "
        f"d_model={m.d_model} heads={m.num_heads}/{m.kv_heads} dtype={m.dtype} "
        f"scan={m.scan_layers} remat={m.remat}; batch {bench.batch} x seq {bench.seq}")
  print(bench.runtime.summary())
  compile_s = bench.compile()
  xla_flops = bench.xla_flops()
  print(f"compile: {compile_s:.2f}s; flops/step {fl['flops_per_step'] / 1e9:.2f} G ({fl['formula']})"
        + (f"; XLA cost_analysis {xla_flops / 1e9:.2f} G" if xla_flops else ""))
  if args.warmup:
    bench.run(args.warmup)
  # The timed steps run in --chunks chunks with a matmul measurement before each and after the last,
  # so the peak sees the same (possibly shared, fluctuating) machine as the steps.
  chunks = max(1, min(args.chunks, args.steps))
  sizes = [args.steps // chunks + (i < args.steps % chunks) for i in range(chunks)]
  nan = float("nan")
  samples, wall, intervals = [], 0.0, []
  for size in sizes + [0]:
    if args.peak_n:
      samples.append(matmul_rates(args.peak_n, args.peak_reps, args.peak_dtype, peak_option_sets))
    if size:
      w, iv = bench.run(size)
      wall, intervals = wall + w, intervals + iv
  peak = max((r["best"] for r in samples), default=nan)
  peak_sustained = statistics.harmonic_mean([r["mean"] for r in samples]) if samples else nan
  rates = {"best": peak, "median": statistics.median([r["median"] for r in samples]) if samples else nan}
  op_summary = None
  if args.profile:
    jax.profiler.start_trace(args.profile, create_perfetto_trace=True)
    prof_wall, _ = bench.run(3)
    jax.profiler.stop_trace()
    op_summary = op_profile.summarize(op_profile.load_trace_events(args.profile),
                                      op_profile.hlo_op_kinds(bench.compiled.as_text()), 3, prof_wall)
  loss = bench.final_loss()
  tok_s = args.steps * bench.tokens_per_step / wall
  achieved = args.steps * fl["flops_per_step"] / wall / 1e9
  nominal = args.nominal_peak_tflops * 1e3
  mfu_measured = achieved / peak if peak == peak and peak > 0 else float("nan")
  res: dict[str, Any] = dict(
      bench="train", config=args.config_file, overrides=overrides_list(args), steps=args.steps, warmup=args.warmup,
      batch=bench.batch, seq=bench.seq, tokens_per_step=bench.tokens_per_step,
      tokens_per_s=round(tok_s, 1), step_ms_median=round(1e3 * statistics.median(intervals), 2),
      step_ms_min=round(1e3 * min(intervals), 2), compile_s=round(compile_s, 3), params=bench.params,
      n_matmul=fl["n_matmul"], flops_per_step=fl["flops_per_step"], attention_flops=fl["attention_flops"],
      flops_formula=fl["formula"], xla_flops_per_step=xla_flops, achieved_gflops=round(achieved, 2),
      peak_gflops=round(peak, 2), peak_gflops_median=round(rates["median"], 2), peak_dtype=args.peak_dtype,
      peak_gflops_sustained=round(peak_sustained, 2), mfu_measured_peak=round(mfu_measured, 4),
      mfu_vs_sustained=round(achieved / peak_sustained, 4) if samples else nan, chunks=chunks,
      mfu=round(achieved / nominal, 4) if nominal else round(mfu_measured, 4),
      nominal_peak_gflops=nominal or None, final_loss=loss, loss_finite=bool(np.isfinite(loss)),
      runtime=bench.runtime.as_dict(), dtype=m.dtype, donate=not args.no_donate,
      xla_options=options,
      machine=info)
  if op_summary is not None:
    res["op_profile"] = op_summary
  print(f"throughput: {tok_s:,.0f} tokens/s | step median {res['step_ms_median']:.1f} ms | "
        f"{achieved:.1f} GFLOP/s achieved")
  print(f"peak: {peak:.1f} GFLOP/s ({args.peak_dtype} {args.peak_n}^3 matmul, best of "
        f"{len(samples)} x {args.peak_reps} calls around {chunks} chunks of steps; sustained "
        f"{peak_sustained:.1f}) -> MFU {100 * res['mfu']:.1f}%" + (f" of nominal {nominal / 1e3:.0f} TFLOP/s "
                                            f"({100 * mfu_measured:.1f}% of measured)" if nominal else ""))
  if samples:
    print(f"MFU vs the sustained matmul rate: {100 * res['mfu_vs_sustained']:.1f}%")
  print(f"final loss {loss:.4f}")
  if op_summary is not None:
    print(op_profile.format_summary(op_summary))
    print(f"trace written to {args.profile} (Perfetto / TensorBoard)")
  return emit(res, args.json)


if __name__ == "__main__":
  from tformer_jax.backends import maybe_reexec
  maybe_reexec()
  sys.exit(cli_common.run_main(main))
