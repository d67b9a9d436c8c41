"""One-command GPU check of tformer_jax on one H100/H200 (the Python side of scripts/gpu_check.sh).

  bash scripts/gpu_check.sh [--out DIR] [--stages a,b,c,d,e] [--budgets a=100,c=200] [stage options]
  bash scripts/gpu_check.sh --smoke --out DIR     # the same pipeline, tiny sizes, on CPU (CI runs it)

Stages, each in its own process with its own time budget (seconds on an H200, --budgets to change):
  a  training MFU      ( 85 s) `bench train` on configs/bench/llama_1b_gpu.py (bf16, cuDNN attention): tokens/s,
                       MFU vs the nominal peak (--nominal-tflops) and vs a bf16 8192^3 matmul measured in the run;
                       the --attempts (batch:remat) are tried in order while the previous one ran out of memory
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

import collections
import importlib.util
import json
import math
import os
import pathlib
import resource
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Sequence

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
  sys.path.insert(0, str(REPO))

from absl import flags  # noqa: E402

from tformer_jax import cli_common  # noqa: E402
from tformer_jax.config import ModelConfig  # noqa: E402

DEFAULT_CONFIG = "configs/bench/llama_1b_gpu.py"
STAGES = {"a": "training MFU", "b": "PyTorch peer", "c": "generation", "d": "attention speed and memory",
          "e": "attention numerics"}
BUDGETS = {"a": 85, "b": 130, "c": 155, "d": 55, "e": 25}
SMOKE_BUDGETS = {"a": 120, "b": 120, "c": 180, "d": 120, "e": 120}   # a busy 2-core CPU; typical use is far less
SMOKE = {"model.vocab_size": 256, "model.d_model": 64, "model.num_layers": 2, "model.num_heads": 4,
         "model.num_kv_heads": 2, "model.d_ff": 128, "model.max_len": 64, "runtime.attention": "xla",
         "data.seq_len": 64}
# Figures measured earlier on an H200 (jax 0.11.2, torch 2.11+cu130, transformers 5.17): context in the table.
EARLIER = {"tokens_per_s": "89.3k", "mfu": "51.7%", "mfu_measured_peak": "79% of 646 TFLOP/s",
           "eager": "64.4k", "compile": "81.9k", ("eager", 1): "83", ("eager", 16): "1,239",
           ("static", 1): "326, first call 22 s"}
GRACE_S = 6.0     # after a stage's budget, before its process group is killed (a stage ends its running command
                  # 2 s before its deadline, which takes at most 5 s: SIGTERM, 3 s, SIGKILL, 2 s)
OOM_MARKERS = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "OutOfMemoryError")


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


def ints(text: str, name: str) -> list[int]:
  try:
    out = [int(s) for s in text.split(",") if s.strip()]
  except ValueError:
    out = []
  if not out or min(out) < 1:
    raise cli_common.UsageError(f"{name}: {text!r} is not a comma-separated list of positive integers")
  return out


def is_oom(text: str) -> bool:
  return any(m in text for m in OOM_MARKERS)


def write_json(path: pathlib.Path, obj: Any) -> None:
  """Atomic: a reader (or a kill) never leaves half a file."""
  tmp = path.with_name(path.name + ".tmp")
  tmp.write_text(json.dumps(obj, indent=2, default=str))
  os.replace(tmp, path)


def read_json(path: pathlib.Path) -> Any:
  try:
    return json.loads(path.read_text())
  except (OSError, ValueError):
    return None


def _children_cpu() -> float:
  """CPU seconds (user + system) of every finished, waited-for descendant so far."""
  r = resource.getrusage(resource.RUSAGE_CHILDREN)
  return r.ru_utime + r.ru_stime


def kill_group(p: subprocess.Popen) -> None:
  """SIGTERM the process group of `p` (started with start_new_session), then SIGKILL what remains."""
  for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 2.0)):
    try:
      os.killpg(p.pid, sig)
    except ProcessLookupError:
      return
    try:
      p.wait(timeout=wait)
      return
    except subprocess.TimeoutExpired:
      continue


# ----------------------------------------------------------------------------------------------------------------
# A stage (runs in its own process: `gpu_check.py ... --run-stage X`)


class Stage:
  """One stage's results, checks and child commands; `save()` after each piece of work."""

  def __init__(self, name: str, args: Any):
    self.name, self.args = name, args
    self.work = pathlib.Path(args.out) / "work"
    self.path = self.work / f"stage_{name}.json"
    self.results: dict[str, Any] = {}
    self.checks: list[dict[str, Any]] = []
    self.skipped: str | None = None
    self.status = "running"
    self.child_pid: int | None = None   # the running child's process group, for the orchestrator to kill

  def save(self) -> None:
    write_json(self.path, {"stage": self.name, "title": STAGES[self.name], "status": self.status,
                           "skipped": self.skipped, "results": self.results, "checks": self.checks,
                           "child_pid": self.child_pid})

  def check(self, name: str, ok: bool, detail: str = "") -> bool:
    self.checks.append({"name": name, "ok": bool(ok), "detail": detail})
    print(f"[check {self.name}] {name}: {'ok' if ok else 'FAIL'} {detail}", flush=True)
    self.save()
    return bool(ok)

  def left(self) -> float:
    return self.args.deadline - time.time()

  def child(self, label: str, cmd: list[str], json_name: str | None = None) -> dict[str, Any]:
    """Run `cmd` (its output into this stage's log) until it ends or the stage's deadline (less 2 s) passes.
    Returns {'rc', 'timed_out', 'seconds', 'tail', 'json'} (json: the file the command wrote, if any, read
    even after a timeout: the tools rewrite it after each piece of work)."""
    path = self.work / json_name if json_name else None
    if path is not None:
      path.unlink(missing_ok=True)
      cmd = [*cmd, "--json", str(path)]
    timeout = self.left() - 2.0
    out: dict[str, Any] = {"label": label, "rc": None, "timed_out": False, "seconds": 0.0, "tail": "", "json": None}
    if timeout <= 1.0:
      out.update(timed_out=True, tail="not started: the stage's budget is spent")
      return out
    print(f"\n--- [{self.name}] {label} (up to {timeout:.0f} s): {' '.join(cmd)}", flush=True)
    tail: collections.deque[str] = collections.deque(maxlen=40)
    t0, cpu0 = time.time(), _children_cpu()
    p = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         errors="replace", start_new_session=True)

    def pump() -> None:
      for line in p.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        tail.append(line.rstrip("\n"))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    self.child_pid = p.pid
    self.save()
    try:
      out["rc"] = p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      out["timed_out"] = True
      kill_group(p)
      print(f"--- [{self.name}] {label}: killed after {timeout:.0f} s (the stage's budget)", flush=True)
    reader.join(timeout=5.0)
    self.child_pid = None
    out["seconds"], out["cpu_s"] = round(time.time() - t0, 2), round(_children_cpu() - cpu0, 2)
    out["tail"] = "\n".join(tail)
    print(f"--- [{self.name}] {label}: exit {out['rc']} after {out['seconds']:.1f} s ({out['cpu_s']:.1f} CPU s)",
          flush=True)
    out["json"] = read_json(path) if path is not None else None
    return out


