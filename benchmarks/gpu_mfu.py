"""Self-checking MFU run of configs/bench/llama_1b_gpu.py on one GPU (Python side of scripts/gpu_bench.sh).

  python benchmarks/gpu_mfu.py [--steps 10 --warmup 3 --json OUT]      # on the GPU machine
  python benchmarks/gpu_mfu.py --smoke                                  # anywhere: tiny CPU override
  python benchmarks/gpu_mfu.py --config.model.remat=full [--config=FILE]  # config overrides

It runs `python -m tformer_jax.bench train` in-process on the ~0.9B Llama-style config in bf16 with cuDNN
attention, trying the (batch, remat) choices of --attempts in order until one fits in memory, and reports
MFU against the dense bf16 datasheet peak (--nominal-tflops, 989 for H100/H200 SXM) and against a bf16
8192^3 matmul measured in the same process. FLOPs: tformer_jax/bench/flops.py, 'full' attention term
(cuDNN gets the causal mask as a dense mask here, so it computes every tile).
Self-checks (any failure: exit 1): jax sees a GPU (not with --smoke), the config validates, some attempt
fits, the loss is finite, throughput is positive. The MFU target (--target, 0.55) is reported as
met / missed in the table and the JSON; missing it is not a self-check failure.
"""
from __future__ import annotations

import json
import math
import pathlib
import sys
import traceback
from typing import Any, Sequence

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from absl import flags  # noqa: E402

from tformer_jax import cli_common  # noqa: E402

DEFAULT_CONFIG = "configs/bench/llama_1b_gpu.py"
SMOKE = {"model.vocab_size": 256, "model.d_model": 64, "model.num_layers": 2, "model.num_heads": 4,
         "model.num_kv_heads": 2, "model.d_ff": 128, "model.max_len": 64, "runtime.attention": "xla",
         "data.seq_len": 64}


def define_flags(fv: flags.FlagValues) -> None:
  flags.DEFINE_string("attempts", "16:none,16:dots,8:dots", "batch:remat choices, tried in order until one "
                      "fits", flag_values=fv)
  flags.DEFINE_integer("steps", 10, "timed steps", flag_values=fv)
  flags.DEFINE_integer("warmup", 3, "untimed steps after compilation", flag_values=fv)
  flags.DEFINE_float("nominal-tflops", 989.0, "datasheet dense bf16 peak (H100/H200 SXM: 989)",
                     flag_values=fv)
  flags.DEFINE_float("target", 0.55, "the MFU target reported as met / missed", flag_values=fv)
  flags.DEFINE_bool("smoke", False, "tiny model on whatever backend (CPU): checks the pipeline",
                    flag_values=fv)
  flags.DEFINE_string("json", None, "also write the result dict to this file", flag_values=fv)


def parse_args(argv: Sequence[str] | None) -> Any:
  return cli_common.parse(argv, define_flags, doc=__doc__, prog="python benchmarks/gpu_mfu.py",
                          config=DEFAULT_CONFIG)


