"""JAX vs PyTorch (eager, torch.compile) on configs/bench/gpt2_cpu.py, side by side in one process.

  python benchmarks/compare_torch.py [--rounds 4 --k 3 --json OUT]
  python -m tformer_jax.bench compare [same flags]

Everything is built, compiled and warmed first (compile times reported apart). Then --rounds rounds;
each runs --k steps of every contender back to back (the order rotates every round) plus float32
2048^3 matmuls (--peak-reps calls with XLA's default options and with the JAX step's; the faster set
counts), so all contenders and the matmul peak see the same machine load. The JAX step compiles with
XLA's default options, as in the training loop (--xla-option NAME=VALUE adds some). Per contender:
tokens/s = all timed tokens / all timed seconds, and the median over rounds; the ratios also as the
median of per-round pairs (adjacent in time) and per process CPU-second (less sensitive to other
programs' load; torch's OpenMP spin-waiting counts as its CPU time). The FLOP count per step is the
same formula for all (tformer_jax/analysis/flops.py). MFU = achieved FLOP/s over the fastest single
matmul call of the run (strict: a lucky moment on a loaded machine raises it);
'MFU sust.' = over the sustained matmul rate (all matmul FLOPs / all matmul time, every round).
torch.set_num_threads(--threads, default all cores); XLA uses all cores
by default. Prints a table, then one JSON line.
"""
from __future__ import annotations

import os
import pathlib
import statistics
import sys
import time
from typing import Any, Sequence

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch_gpt2  # noqa: E402
from absl import flags  # noqa: E402

from tformer_jax import cli_common  # noqa: E402
from tformer_jax.analysis import flops as flops_lib  # noqa: E402
from tformer_jax.bench import emit, train as jbench  # noqa: E402


def define_flags(fv: flags.FlagValues) -> None:
  flags.DEFINE_integer("rounds", 4, "rounds of every contender", flag_values=fv)
  flags.DEFINE_integer("k", 3, "steps per contender per round", flag_values=fv)
  flags.DEFINE_integer("warmup", 2, "untimed steps per contender after compilation", flag_values=fv)
  flags.DEFINE_integer("threads", os.cpu_count(), "torch intra-op threads", flag_values=fv)
  flags.DEFINE_enum("attn", "sdpa", ["sdpa", "naive"], "torch attention", flag_values=fv)
  flags.DEFINE_bool("no-compile", False, "skip torch.compile", flag_values=fv)
  flags.DEFINE_multi_string("xla-option", [], "NAME=VALUE: an XLA option for the JAX step's compilation "
                            "only", flag_values=fv)
  flags.DEFINE_bool("foreach-adam", False, "torch AdamW(foreach) instead of fused", flag_values=fv)
  flags.DEFINE_integer("peak-n", 2048, "matmul size of the peak", flag_values=fv)
  flags.DEFINE_integer("peak-reps", 3, "matmuls per round", flag_values=fv)
  flags.DEFINE_string("json", None, "also write the result dict to this file", flag_values=fv)


def parse_args(argv: Sequence[str] | None) -> Any:
  return cli_common.parse(argv, define_flags, doc=__doc__, prog="python -m tformer_jax.bench compare",
                          config=jbench.DEFAULT_CONFIG)