def child_error(r: dict[str, Any]) -> str | None:
  """None when the child ended well; else one line: timeout, exit status and the last meaningful line."""
  if r["timed_out"]:
    return f"ran past the stage's budget ({r['tail'] or 'killed'})" if "not started" in r["tail"] else \
        f"killed after {r['seconds']:.0f} s: ran past the stage's budget"
  if r["rc"]:
    lines = [s for s in r["tail"].splitlines() if s.strip()]
    last = next((s for s in reversed(lines) if s.startswith("error:") or "Error" in s), lines[-1] if lines else "")
    return f"exit status {r['rc']}: {last.strip()[:300]}"
  return None


def python() -> list[str]:
  return [sys.executable]


def overrides(args: Any) -> dict[str, Any]:
  """Config overrides for the model stages: the smoke model's fields (unless the command line sets them), then
  the command line's."""
  smoke = {k: v for k, v in SMOKE.items() if k not in args.overrides} if args.smoke else {}
  return {**smoke, **args.overrides}


def config_argv(args: Any, extra: dict[str, Any] | None = None) -> list[str]:
  sets = {**overrides(args), **(extra or {})}
  return [f"--config={args.config_file}"] + [f"--config.{k}={v}" for k, v in sets.items()]


def model_config(args: Any) -> tuple[Any, ModelConfig]:
  cfg = cli_common.override(cli_common.load_config(args.config_file), overrides(args))
  return cfg, ModelConfig.from_config(cfg.model)