def _is_oom(e: BaseException) -> bool:
  text = f"{type(e).__name__}: {e}"
  return any(s in text for s in ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "OOM"))


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(sys.argv[1:] if argv is None else argv)
  checks: list[tuple[str, bool, str]] = []
  res: dict[str, Any] = {"bench": "gpu_mfu", "smoke": args.smoke, "config": args.config_file}
  try:
    import jax
    backend, devices = jax.default_backend(), jax.devices()
    checks.append(("jax imports", True,
                   f"jax {jax.__version__}, backend {backend}, {devices[0].device_kind}"))
  except Exception as e:  # noqa: BLE001
    checks.append(("jax imports", False, repr(e)))
    return _finish(args, checks, res)
  checks.append(("GPU visible", backend == "gpu" or args.smoke,
                 f"{len(devices)} x {devices[0].device_kind}"
                 + (" (smoke: not required)" if args.smoke else "")))
  from tformer_jax.bench import train as train_bench
  from tformer_jax.train.loop import resolve_model_config
  # the smoke model's fields where the command line sets none, then the command line's overrides
  smoke = {k: v for k, v in SMOKE.items() if k not in args.overrides} if args.smoke else {}
  overrides = {**smoke, **args.overrides}
  try:
    cfg = cli_common.override(args.config, smoke)
    m = resolve_model_config(cfg)
    checks.append(("config validates", True, f"d_model {m.d_model}, {m.num_layers} layers, {m.num_heads}/"
                   f"{m.kv_heads} heads, d_ff {m.ff}, attention {cfg.runtime.attention}, {m.dtype}"))
  except Exception as e:  # noqa: BLE001
    checks.append(("config validates", False, str(e)))
    return _finish(args, checks, res)
  if not all(ok for _, ok, _ in checks):
    return _finish(args, checks, res)

  attempts = [a.split(":") for a in args.attempts.split(",") if a]
  if args.smoke:
    attempts = [["2", "none"]]
  peak_args = (["--peak-n", "256", "--peak-reps", "2", "--peak-dtype", "float32"] if args.smoke
               else ["--peak-n", "8192", "--peak-reps", "3", "--peak-dtype", "bfloat16"])
  steps = (["--steps", "2", "--warmup", "1"] if args.smoke
           else ["--steps", str(args.steps), "--warmup", str(args.warmup)])
  out = None
  tried = []
  for batch, remat in attempts:
    argv_t = [f"--config={args.config_file}", *steps, *peak_args,
              f"--nominal-peak-tflops={args.nominal_tflops}"]
    argv_t += [f"--config.{k}={v}" for k, v in {**overrides, "data.batch_size": batch,
                                                 "model.remat": remat}.items()]
    print(f"--- attempt: batch {batch}, remat {remat}", flush=True)
    try:
      out = train_bench.main(argv_t)
      tried.append({"batch": int(batch), "remat": remat, "ok": True})
      break
    except Exception as e:  # noqa: BLE001
      oom = _is_oom(e)
      tried.append({"batch": int(batch), "remat": remat, "ok": False, "error": str(e).splitlines()[0][:300]})
      print(f"attempt failed ({'out of memory' if oom else 'error'}): {str(e).splitlines()[0][:300]}")
      if not oom:
        traceback.print_exc(limit=4)
        break
  res["attempts"] = tried
  checks.append(("a batch fits and runs", out is not None, json.dumps(tried[-1]) if tried else "no attempts"))
  if out is not None:
    res["result"] = out
    checks.append(("loss finite", bool(math.isfinite(out["final_loss"])), f"{out['final_loss']:.4f}"))
    checks.append(("throughput > 0", out["tokens_per_s"] > 0, f"{out['tokens_per_s']:,.0f} tokens/s"))
  return _finish(args, checks, res)


def _finish(args: Any, checks: list[tuple[str, bool, str]], res: dict[str, Any]) -> int:
  ok = all(c for _, c, _ in checks)
  out = res.get("result")
  smoke = "(SMOKE: tiny model, numbers meaningless) " if args.smoke else ""
  print(f"\n== GPU MFU benchmark {smoke}==")
  print(f"{'check':<24}{'status':<8}detail")
  for name, c, detail in checks:
    print(f"{name:<24}{'ok' if c else 'FAIL':<8}{detail}")
  if out is not None:
    target_met = out["mfu"] >= args.target
    res.update(target=args.target, target_met=target_met)
    rows = [("batch x seq", f"{out['batch']} x {out['seq']}"), ("params", f"{out['params'] / 1e9:.3f} B"),
            ("tokens/s", f"{out['tokens_per_s']:,.0f}"), ("step ms (median)", f"{out['step_ms_median']:.1f}"),
            ("compile s", f"{out['compile_s']:.1f}"), ("FLOPs/step", f"{out['flops_per_step'] / 1e12:.2f} T"),
            ("achieved", f"{out['achieved_gflops'] / 1e3:.1f} TFLOP/s"),
            ("bf16 matmul measured", f"{out['peak_gflops'] / 1e3:.1f} TFLOP/s"),
            ("MFU vs nominal", f"{100 * out['mfu']:.1f}% of {args.nominal_tflops:.0f} TFLOP/s "
                               f"(target {100 * args.target:.0f}%: {'met' if target_met else 'MISSED'})"),
            ("MFU vs measured", f"{100 * out['mfu_measured_peak']:.1f}%"),
            ("final loss", f"{out['final_loss']:.4f}")]
    print()
    for k, v in rows:
      print(f"{k:<24}{v}")
  res["checks"] = [{"name": n, "ok": c, "detail": d} for n, c, d in checks]
  res["ok"] = ok
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(res, indent=2, default=str))
  print(json.dumps(res, default=str))
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
