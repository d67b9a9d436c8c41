"""One-command GPU check of tformer_jax on one H100/H200 (the Python side of scripts/gpu_check.sh): this file
runs the stages (benchmarks/gpu_check_stages.py) each in its own process and writes the summary and table
(benchmarks/gpu_check_report.py).

  bash scripts/gpu_check.sh [--out DIR] [--stages a,b,c,d,e] [--budgets a=100,c=200] [stage options]
  bash scripts/gpu_check.sh --smoke --out DIR     # the same pipeline, tiny sizes, on CPU (CI runs it)

Stages, each in its own process with its own time budget (seconds on an H200, --budgets to change):
  a  training MFU      ( 85 s) `bench train` on configs/bench/llama_1b_gpu.py (bf16, cuDNN attention): tokens/s,
                       MFU vs the nominal peak (--nominal-tflops) and vs a bf16 8192^3 matmul measured in the run;
                       the --attempts (batch:remat) are tried in order while the previous one ran out of memory;
                       then, in what is left of the budget, the roofline prediction of the same step beside it
                       (benchmarks/roofline_cpu.py --predict-only: tformer_jax/aot/roofline.py on this GPU's HLO,
                       the peak from a bf16 matmul and the bandwidth from a copy measured there; not a self-check)
  b  PyTorch peer      (130 s) benchmarks/torch_llama.py, eager then torch.compile, the same shape and the batch
                       stage a used: tokens/s, and ours / theirs as ratios
  c  generation        (155 s) `bench decode --dtype=bfloat16` at each --gen-batches, then
                       benchmarks/torch_generate.py (transformers generate: dynamic-cache eager and static-cache
                       compiled) at the same batches: compile s, first call s, time to first token, ms/token, tok/s
  d  attention speed   ( 55 s) `bench attention`: one causal layer fwd+bwd at --attn-seqs for --attn-impls
                       (cudnn, blockwise, xla), the model's head shape, bf16: time, compiled peak memory and the
                       device's peak (one process per impl, lengths ascending, so each case has its own peak)
  e  attention numerics ( 25 s) `bench attention --accuracy`: every implementation in bf16 against the float32
                       reference, output and gradients, relative errors within stated tolerances (a self-check)
The budgets sum to 450 s: with the wheel install, start-up and each stage's few seconds of clean-up after a
timeout, the whole run stays under 8 minutes.
A stage's process writes its results after every child command, and this orchestrator writes DIR/gpu_check.json
after every stage, so a stage that fails or runs past its budget (killed, with its process group) keeps what it
had and records its error tail; later stages run regardless. At the end one table is printed (and written to
DIR/gpu_check.txt); every command's output is in DIR/gpu_check.log.
Exit status: 0 when every self-check passed (a stage skipped for a stated reason, e.g. no torch, passes), 1
otherwise (a failed check, a stage error or timeout); a missed target is reported, never a failure.
--smoke: a tiny model (the SMOKE overrides), tiny lengths and batches, JAX and torch on the CPU, torch.compile
with its 'eager' backend (tracing only: no C++ build), one process for all attention impls.
--inject-failure STAGE:raise|STAGE:hang (tests): the stage raises after its work / hangs until its budget ends.
Config overrides (--config.model.num_layers=4, ...) apply to every stage: a, b and c run that model; d and e take
its head shape (heads, KV heads, head dim) and the runtime's blockwise tiles.
"""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time
from typing import Any, Sequence

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
  sys.path.insert(0, str(REPO))
if str(REPO / "benchmarks") not in sys.path:           # the stages and the report, beside this file
  sys.path.insert(0, str(REPO / "benchmarks"))

from absl import flags  # noqa: E402
from gpu_check_report import render, summarize  # noqa: E402
from gpu_check_stages import (  # noqa: E402
    STAGES,
    children_cpu,
    ints,
    kill_group,
    overrides,
    read_json,
    run_stage,
    write_json,
)

from tformer_jax import cli_common  # noqa: E402

DEFAULT_CONFIG = "configs/bench/llama_1b_gpu.py"
BUDGETS = {"a": 85, "b": 130, "c": 155, "d": 55, "e": 25}
SMOKE_BUDGETS = {"a": 120, "b": 120, "c": 180, "d": 120, "e": 120}   # a busy 2-core CPU; typical use is far less
GRACE_S = 6.0     # after a stage's budget, before its process group is killed (a stage ends its running command
                  # 2 s before its deadline, which takes at most 5 s: SIGTERM, 3 s, SIGKILL, 2 s)