def torch_missing() -> str | None:
  missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
  return f"{' and '.join(missing)} not importable" if missing else None


def stage_a(st: Stage, args: Any) -> None:
  """Training MFU, retrying smaller choices after an out-of-memory failure."""
  attempts = [(2, "none")] if args.smoke else args.attempt_list
  steps = ["--steps", "2", "--warmup", "1"] if args.smoke else \
      ["--steps", str(args.steps), "--warmup", str(args.warmup)]
  peak = (["--peak-n", "256", "--peak-reps", "2", "--peak-dtype", "float32"] if args.smoke else
          ["--peak-n", "8192", "--peak-reps", "3", "--peak-dtype", "bfloat16"])
  st.results["attempts"] = []
  out = None
  for batch, remat in attempts:
    cmd = [*python(), "-m", "tformer_jax.bench", "train", *steps, *peak, "--chunks", "2",
           f"--nominal-peak-tflops={args.nominal_tflops}",
           *config_argv(args, {"data.batch_size": batch, "model.remat": remat})]
    r = st.child(f"train batch {batch} remat {remat}", cmd, f"a_train_{batch}_{remat}.json")
    err = child_error(r)
    oom = bool(err) and is_oom(r["tail"])
    st.results["attempts"].append({"batch": batch, "remat": remat, "ok": err is None and r["json"] is not None,
                                   "seconds": r["seconds"], "error": ("out of memory: " if oom else "") + (err or "")
                                   if err else None})
    st.save()
    if err is None and r["json"] is not None:
      out = r["json"]
      break
    if not oom:
      break
  if out is None:
    st.check("a batch fits and runs", False, json.dumps(st.results["attempts"][-1]))
    return
  st.results["train"] = out
  remat = st.results["attempts"][-1]["remat"]
  st.check("a batch fits and runs", True, f"batch {out['batch']} x {out['seq']}, remat {remat}")
  backend = out.get("machine", {}).get("backend")
  st.check("GPU visible", backend == "gpu" or args.smoke,
           f"{backend} ({out.get('machine', {}).get('device')})" + (" (smoke: not required)" if args.smoke else ""))
  st.check("loss finite", bool(out.get("loss_finite")), f"{out.get('final_loss')}")
  st.check("throughput > 0", out.get("tokens_per_s", 0) > 0, f"{out.get('tokens_per_s', 0):,.0f} tokens/s")


def stage_b(st: Stage, args: Any) -> None:
  """transformers LlamaForCausalLM, eager and torch.compile, at the batch stage a ran."""
  missing = torch_missing()
  if missing:
    st.skipped = missing
    return
  a = read_json(st.work / "stage_a.json") or {}
  train = a.get("results", {}).get("train")
  cfg, _ = model_config(args)
  batch = train["batch"] if train else (2 if args.smoke else args.attempt_list[0][0])
  smoke = ["--device", "cpu", "--compile-backend", "eager", "--steps", "2", "--warmup", "1"] if args.smoke else \
      ["--steps", str(args.torch_steps), "--warmup", str(args.torch_warmup)]
  cmd = [*python(), str(REPO / "benchmarks" / "torch_llama.py"), "--mode", "both", "--batch", str(batch), *smoke,
         *config_argv(args)]
  r = st.child(f"torch_llama eager + compile, batch {batch}", cmd, "b_torch_llama.json")
  out = r["json"]
  st.results["torch"] = out
  st.results["batch"] = batch
  st.save()
  err = child_error(r)
  if out is None:
    st.check("torch_llama ran", False, err or "no result")
    return
  for mode in ("eager", "compile"):
    m = out.get(mode)
    if m is None:
      st.check(f"torch {mode} ran", False, err or "no result")
    elif "error" in m:
      st.check(f"torch {mode} ran", False, m["error"])
    else:
      st.check(f"torch {mode} loss finite", bool(m["loss_finite"]), f"{m['final_loss']:.4f}")
  if train and train.get("batch") == out.get("batch"):
    same = train["flops_per_step"] == out["flops_per_step"]
    st.check("same FLOPs/step as ours", same,
             f"torch {out['flops_per_step']:.4e} vs ours {train['flops_per_step']:.4e}")


