"""The GPU check's summary (ratios, targets, the self-check verdict) and its table. Figures measured on
earlier runs live in docs/benchmarks.md, not here."""
from __future__ import annotations

import math
import pathlib
from typing import Any

from gpu_check_stages import STAGES


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
    if results("a").get("roofline"):
      summary["roofline"] = results("a")["roofline"]
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



def _f(x: Any, fmt: str, none: str = "-") -> str:
  if x is None or (isinstance(x, float) and not math.isfinite(x)):
    return none
  return format(x, fmt)


def _mib(x: Any) -> str:
  return _f(None if x is None else x / 2 ** 20, ",.0f")


def _train_lines(res: dict[str, Any], train: dict[str, Any] | None, args: Any) -> list[str]:
  out = ["\n(a) training: " + (f"{res['config']}, batch {train['batch']} x {train['seq']}, "
                               f"{(train.get('runtime') or {}).get('attention')} attention, {train.get('dtype')}"
                               if train else "no result")]
  if train:
    out += [f"  {'tokens/s':<26}{train['tokens_per_s']:>12,.0f}",
            f"  {'step ms (median)':<26}{train['step_ms_median']:>12.1f}   compile {train['compile_s']:.1f} s",
            f"  {'MFU vs nominal':<26}{100 * train['mfu']:>11.1f}%   of {args.nominal_tflops:.0f} TFLOP/s",
            f"  {'MFU vs measured matmul':<26}{100 * train['mfu_measured_peak']:>11.1f}%   "
            f"matmul {train['peak_gflops'] / 1e3:.1f} TFLOP/s ({train.get('peak_dtype')})"]
  rf = ((res["stages"].get("a") or {}).get("results") or {}).get("roofline")
  if rf and "error" not in rf:
    out += [f"  {'roofline predicted step':<26}{rf['predicted_ms']:>12.1f}   no overlap (compute {rf['compute_ms']:.1f}"
            f" + HBM {rf['hbm_ms']:.1f} ms); each op at its bound {rf['roofline_ms']:.1f} ms; bound {rf['bound']}",
            f"  {'  predicted / measured':<26}{_f(rf.get('ratio_no_overlap'), '.2f'):>12}   (at its bound: "
            f"{_f(rf.get('ratio_overlap'), '.2f')}; matmul {rf['peak_gflops'] / 1e3:.1f} TFLOP/s, copy "
            f"{rf['copy_gb_per_s']:.0f} GB/s measured)"]
  elif rf:
    out.append(f"  {'roofline predicted step':<26}{'?':>12}   {rf['error']}")
  return out


def _torch_lines(res: dict[str, Any], torch_out: dict[str, Any] | None, skipped: str | None) -> list[str]:
  out = ["\n(b) PyTorch peer (transformers LlamaForCausalLM, SDPA, bf16 autocast, fused AdamW)"
         + (f", batch {torch_out['batch']} x {torch_out['seq']}" if torch_out else f": {skipped or 'no result'}")]
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
               f"ours / torch {_f(r, '.2f')}x")
  return out


def _generation_lines(c: dict[str, Any]) -> list[str]:
  out = [f"\n(c) generation, greedy, bf16, prompt {c.get('prompt_len')} + {c.get('new_tokens')} new tokens",
         f"  {'impl':<28}{'batch':>6}{'compile s':>11}{'first call s':>14}{'ttft ms':>10}{'ms/token':>10}{'tok/s':>11}"]
  for x in c.get("rows", []):
    name = "tformer_jax" if x["impl"] == "tformer_jax" else \
        f"transformers {'eager' if x.get('mode') == 'eager' else 'static+compile'}"
    if "error" in x:
      out.append(f"  {name:<28}{x['batch']:>6}  ERROR: {x['error'][:80]}")
      continue
    out.append(f"  {name:<28}{x['batch']:>6}{_f(x.get('compile_s'), '.1f'):>11}"
               f"{_f(x.get('first_call_s'), '.1f'):>14}{_f(x.get('ttft_ms'), '.1f'):>10}"
               f"{_f(x.get('per_token_ms'), '.2f'):>10}{_f(x.get('tok_s'), ',.0f'):>11}")
  if c.get("transformers_skipped"):
    out.append(f"  transformers: skipped ({c['transformers_skipped']})")
  lay = c.get("layouts")
  if lay:
    pays = lay["break_even_tokens"]
    out.append("  decode layout (runtime.decode_layout): " + "; ".join(
        f"{k} compile {_f(lay[k]['compile_s'], '.1f')} s, {_f(lay[k]['per_token_ms'], '.2f')} ms/token"
        for k in ("scanned", "unrolled")) + f"; {lay['slower_compile']} compiles slower and "
        + (f"pays it back after {pays:,} tokens" if pays is not None else "never pays it back"))
  return out