def torch_config(m: Any, batch: int, seq: int, attn: str) -> torch_gpt2.GPTConfig:
  """The torch twin of a tformer_jax GPT-2-style ModelConfig (checks it is one)."""
  need = dict(position="learned", norm="layernorm", norm_position="pre", activation="gelu_tanh",
              tie_embeddings=True, qkv_bias=True, out_bias=True, mlp_bias=True, parallel_residual=False)
  bad = {k: getattr(m, k) for k, v in need.items() if getattr(m, k) != v}
  if bad or m.kv_heads != m.num_heads or m.ff != 4 * m.d_model:
    raise SystemExit(f"error: the torch reference only builds GPT-2-style models; this config differs: {bad}")
  return torch_gpt2.GPTConfig(vocab_size=m.vocab_size, d_model=m.d_model, num_layers=m.num_layers,
                              num_heads=m.num_heads, max_len=m.max_len, seq=seq, batch=batch, attn=attn)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  import jax
  import torch
  args = parse_args(argv)
  torch.set_num_threads(args.threads)
  cfg = args.config
  info = jbench.machine_info()
  print(f"machine: {info['nproc']} cpus ({info['cpu']}), load {info['loadavg']}, jax {info['jax']}, "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads), allocator {info['allocator']} "
        "(both contenders)")
  jx = jbench.TrainBench(cfg, compiler_options=jbench.parse_xla_options(args.xla_option))
  fl = flops_lib.flops_per_step(jx.m, jx.batch, jx.seq)
  tc = torch_config(jx.m, jx.batch, jx.seq, args.attn)
  benches: dict[str, Any] = {"jax": jx}
  errors: dict[str, str] = {}
  jx.compile()
  for mode in ("eager",) + (() if args.no_compile else ("compile",)):
    b, err = torch_gpt2.try_bench(tc, compile=mode == "compile", fused_adam=not args.foreach_adam)
    if b is None:
      errors["torch_" + mode] = err.splitlines()[0]
      print(f"torch {mode}: FAILED: {err}")
    else:
      benches["torch_" + mode] = b
  print("compile/first step: " + ", ".join(f"{k} {b.compile_s:.1f}s" for k, b in benches.items()))
  print(f"params: jax {jx.params:,}, torch {benches['torch_eager'].params:,}; flops/step "
        f"{fl['flops_per_step'] / 1e9:.1f} G ({fl['formula']})")
  for b in benches.values():
    if args.warmup:
      b.run(args.warmup)

  names = list(benches)
  wall = {n: 0.0 for n in names}
  cpu = {n: 0.0 for n in names}
  per_round: dict[str, list[float]] = {n: [] for n in names}
  peaks, sustained, loads = [], [], []
  for r in range(args.rounds):
    order = names[r % len(names):] + names[:r % len(names)]
    for n in order:
      c0 = time.process_time()
      w, _ = benches[n].run(args.k)
      cpu[n] += time.process_time() - c0
      wall[n] += w
      per_round[n].append(args.k * jx.tokens_per_step / w)
    nan = float("nan")
    rates = (jbench.matmul_rates(args.peak_n, args.peak_reps, option_sets=[{}, jx.compiler_options])
             if args.peak_n else {"best": nan, "mean": nan})
    peaks.append(rates["best"])
    sustained.append(rates["mean"])
    loads.append(os.getloadavg()[0])
    print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{n} {per_round[n][-1]:.0f} tok/s" for n in names)
          + f", matmul {peaks[-1]:.1f} GFLOP/s, load {loads[-1]:.2f}")

  peak = max(peaks)
  peak_sustained = statistics.harmonic_mean(sustained)   # equal FLOPs per round: all FLOPs / all time
  rows: dict[str, dict[str, Any]] = {}
  for n in names:
    tok_s = args.rounds * args.k * jx.tokens_per_step / wall[n]
    gf = tok_s / jx.tokens_per_step * fl["flops_per_step"] / 1e9
    rows[n] = {"tokens_per_s": round(tok_s, 1),
               "tokens_per_s_median_round": round(statistics.median(per_round[n]), 1),
               "achieved_gflops": round(gf, 2), "mfu": round(gf / peak, 4),
               "mfu_vs_sustained": round(gf / peak_sustained, 4), "compile_s": round(benches[n].compile_s, 2),
               "cpu_s_per_step": round(cpu[n] / (args.rounds * args.k), 3),
               "tokens_per_cpu_s": round(args.rounds * args.k * jx.tokens_per_step / cpu[n], 1),
               "final_loss": benches[n].final_loss()}
  ratios = {f"jax_over_{n}": round(rows["jax"]["tokens_per_s"] / rows[n]["tokens_per_s"], 3)
            for n in names if n != "jax"}
  # Paired per round (adjacent in time, so the same load): the median of JAX / contender.
  ratios_paired = {f"jax_over_{n}": round(statistics.median(
      a / b for a, b in zip(per_round["jax"], per_round[n])), 3) for n in names if n != "jax"}
  ratios_cpu = {f"jax_over_{n}": round(rows["jax"]["tokens_per_cpu_s"] / rows[n]["tokens_per_cpu_s"], 3)
                for n in names if n != "jax"}
  print(f"\n{'contender':<15}{'tokens/s':>10}{'median/rnd':>12}{'GFLOP/s':>10}{'MFU':>8}{'MFU sust.':>10}"
        f"{'CPU s/step':>11}{'compile s':>11}")
  for n, row in rows.items():
    print(f"{n:<15}{row['tokens_per_s']:>10.0f}{row['tokens_per_s_median_round']:>12.0f}"
          f"{row['achieved_gflops']:>10.1f}{100 * row['mfu']:>7.1f}%{100 * row['mfu_vs_sustained']:>9.1f}%"
          f"{row['cpu_s_per_step']:>11.2f}{row['compile_s']:>11.1f}")
  print(f"matmul (float32 {args.peak_n}^3): best single call of the run {peak:.1f} GFLOP/s (= MFU's peak); "
        f"sustained (all matmul time of all rounds) {peak_sustained:.1f} GFLOP/s (= 'MFU sust.'); "
        f"load avg during rounds {min(loads):.2f}-{max(loads):.2f}")
  print("ratios (tokens/s over the run): " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
  print("ratios (median of per-round pairs): " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios_paired.items()))
  print("ratios (tokens per CPU-second): " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios_cpu.items()))
  res = {"bench": "compare_torch", "config": args.config_file, "overrides": jbench.overrides_list(args),
         "rounds": args.rounds,
         "k": args.k, "tokens_per_step": jx.tokens_per_step, "flops_per_step": fl["flops_per_step"],
         "flops_formula": fl["formula"], "peak_gflops": round(peak, 2),
         "peak_gflops_sustained": round(peak_sustained, 2), "results": rows, "ratios": ratios,
         "ratios_paired_median": ratios_paired, "ratios_cpu": ratios_cpu,
         "errors": errors, "torch_attn": args.attn,
         "torch_adamw": "foreach" if args.foreach_adam else "fused",
         "xla_options": jx.compiler_options, "torch_threads": torch.get_num_threads(),
         "params": {"jax": jx.params, "torch": benches["torch_eager"].params},
         "loadavg_rounds": [round(x, 2) for x in loads], "machine": info,
         "jax_backend": jax.default_backend(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
  return emit(res, args.json)


if __name__ == "__main__":
  from tformer_jax.backends import maybe_reexec
  maybe_reexec()  # both contenders run in this process, so both get the same allocator
  main()