def decode_row(out: dict[str, Any]) -> dict[str, Any]:
  """Our decode JSON in the comparison's keys (older `bench decode` keys as a fallback)."""
  get = lambda new, old: out.get(new, out.get(old))  # noqa: E731
  row = {"impl": "tformer_jax", "mode": "cached", "batch": out["batch"],
         "compile_s": get("compile_s", "cached_compile_s"), "first_call_s": out.get("first_call_s"),
         "ttft_ms": get("ttft_ms", "prefill_ms"),
         "per_token_ms": get("per_token_ms", "cached_per_token_ms"), "tok_s": get("tok_s", "cached_tok_s")}
  if "tok_s" not in out:
    row["keys"] = "fallback: bench decode without compile_s/first_call_s/ttft_ms (ttft = prefill)"
  return row


def stage_c(st: Stage, args: Any) -> None:
  """Our cached generation, then transformers generate (eager, static + compiled), at the same batches."""
  batches = [2] if args.smoke else ints(args.gen_batches, "--gen-batches")
  p, n, runs = (8, 8, 1) if args.smoke else (args.prompt_len, args.new_tokens, args.gen_runs)
  st.results.update(prompt_len=p, new_tokens=n, batches=batches, rows=[])
  for b in batches:
    cmd = [*python(), "-m", "tformer_jax.bench", "decode", *config_argv(args), "--dtype=bfloat16", "--batch", str(b),
           "--prompt-len", str(p), "--new-tokens", str(n), "--runs", str(runs), "--no-recompute"]
    r = st.child(f"ours: decode batch {b}", cmd, f"c_decode_{b}.json")
    err = child_error(r)
    if r["json"] is not None and err is None:
      row = decode_row(r["json"])
      st.results["rows"].append(row)
      st.check(f"ours batch {b} generates", (row["tok_s"] or 0) > 0, f"{row['tok_s']:,.0f} tok/s")
    else:
      st.results["rows"].append({"impl": "tformer_jax", "mode": "cached", "batch": b, "error": err or "no result"})
      st.check(f"ours batch {b} generates", False, err or "no result")
  missing = torch_missing()
  if missing:
    st.results["transformers_skipped"] = missing
    st.save()
    return
  cases = [(mode, b) for mode in ("eager", "static") for b in batches]
  cmd = [*python(), str(REPO / "benchmarks" / "torch_generate.py"), *config_argv(args),
         "--cases", ",".join(f"{m}:{b}" for m, b in cases), "--prompt-len", str(p), "--new-tokens", str(n),
         "--runs", str(runs)] + (["--device", "cpu", "--cpu-compile-backend", "eager"] if args.smoke else [])
  r = st.child("transformers generate: " + ", ".join(f"{m} batch {b}" for m, b in cases), cmd, "c_generate.json")
  err = child_error(r)
  got = {(x["mode"], x["batch"]): x for x in (r["json"] or {}).get("results", [])}
  st.results["transformers"] = {k: v for k, v in (r["json"] or {}).items() if k != "results"}
  for mode, b in cases:
    x = got.get((mode, b))
    if x is None:
      st.results["rows"].append({"impl": "transformers", "mode": mode, "batch": b, "error": err or "not run"})
      st.check(f"transformers {mode} batch {b} generates", False, err or "not run")
    else:
      st.results["rows"].append({"impl": "transformers", **x})
      st.check(f"transformers {mode} batch {b} generates", "error" not in x and x.get("tokens_ok", False),
               x.get("error", f"{x.get('tok_s', 0):,.0f} tok/s"))
  st.save()