def _attention_lines(d: dict[str, Any]) -> list[str]:
  out = ["\n(d) attention, one causal layer fwd+bwd, bf16, batch 1",
         f"  {'impl':<12}{'seq':>7}{'time ms':>10}{'compiled peak MiB':>19}{'device peak MiB':>17}  note"]
  for x in d.get("rows", []):
    note = x.get("error") or x.get("skipped") or ""
    ms = None if x.get("time_s") is None else 1e3 * x["time_s"]
    out.append(f"  {x['impl']:<12}{x['seq']:>7}{_f(ms, '.2f'):>10}"
               f"{_mib(x.get('peak_bytes')):>19}{_mib(x.get('device_peak_bytes')):>17}  {note[:70]}")
  return out


def _numerics_lines(e: dict[str, Any]) -> list[str]:
  out = [f"\n(e) attention numerics in bf16 vs the float32 reference, seq {e.get('seq')} "
         "(relative error, ||x - ref|| / ||ref||)",
         f"  {'impl':<15}{'out':>10}{'dq':>10}{'dk':>10}{'dv':>10}{'tol (out/grad)':>16}  verdict"]
  for x in e.get("rows", []):
    name = x["impl"] + (f"->{x['resolved']}" if x.get("resolved") else "")
    if x.get("skipped") or x.get("error"):
      out.append(f"  {name:<15}  {'skipped: ' + x['skipped'] if x.get('skipped') else 'ERROR: ' + x['error']}"[:120])
      continue
    out.append(f"  {name:<15}" + "".join(f"{x[f'{k}_rel_err']:>10.2e}" for k in ("out", "dq", "dk", "dv"))
               + f"{x['tolerance']:>8g} /{x['grad_tolerance']:<6g}  {'ok' if x['ok'] else 'ABOVE TOLERANCE'}")
  return out


def render(res: dict[str, Any], args: Any) -> str:
  st = res["stages"]
  results = lambda k: (st.get(k) or {}).get("results") or {}  # noqa: E731
  smoke = args.smoke
  out = [f"== tformer_jax GPU check{' (SMOKE: tiny model on CPU, numbers meaningless)' if smoke else ''} ==  "
         f"{res['started']}, {res.get('wall_s', 0):.0f} s",
         f"{'stage':<30}{'status':<10}{'seconds':>9}{'budget':>8}  note"]
  for k, rec in st.items():
    note = rec.get("skipped") or (rec.get("error") or "").split("\n")[0]
    out.append(f"{k + ' ' + STAGES[k]:<30}{rec.get('status', ''):<10}{_f(rec.get('seconds'), '.1f'):>9}"
               f"{_f(rec.get('budget_s'), '.0f'):>8}  {note[:90]}")
  sections = {"a": lambda: _train_lines(res, results("a").get("train"), args),
              "b": lambda: _torch_lines(res, results("b").get("torch"), st["b"].get("skipped")),
              "c": lambda: _generation_lines(results("c")), "d": lambda: _attention_lines(results("d")),
              "e": lambda: _numerics_lines(results("e"))}
  for k, lines in sections.items():
    if k in st:
      out += lines()
  out.append("\ntargets (reported, never a failure):")
  for t in res.get("targets", []):
    verdict = "not measured" if t["met"] is None else ("met" if t["met"] else "MISSED")
    out.append(f"  {t['name']:<58}{_f(t['value'], '.3f'):>10}  {verdict}")
  out.append("\nself-checks: " + ("all passed" if res.get("checks_ok") else "FAILED"))
  out += [f"  {s[:150]}" for s in res.get("failed_checks", [])]
  out.append(f"JSON: {pathlib.Path(args.out) / 'gpu_check.json'}" + ("" if smoke else "; earlier runs' figures: "
                                                                     "docs/benchmarks.md"))
  return "\n".join(out)
