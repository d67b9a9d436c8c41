"""The GPU check's stages (a-e), each run in its own process (`gpu_check.py ... --run-stage X`): the
commands a stage runs under its deadline, the results and self-checks it writes after each of them, and the
helpers the orchestrator (benchmarks/gpu_check.py) shares with them."""
from __future__ import annotations

import collections
import importlib.util
import json
import os
import pathlib
import resource
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable

from tformer_jax import cli_common
from tformer_jax.config import ModelConfig

REPO = pathlib.Path(__file__).resolve().parents[1]
STAGES = {"a": "training MFU", "b": "PyTorch peer", "c": "generation", "d": "attention speed and memory",
          "e": "attention numerics"}
SMOKE = {"model.vocab_size": 256, "model.d_model": 64, "model.num_layers": 2, "model.num_heads": 4,
         "model.num_kv_heads": 2, "model.d_ff": 128, "model.max_len": 64, "runtime.attention": "xla",
         "data.seq_len": 64}
OOM_MARKERS = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "OutOfMemoryError")


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


def children_cpu() -> float:
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
    t0, cpu0 = time.time(), children_cpu()
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
    out["seconds"], out["cpu_s"] = round(time.time() - t0, 2), round(children_cpu() - cpu0, 2)
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
  stage_a_roofline(st, args, out, remat)


def stage_a_roofline(st: Stage, args: Any, out: dict[str, Any], remat: str) -> None:
  """The roofline prediction of the same step (tformer_jax/aot/roofline.py on this GPU's compiled HLO, the
  peak from a measured bf16 matmul, the bandwidth from a measured copy: benchmarks/roofline_cpu.py
  --predict-only), reported beside the measurement; not a self-check (a prediction may miss)."""
  # smoke: a 32 MiB copy for the bandwidth (its 256 MiB default takes seconds on a CPU, a number meaningless there)
  peak = ["--peak-n", "256", "--peak-dtype", "float32", "--copy-mib", "32"] if args.smoke else \
      ["--peak-n", "8192", "--peak-dtype", "bfloat16"]
  sets = {**overrides(args), "data.batch_size": out["batch"], "model.remat": remat}
  cmd = [*python(), "benchmarks/roofline_cpu.py", "--platform=" + ("cpu" if args.smoke else ""),
         f"--configs={args.config_file}", "--predict-only", *peak, *[f"--set={k}={v}" for k, v in sets.items()]]
  r = st.child("roofline prediction", cmd, "a_roofline.json")
  rows = (r["json"] or {}).get("rows") or []
  if child_error(r) or not rows:
    st.results["roofline"] = {"error": child_error(r) or "no result"}
    return
  row = rows[0]
  measured = out.get("step_ms_median")
  st.results["roofline"] = {k: row.get(k) for k in ("peak_gflops", "copy_gb_per_s", "hlo_gflops", "hlo_gib",
                                                    "compute_ms", "hbm_ms", "predicted_ms", "roofline_ms", "bound")}
  if measured:
    st.results["roofline"].update(measured_ms=measured, ratio_no_overlap=row["predicted_ms"] / measured,
                                  ratio_overlap=row["roofline_ms"] / measured)
  st.save()


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
  """Our decode JSON (`bench decode`) in the comparison's keys; compile_s is the wait for the compiles
  (compile_wall_s: prefill and step loop compile together; their sum where they do not)."""
  return {"impl": "tformer_jax", "mode": "cached", "batch": out["batch"],
          "compile_s": out.get("compile_wall_s", out.get("compile_s")),
          **{k: out.get(k) for k in ("first_call_s", "ttft_ms", "per_token_ms", "tok_s")}}


def layout_tradeoff(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
  """Compile time vs per-token cost of the two decode layouts (runtime.decode_layout), and the tokens
  after which the layout that compiles slower has paid for its compile (None: it never does)."""
  out: dict[str, Any] = {k: {"compile_s": r.get("compile_s"), "per_token_ms": r.get("per_token_ms")}
                         for k, r in rows.items()}
  s, u = rows["scanned"], rows["unrolled"]
  d_compile = (u["compile_s"] or 0) - (s["compile_s"] or 0)
  d_token_s = ((s["per_token_ms"] or 0) - (u["per_token_ms"] or 0)) / 1e3
  slow, fast = ("unrolled", d_token_s) if d_compile >= 0 else ("scanned", -d_token_s)
  out["slower_compile"] = slow
  out["break_even_tokens"] = round(abs(d_compile) / fast) if fast > 0 else None
  return out


def stage_c_layouts(st: Stage, args: Any, b: int, default: dict[str, Any] | None, tail: list[str]) -> None:
  """The decode layout the runtime did not pick, at the first batch: compile vs per-token cost of
  scanned and unrolled decoding on this platform (the measurement runtime.decode_layout's GPU default
  waits for)."""
  if default is None:
    return
  other = "unrolled" if default.get("decode_layout") == "scanned" else "scanned"
  cmd = [*python(), "-m", "tformer_jax.bench", "decode", *config_argv(args), "--dtype=bfloat16", "--batch", str(b),
         *tail, "--scan" if other == "scanned" else "--noscan"]
  r = st.child(f"ours: decode batch {b}, {other} layers", cmd, f"c_decode_{b}_{other}.json")
  err = child_error(r)
  if r["json"] is None or err is not None:
    st.check(f"ours batch {b} decodes {other}", False, err or "no result")
    return
  rows = {default.get("decode_layout", "scanned"): decode_row(default), other: decode_row(r["json"])}
  st.results["layouts"] = layout_tradeoff(rows)
  st.check(f"ours batch {b} decodes {other}", True, f"{rows[other]['tok_s']:,.0f} tok/s")


def stage_c(st: Stage, args: Any) -> None:
  """Our cached generation, then transformers generate (eager, static + compiled), at the same batches;
  then our other decode layout at the first batch (`stage_c_layouts`)."""
  batches = [2] if args.smoke else ints(args.gen_batches, "--gen-batches")
  # smoke: 3 runs, whose medians keep a tiny model's ms/token (total - first token) clear of timing noise
  p, n, runs = (8, 8, 3) if args.smoke else (args.prompt_len, args.new_tokens, args.gen_runs)
  st.results.update(prompt_len=p, new_tokens=n, batches=batches, rows=[])
  tail = ["--prompt-len", str(p), "--new-tokens", str(n), "--runs", str(runs), "--no-recompute"]
  first: dict[str, Any] | None = None
  for b in batches:
    cmd = [*python(), "-m", "tformer_jax.bench", "decode", *config_argv(args), "--dtype=bfloat16", "--batch", str(b),
           *tail]
    r = st.child(f"ours: decode batch {b}", cmd, f"c_decode_{b}.json")
    err = child_error(r)
    if r["json"] is not None and err is None:
      first = r["json"] if first is None else first
      row = decode_row(r["json"])
      st.results["rows"].append(row)
      st.check(f"ours batch {b} generates", (row["tok_s"] or 0) > 0, f"{row['tok_s']:,.0f} tok/s")
    else:
      st.results["rows"].append({"impl": "tformer_jax", "mode": "cached", "batch": b, "error": err or "no result"})
      st.check(f"ours batch {b} generates", False, err or "no result")
  missing = torch_missing()
  if missing:
    st.results["transformers_skipped"] = missing
    stage_c_layouts(st, args, batches[0], first, tail)
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
  stage_c_layouts(st, args, batches[0], first, tail)      # last: a budget overrun loses only this row
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