def attention_shape(args: Any) -> list[str]:
  cfg, m = model_config(args)
  return ["--batch", "1", "--heads", str(m.num_heads), "--kv-heads", str(m.kv_heads), "--head-dim", str(m.hd),
          "--dtype", "bfloat16", "--block-q", str(cfg.runtime.attention_block_q),
          "--block-k", str(cfg.runtime.attention_block_k)]


def stage_d(st: Stage, args: Any) -> None:
  """One attention layer fwd+bwd per impl and length: time, compiled and device peak memory."""
  seqs = [64, 128] if args.smoke else ints(args.attn_seqs, "--attn-seqs")
  impls = [s.strip() for s in args.attn_impls.split(",") if s.strip()]
  shape = attention_shape(args)
  common = ["--seq", ",".join(map(str, sorted(seqs))), "--repeats", "2" if args.smoke else "5",
            "--time-budget-s", "5", "--max-timed-temp-gb", str(args.attn_max_temp_gb), *shape]
  st.results.update(seqs=seqs, impls=impls, rows=[])
  # One process per impl on a device (its peak memory is per process and cannot be reset); on CPU there is
  # no device peak, so the smoke run uses one process.
  groups = [impls] if args.smoke else [[i] for i in impls]
  for group in groups:
    cmd = [*python(), "-m", "tformer_jax.bench", "attention", "--impls", ",".join(group), *common]
    r = st.child(f"attention {','.join(group)}", cmd, f"d_attention_{'_'.join(group)}.json")
    err = child_error(r)
    rows = (r["json"] or {}).get("results", [])
    st.results["rows"] += rows
    done = {(x["impl"], x["seq"]) for x in rows}
    for impl in group:
      for s in seqs:
        if (impl, s) not in done:
          st.results["rows"].append({"impl": impl, "seq": s, "error": err or "no result"})
    st.save()
  bad = [f"{x['impl']}@{x['seq']}: {x['error']}" for x in st.results["rows"]
         if x.get("error") and not is_oom(x["error"])]
  st.check("every case ran, or was skipped / out of memory with a reason", not bad, "; ".join(bad)[:500])


def stage_e(st: Stage, args: Any) -> None:
  """Every attention implementation in bf16 against the float32 reference."""
  seq = 128 if args.smoke else args.accuracy_seq
  impls = [s.strip() for s in args.accuracy_impls.split(",") if s.strip()]
  cmd = [*python(), "-m", "tformer_jax.bench", "attention", "--accuracy", "--impls", ",".join(impls),
         "--seq", str(seq), *attention_shape(args)]
  r = st.child(f"attention accuracy {','.join(impls)}", cmd, "e_accuracy.json")
  out = r["json"] or {}
  rows = out.get("accuracy", [])
  st.results.update(seq=seq, rows=rows)
  st.save()
  err = child_error(r)
  if err or not rows:
    st.check("accuracy run", False, err or "no result")
    return
  for x in rows:
    if x.get("skipped"):
      st.check(f"{x['impl']} within tolerance", x["impl"] == "cudnn" and args.smoke, f"skipped: {x['skipped']}")
    else:
      errs = {k: x[f"{k}_rel_err"] for k in ("out", "dq", "dk", "dv")} if not x.get("error") else {}
      detail = x["error"] if x.get("error") else ", ".join(f"{k} {v:.2e}" for k, v in errs.items()) + \
          f" (tol {x['tolerance']:g} / grads {x['grad_tolerance']:g})"
      st.check(f"{x['impl']} within tolerance", bool(x.get("ok")), detail)


STAGE_FNS: dict[str, Callable[[Stage, Any], None]] = {"a": stage_a, "b": stage_b, "c": stage_c, "d": stage_d,
                                                        "e": stage_e}