def define_flags(fv: flags.FlagValues) -> None:
  d = lambda kind, name, default, text: getattr(flags, f"DEFINE_{kind}")(name, default, text, flag_values=fv)  # noqa: E731
  d("bool", "smoke", False, "tiny sizes on CPU: checks the pipeline (numbers meaningless)")
  d("string", "out", "runs/gpu_check", "directory for gpu_check.json, gpu_check.txt, gpu_check.log, work/")
  d("string", "stages", "a,b,c,d,e", "stages to run, in order: " + ", ".join(f"{k} {v}" for k, v in STAGES.items()))
  d("string", "budgets", "", "per-stage seconds, e.g. 'a=150,c=200' (defaults: "
    + ", ".join(f"{k}={v}" for k, v in BUDGETS.items()) + "; --smoke: "
    + ", ".join(f"{k}={v}" for k, v in SMOKE_BUDGETS.items()) + ")")
  # a
  d("string", "attempts", "16:none,16:dots,8:dots", "a: batch:remat choices, each tried when the previous ran out "
    "of memory")
  d("integer", "steps", 10, "a: timed steps")
  d("integer", "warmup", 3, "a: untimed steps after compilation")
  d("float", "nominal-tflops", 989.0, "a: datasheet dense bf16 peak (H100/H200 SXM: 989)")
  d("float", "mfu-target", 0.55, "a: MFU target (of the nominal peak), reported as met / missed")
  # b
  d("integer", "torch-steps", 8, "b: timed torch steps per mode")
  d("integer", "torch-warmup", 2, "b: untimed torch steps per mode after the first")
  d("float", "torch-target", 1.25, "b: target for our tokens/s over torch.compile's")
  # c
  d("string", "gen-batches", "1,16", "c: batch sizes")
  d("integer", "prompt-len", 128, "c: prompt tokens per row")
  d("integer", "new-tokens", 256, "c: generated tokens per row")
  d("integer", "gen-runs", 2, "c: warm timed calls per case")
  d("float", "first-call-target-s", 20.0, "c: target for our first generate call at the smallest batch")
  d("float", "gen-batch-target", 2.0, "c: target for our tok/s over transformers eager at the largest batch")
  # d
  d("string", "attn-seqs", "8192,32768", "d: sequence lengths")
  d("string", "attn-impls", "cudnn,blockwise,xla", "d: implementations")
  d("float", "attn-max-temp-gb", 100.0, "d: dense impls whose compiled temporaries exceed this are not run")
  # e
  d("integer", "accuracy-seq", 2048, "e: sequence length")
  d("string", "accuracy-impls", "reference,chunked,blockwise,xla,cudnn,auto", "e: implementations")
  # tests and internals
  d("string", "inject-failure", "", "tests: STAGE:raise (raise after the stage's work) or STAGE:hang (hang "
    "until its budget ends)")
  d("string", "run-stage", "", "internal: run this one stage (the orchestrator's child)")
  d("float", "deadline", 0.0, "internal: the stage's deadline (epoch seconds)")


def parse_args(argv: Sequence[str] | None) -> Any:
  args = cli_common.parse(argv, define_flags, doc=__doc__, prog="bash scripts/gpu_check.sh", config=DEFAULT_CONFIG)
  try:
    args.stage_list = parse_stages(args.stages)
    args.budget = parse_budgets(args.budgets, SMOKE_BUDGETS if args.smoke else BUDGETS)
    args.inject = parse_inject(args.inject_failure)
    args.attempt_list = parse_attempts(args.attempts)
    for name in ("gen-batches", "attn-seqs"):
      ints(getattr(args, name.replace("-", "_")), "--" + name)
  except cli_common.UsageError as e:
    cli_common.fail(str(e))
  return args


def parse_stages(text: str) -> list[str]:
  out = [s.strip() for s in text.split(",") if s.strip()]
  bad = [s for s in out if s not in STAGES]
  if bad or not out:
    raise cli_common.UsageError(f"--stages: {','.join(bad) or 'none given'}: choose from {','.join(STAGES)}")
  return [s for s in STAGES if s in out]


def parse_budgets(text: str, defaults: dict[str, int]) -> dict[str, float]:
  out = {k: float(v) for k, v in defaults.items()}
  for item in (s.strip() for s in text.split(",") if s.strip()):
    k, sep, v = item.partition("=")
    try:
      value = float(v)
    except ValueError:
      value = -1.0
    if k not in STAGES or not sep or not value > 0:
      raise cli_common.UsageError(f"--budgets: {item!r} is not STAGE=SECONDS (stage in {','.join(STAGES)}, "
                                  "seconds > 0)")
    out[k] = value
  return out