def run_stage(args: Any) -> int:
  st = Stage(args.run_stage, args)
  st.save()
  STAGE_FNS[args.run_stage](st, args)
  if args.inject and args.inject[0] == st.name:
    if args.inject[1] == "raise":
      raise RuntimeError(f"injected failure in stage {st.name} (--inject-failure)")
    print(f"[{st.name}] injected hang (--inject-failure): sleeping until the budget ends", flush=True)
    while True:
      time.sleep(60)
  st.status = "skipped" if st.skipped else ("ok" if all(c["ok"] for c in st.checks) else "failed")
  st.save()
  return 0


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
  t0, cpu0 = time.time(), _children_cpu()
  p = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
  timed_out = False
  try:
    rc = p.wait(timeout=budget + GRACE_S)
  except subprocess.TimeoutExpired:
    timed_out = True
    kill_group(p)
    rc = p.returncode
  seconds, cpu_s = round(time.time() - t0, 2), round(_children_cpu() - cpu0, 2)
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


# ----------------------------------------------------------------------------------------------------------------
# Summary: ratios, targets, the self-check verdict


def _ok_row(x: dict[str, Any] | None) -> bool:
  return bool(x) and "error" not in x and x.get("tok_s") is not None


def summarize(res: dict[str, Any], args: Any) -> dict[str, Any]:
  st = res["stages"]
  results = lambda k: (st.get(k) or {}).get("results") or {}  # noqa: E731
  summary: dict[str, Any] = {}
  targets: list[dict[str, Any]] = []

  def target(name: str, value: float | None, want: str, met: bool | None) -> None:
    targets.append({"name": name, "value": value, "target": want, "met": met})

  train = results("a").get("train")
  if train:
    summary["train"] = {k: train.get(k) for k in ("batch", "seq", "tokens_per_s", "mfu", "mfu_measured_peak",
                                                  "achieved_gflops", "peak_gflops", "flops_per_step", "compile_s",
                                                  "step_ms_median", "final_loss", "params")}
  target(f"MFU >= {args.mfu_target:.0%} of {args.nominal_tflops:.0f} TFLOP/s", train and train.get("mfu"),
         f">= {args.mfu_target}", None if not train else train["mfu"] >= args.mfu_target)
  torch_out = results("b").get("torch") or {}
  ratios = {}
  for mode in ("eager", "compile"):
    m = torch_out.get(mode) or {}
    if train and m.get("tokens_per_s"):
      ratios[f"ours_vs_torch_{mode}"] = round(train["tokens_per_s"] / m["tokens_per_s"], 3)
  if ratios:
    summary["torch_ratios"] = ratios
  r = ratios.get("ours_vs_torch_compile")
  target(f"tokens/s >= {args.torch_target}x torch.compile", r, f">= {args.torch_target}",
         None if r is None else r >= args.torch_target)

  rows = results("c").get("rows") or []
  by = {(x["impl"], x.get("mode"), x["batch"]): x for x in rows}
  batches = results("c").get("batches") or []
  gen: dict[str, Any] = {}
  if batches:
    lo, hi = min(batches), max(batches)
    ours_lo, ours_hi = by.get(("tformer_jax", "cached", lo)), by.get(("tformer_jax", "cached", hi))
    static_lo, eager_hi = by.get(("transformers", "static", lo)), by.get(("transformers", "eager", hi))
    for name, x, y in ((f"ours_vs_static_batch{lo}", ours_lo, static_lo),
                       (f"ours_vs_eager_batch{hi}", ours_hi, eager_hi)):
      gen[name] = round(x["tok_s"] / y["tok_s"], 3) if _ok_row(x) and _ok_row(y) and y["tok_s"] else None
    summary["generation_ratios"] = gen
    v = gen[f"ours_vs_static_batch{lo}"]
    target(f"generation batch {lo}: tok/s >= transformers static compiled", v, ">= 1", None if v is None else v >= 1)
    fc = ours_lo.get("first_call_s") if _ok_row(ours_lo) else None
    target(f"generation batch {lo}: first call <= {args.first_call_target_s:g} s", fc,
           f"<= {args.first_call_target_s:g}", None if fc is None else fc <= args.first_call_target_s)
    v = gen[f"ours_vs_eager_batch{hi}"]
    target(f"generation batch {hi}: tok/s >= {args.gen_batch_target:g}x transformers eager", v,
           f">= {args.gen_batch_target:g}", None if v is None else v >= args.gen_batch_target)

  failed = []
  for k, rec in st.items():
    if rec.get("status") not in ("ok", "skipped"):
      why = rec.get("error") or "; ".join(c["name"] for c in rec.get("checks", []) if not c["ok"]) or rec.get("status")
      failed.append(f"{k}: {rec.get('status')}: {why.splitlines()[0] if why else ''}")
  done = all(rec.get("status") != "not_run" for rec in st.values())
  return {"summary": summary, "targets": targets, "failed_checks": failed, "checks_ok": done and not failed}


# ----------------------------------------------------------------------------------------------------------------
# The table


def _f(x: Any, fmt: str, none: str = "-") -> str:
  if x is None or (isinstance(x, float) and not math.isfinite(x)):
    return none
  return format(x, fmt)


def _mib(x: Any) -> str:
  return _f(None if x is None else x / 2 ** 20, ",.0f")


def render(res: dict[str, Any], args: Any) -> str:
  st = res["stages"]
  results = lambda k: (st.get(k) or {}).get("results") or {}  # noqa: E731
  smoke = args.smoke
  earlier = (lambda s: "") if smoke else (lambda s: f"   (earlier H200: {s})")
  out = [f"== tformer_jax GPU check{' (SMOKE: tiny model on CPU, numbers meaningless)' if smoke else ''} ==  "
         f"{res['started']}, {res.get('wall_s', 0):.0f} s",
         f"{'stage':<30}{'status':<10}{'seconds':>9}{'budget':>8}  note"]
  for k, rec in st.items():
    note = rec.get("skipped") or (rec.get("error") or "").split("\n")[0]
    out.append(f"{k + ' ' + STAGES[k]:<30}{rec.get('status', ''):<10}{_f(rec.get('seconds'), '.1f'):>9}"
               f"{_f(rec.get('budget_s'), '.0f'):>8}  {note[:90]}")
  train = results("a").get("train")
  if "a" in st:
    out.append("\n(a) training: " + (f"{res['config']}, batch {train['batch']} x {train['seq']}, "
                                      f"{(train.get('runtime') or {}).get('attention')} attention, {train.get('dtype')}"
                                      if train else "no result"))
    if train:
      out += [f"  {'tokens/s':<26}{train['tokens_per_s']:>12,.0f}" + earlier(EARLIER["tokens_per_s"]),
              f"  {'step ms (median)':<26}{train['step_ms_median']:>12.1f}   compile {train['compile_s']:.1f} s",
              f"  {'MFU vs nominal':<26}{100 * train['mfu']:>11.1f}%   of {args.nominal_tflops:.0f} TFLOP/s"
              + earlier(EARLIER["mfu"]),
              f"  {'MFU vs measured matmul':<26}{100 * train['mfu_measured_peak']:>11.1f}%   "
              f"matmul {train['peak_gflops'] / 1e3:.1f} TFLOP/s ({train.get('peak_dtype')})"
              + earlier(EARLIER["mfu_measured_peak"])]
  torch_out = results("b").get("torch")
  if "b" in st:
    out.append("\n(b) PyTorch peer (transformers LlamaForCausalLM, SDPA, bf16 autocast, fused AdamW)"
               + (f", batch {torch_out['batch']} x {torch_out['seq']}" if torch_out else
                  f": {st['b'].get('skipped') or 'no result'}"))
    ratios = (res.get("summary") or {}).get("torch_ratios", {})
    for mode, label in (("eager", "eager"), ("compile", "torch.compile")):
      m = (torch_out or {}).get(mode)
      if m is None:
        continue
      if "error" in m:
        out.append(f"  {label:<26}ERROR: {m['error'][:90]}")
        continue
      r = ratios.get(f"ours_vs_torch_{mode}")
      out.append(f"  {label:<26}{m['tokens_per_s']:>12,.0f} tok/s   first step {m['first_step_s']:.1f} s   "
                 f"ours / torch {_f(r, '.2f')}x" + earlier(EARLIER[mode]))
  if "c" in st:
    c = results("c")
    out.append(f"\n(c) generation, greedy, bf16, prompt {c.get('prompt_len')} + {c.get('new_tokens')} new tokens")
    out.append(f"  {'impl':<28}{'batch':>6}{'compile s':>11}{'first call s':>14}{'ttft ms':>10}{'ms/token':>10}"
               f"{'tok/s':>11}")
    for x in c.get("rows", []):
      name = "tformer_jax" if x["impl"] == "tformer_jax" else \
          f"transformers {'eager' if x.get('mode') == 'eager' else 'static+compile'}"
      if "error" in x:
        out.append(f"  {name:<28}{x['batch']:>6}  ERROR: {x['error'][:80]}")
        continue
      prev = EARLIER.get((x.get("mode"), x["batch"])) if x["impl"] == "transformers" else None
      out.append(f"  {name:<28}{x['batch']:>6}{_f(x.get('compile_s'), '.1f'):>11}"
                 f"{_f(x.get('first_call_s'), '.1f'):>14}{_f(x.get('ttft_ms'), '.1f'):>10}"
                 f"{_f(x.get('per_token_ms'), '.2f'):>10}{_f(x.get('tok_s'), ',.0f'):>11}"
                 + ("" if smoke or prev is None else f"   (earlier H200: {prev})"))
    if c.get("transformers_skipped"):
      out.append(f"  transformers: skipped ({c['transformers_skipped']})")
  if "d" in st:
    d = results("d")
    out.append("\n(d) attention, one causal layer fwd+bwd, bf16, batch 1")
    out.append(f"  {'impl':<12}{'seq':>7}{'time ms':>10}{'compiled peak MiB':>19}{'device peak MiB':>17}  note")
    for x in d.get("rows", []):
      note = x.get("error") or x.get("skipped") or ""
      ms = None if x.get("time_s") is None else 1e3 * x["time_s"]
      out.append(f"  {x['impl']:<12}{x['seq']:>7}{_f(ms, '.2f'):>10}"
                 f"{_mib(x.get('peak_bytes')):>19}{_mib(x.get('device_peak_bytes')):>17}  {note[:70]}")
  if "e" in st:
    e = results("e")
    out.append(f"\n(e) attention numerics in bf16 vs the float32 reference, seq {e.get('seq')} "
               "(relative error, ||x - ref|| / ||ref||)")
    out.append(f"  {'impl':<15}{'out':>10}{'dq':>10}{'dk':>10}{'dv':>10}{'tol (out/grad)':>16}  verdict")
    for x in e.get("rows", []):
      name = x["impl"] + (f"->{x['resolved']}" if x.get("resolved") else "")
      if x.get("skipped") or x.get("error"):
        out.append(f"  {name:<15}  {'skipped: ' + x['skipped'] if x.get('skipped') else 'ERROR: ' + x['error']}"[:120])
        continue
      out.append(f"  {name:<15}" + "".join(f"{x[f'{k}_rel_err']:>10.2e}" for k in ("out", "dq", "dk", "dv"))
                 + f"{x['tolerance']:>8g} /{x['grad_tolerance']:<6g}  {'ok' if x['ok'] else 'ABOVE TOLERANCE'}")
  out.append("\ntargets (reported, never a failure):")
  for t in res.get("targets", []):
    verdict = "not measured" if t["met"] is None else ("met" if t["met"] else "MISSED")
    out.append(f"  {t['name']:<58}{_f(t['value'], '.3f'):>10}  {verdict}")
  out.append("\nself-checks: " + ("all passed" if res.get("checks_ok") else "FAILED"))
  out += [f"  {s[:150]}" for s in res.get("failed_checks", [])]
  out.append(f"JSON: {pathlib.Path(args.out) / 'gpu_check.json'}")
  return "\n".join(out)


if __name__ == "__main__":
  sys.exit(cli_common.run_main(main))