def parse_attempts(text: str) -> list[tuple[int, str]]:
  out = []
  for item in (s.strip() for s in text.split(",") if s.strip()):
    b, _, remat = item.partition(":")
    if not b.isdigit() or int(b) < 1 or not remat:
      raise cli_common.UsageError(f"--attempts: {item!r} is not BATCH:REMAT (e.g. 16:none)")
    out.append((int(b), remat))
  if not out:
    raise cli_common.UsageError("--attempts: none given")
  return out


def parse_inject(text: str) -> tuple[str, str] | None:
  if not text:
    return None
  stage, _, how = text.partition(":")
  if stage not in STAGES or how not in ("raise", "hang"):
    raise cli_common.UsageError(f"--inject-failure: {text!r} is not STAGE:raise or STAGE:hang")
  return stage, how



# ----------------------------------------------------------------------------------------------------------------
# The orchestrator


def run_stage_process(name: str, args: Any, argv: list[str], log: Any, env: dict[str, str]) -> dict[str, Any]:
  budget = args.budget[name]
  work = pathlib.Path(args.out) / "work"
  path = work / f"stage_{name}.json"
  path.unlink(missing_ok=True)
  deadline = time.time() + budget
  cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), *argv, f"--run-stage={name}", f"--deadline={deadline}"]
  log.write(f"\n===== stage {name} ({STAGES[name]}), budget {budget:.0f} s =====\n")
  log.flush()
  start = log.tell()
  t0, cpu0 = time.time(), children_cpu()
  p = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
  timed_out = False
  try:
    rc = p.wait(timeout=budget + GRACE_S)
  except subprocess.TimeoutExpired:
    timed_out = True
    kill_group(p)
    rc = p.returncode
  seconds, cpu_s = round(time.time() - t0, 2), round(children_cpu() - cpu0, 2)
  log.flush()
  with open(log.name, errors="replace") as f:
    f.seek(start)
    tail = "\n".join(f.read().splitlines()[-30:])
  rec = read_json(path) or {"stage": name, "title": STAGES[name], "status": "running", "skipped": None,
                           "results": {}, "checks": []}
  orphan = rec.pop("child_pid", None)
  if timed_out and orphan:    # the stage's running child has its own process group: end it too
    try:
      os.killpg(orphan, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
      pass
  rec.update(seconds=seconds, cpu_s=cpu_s, budget_s=budget, exit_code=rc, error=None)
  if timed_out:
    rec["status"] = "timeout"
    rec["error"] = f"ran past its budget of {budget:.0f} s (+{GRACE_S:.0f} s grace) and was killed\n{tail}"
  elif rc != 0 or rec["status"] == "running":
    rec["status"] = "error"
    rec["error"] = f"exit status {rc}\n{tail}"
  return rec


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parse_args(argv)
  if args.run_stage:
    return run_stage(args)
  out = pathlib.Path(args.out)
  (out / "work").mkdir(parents=True, exist_ok=True)
  for old in (out / "work").glob("stage_*.json"):
    old.unlink()
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  if args.smoke:
    env.update(JAX_PLATFORMS="cpu", TFORMER_JAX_ALLOCATOR="system")
  started = time.time()
  res: dict[str, Any] = {"tool": "gpu_check", "smoke": args.smoke, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                         "argv": argv, "config": args.config_file, "overrides": overrides(args),
                         "budgets_s": {k: args.budget[k] for k in args.stage_list},
                         "stages": {k: {"stage": k, "title": STAGES[k], "status": "not_run"} for k in args.stage_list}}
  json_path = out / "gpu_check.json"
  write_json(json_path, res)
  print(f"gpu_check{' (smoke)' if args.smoke else ''}: stages {','.join(args.stage_list)}, budgets "
        + ", ".join(f"{k} {args.budget[k]:.0f} s" for k in args.stage_list) + f"; log {out / 'gpu_check.log'}",
        flush=True)
  with open(out / "gpu_check.log", "w") as log:
    for name in args.stage_list:
      rec = run_stage_process(name, args, argv, log, env)
      res["stages"][name] = rec
      res["wall_s"] = round(time.time() - started, 1)
      res.update(summarize(res, args))
      write_json(json_path, res)
      print(f"stage {name} ({STAGES[name]}): {rec['status']} in {rec['seconds']:.1f} s ({rec['cpu_s']:.1f} CPU s)"
            + (f" (skipped: {rec['skipped']})" if rec.get("skipped") else "")
            + (f": {rec['error'].splitlines()[0]}" if rec.get("error") else ""), flush=True)
  table = render(res, args)
  (out / "gpu_check.txt").write_text(table + "\n")
  print("\n" + table, flush=True)
  return 0 if res["checks_ok"] else 1



if __name__ == "__main__":
  sys.exit(cli_common.run_main(main))
