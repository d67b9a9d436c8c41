"""Attention benchmark: compiled memory and wall time of one causal attention layer, forward + backward;
with --accuracy, every implementation's output and gradients against the float32 reference instead.

  python -m tformer_jax.bench attention --seq 1024,2048,4096,8192,16384 --impls reference,blockwise \
      --block 512 --json OUT.json
  python -m tformer_jax.bench attention --accuracy --impls reference,chunked,blockwise,xla,cudnn,auto \
      --seq 2048 --dtype bfloat16

Implementations: reference (ops.attention, dense causal mask), chunked / chunked_cpu / blockwise (the tiled
exact paths), xla / cudnn (the backend's dense path, `jax.nn.dot_product_attention` with is_causal: what the
model runs with runtime.attention 'xla' / 'cudnn'), auto (what backends.resolve_runtime picks on this
platform for runtime.attention='auto'). cudnn off a GPU is a row skipped with the reason.
Timing: for each impl and length it jits grad(sum(attention(q, k, v))) w.r.t. q, k, v, reads the compiled
memory (`memory_analysis()`: temporaries, arguments, outputs) without running it, then times it (median
of a few runs after a warm-up). Lengths whose temporaries exceed --max-timed-temp-gb are compiled and
reported but not run; a case that fails (out of memory, a kernel that rejects the shape) is a row with its
`error`. On a GPU, device_peak_bytes is the device allocator's peak (memory_stats, inputs included) when it
rose during the case (the peak cannot be reset: run one impl per process with ascending lengths to get one
per case); elsewhere None.
Accuracy (--accuracy): inputs drawn in float32 and rounded to --dtype; the reference is the dense float32
path at 'highest' matmul precision on those same rounded values; for each impl, the output and the q/k/v
gradients of sum(out * g) (g a fixed random cotangent) in --dtype, each as ||x - ref|| / ||ref||, against
--tolerance (output) and --grad-tolerance (gradients).
Prints one human-readable line per case and, last, one JSON line.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from tformer_jax import backends, cli_common, config as config_lib
from tformer_jax.backends.base import Backend, dense_attention
from tformer_jax.ops import masks
from tformer_jax.ops.attention import dot_product_attention
from tformer_jax.ops.blockwise import blockwise_attention
from tformer_jax.ops.chunked_attention import chunked_attention

IMPLS = ("reference", "xla", "cudnn", "blockwise", "chunked", "chunked_cpu", "auto")
GB = 1024 ** 3


def auto_backend(dtype: str) -> Backend:
  """The backend backends.resolve_runtime chooses on this platform for runtime.attention='auto' (a run in
  `dtype`: bfloat16/float16 as train.precision 'bf16'/'fp16')."""
  cfg = config_lib.default_config()
  cfg.runtime.attention = "auto"
  cfg.train.precision = {"bfloat16": "bf16", "float16": "fp16"}.get(dtype, "float32")
  return backends.resolve_runtime(cfg, quiet=True).backend


def unavailable(impl: str) -> str | None:
  """Why `impl` cannot run here (a skipped row), or None."""
  if impl == "cudnn" and jax.default_backend() != "gpu":
    return f"cuDNN needs a GPU; this is {jax.default_backend()}"
  return None


def _attention_fn(impl: str, seq: int, block: int, block_q: int, block_k: int, dtype: str = "float32"
                  ) -> Callable:
  vis = masks.Visibility(causal=True)
  if impl == "blockwise":
    return lambda q, k, v: blockwise_attention(q, k, v, causal=True, block_q=block_q or block,
                                               block_k=block_k or block)
  if impl == "chunked":  # --block-q (else --block) is the query chunk
    return lambda q, k, v: chunked_attention(q, k, v, causal=True, chunk=block_q or block)
  if impl == "chunked_cpu":  # the C++ CPU kernel; same chunking
    return lambda q, k, v: backends.chunked_attention_cpu(q, k, v, causal=True, chunk=block_q or block)
  if impl == "reference":
    return lambda q, k, v: dot_product_attention(q, k, v, mask=masks.causal_mask(seq), impl=impl)
  if impl in ("xla", "cudnn"):    # the backend's dense path: is_causal, no mask tensor
    return lambda q, k, v: dense_attention(q, k, v, vis, impl=impl)[0]
  if impl == "auto":
    backend = auto_backend(dtype)
    return lambda q, k, v: backend.attention(q, k, v, vis)[0]
  raise ValueError(f"unknown impl {impl!r}; expected one of {IMPLS}")


def _memory(compiled: Any) -> dict[str, int | None]:
  ma = compiled.memory_analysis()
  if ma is None:
    return {"temp_bytes": None, "arg_bytes": None, "out_bytes": None, "peak_bytes": None}
  temp, arg, out = (int(getattr(ma, n, 0) or 0) for n in
                    ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes"))
  alias = int(getattr(ma, "alias_size_in_bytes", 0) or 0)
  return {"temp_bytes": temp, "arg_bytes": arg, "out_bytes": out, "peak_bytes": temp + arg + out - alias}


def device_peak() -> int | None:
  """The device allocator's peak bytes in use so far (GPU/TPU), or None where there are no such stats."""
  try:
    stats = jax.devices()[0].memory_stats()
  except Exception:  # noqa: BLE001 - CPU devices may raise or return None
    return None
  return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None


def _shapes(args: Any, seq: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
  kv_heads = args.kv_heads or args.heads
  return (args.batch, seq, args.heads, args.head_dim), (args.batch, seq, kv_heads, args.head_dim)


def _error_text(e: BaseException) -> str:
  return f"{type(e).__name__}: {cli_common.one_line(e)}"[:400]


def run_case(impl: str, seq: int, args: Any) -> dict[str, Any]:
  """Compile (and maybe time) one impl at one length; returns a result row."""
  row: dict[str, Any] = {"impl": impl, "seq": seq, "compile_s": None, "temp_bytes": None, "arg_bytes": None,
                         "out_bytes": None, "peak_bytes": None, "device_peak_bytes": None, "time_s": None,
                         "times_s": [], "skipped": unavailable(impl), "error": None}
  if row["skipped"]:
    return row
  try:
    _run_case(impl, seq, args, row)
  except Exception as e:  # noqa: BLE001 - a failing case (OOM, a rejected shape) is a row, not the end
    row["error"] = _error_text(e)
  return row


def _run_case(impl: str, seq: int, args: Any, row: dict[str, Any]) -> None:
  dtype = jnp.dtype(args.dtype)
  q_shape, kv_shape = _shapes(args, seq)
  attn = _attention_fn(impl, seq, args.block, args.block_q, args.block_k, args.dtype)
  step = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2)))
  t0 = time.perf_counter()
  compiled = step.lower(jax.ShapeDtypeStruct(q_shape, dtype), jax.ShapeDtypeStruct(kv_shape, dtype),
                        jax.ShapeDtypeStruct(kv_shape, dtype)).compile()
  row["compile_s"] = round(time.perf_counter() - t0, 3)
  row.update(_memory(compiled))
  temp = row["temp_bytes"]
  if temp is not None and impl != "blockwise" and temp > args.max_timed_temp_gb * GB:
    row["skipped"] = f"temp {temp / GB:.1f} GB > {args.max_timed_temp_gb} GB"
    return
  if args.repeats <= 0:
    row["skipped"] = "--repeats 0"
    return
  peak_before = device_peak()
  ks = jax.random.split(jax.random.PRNGKey(seq), 3)
  q = jax.random.normal(ks[0], q_shape, dtype)
  k = jax.random.normal(ks[1], kv_shape, dtype)
  v = jax.random.normal(ks[2], kv_shape, dtype)
  t0 = time.perf_counter()
  jax.block_until_ready(compiled(q, k, v))  # warm-up
  warm = time.perf_counter() - t0
  repeats = max(1, min(args.repeats, int(args.time_budget_s / max(warm, 1e-6))))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(q, k, v))
    times.append(time.perf_counter() - t0)
  row["times_s"] = [round(t, 5) for t in times]
  row["time_s"] = round(statistics.median(times), 5)
  peak_after = device_peak()
  if peak_after is not None and (peak_before is None or peak_after > peak_before):
    row["device_peak_bytes"] = peak_after


def _rel_err(x: jax.Array, ref: jax.Array) -> float:
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def _fwd_bwd(fn: Callable, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array) -> tuple[jax.Array, ...]:
  out, vjp = jax.vjp(fn, q, k, v)
  return (out, *vjp(g.astype(out.dtype)))


def accuracy_case(impl: str, seq: int, args: Any, ref: tuple[jax.Array, ...], inputs: tuple[jax.Array, ...]
                  ) -> dict[str, Any]:
  """One impl in args.dtype against the float32 reference `ref` = (out, dq, dk, dv)."""
  row: dict[str, Any] = {"impl": impl, "seq": seq, "dtype": args.dtype, "tolerance": args.tolerance,
                         "grad_tolerance": args.grad_tolerance, "skipped": unavailable(impl), "error": None}
  if impl == "auto":
    row["resolved"] = auto_backend(args.dtype).attention_impl
  if row["skipped"]:
    return row
  try:
    attn = _attention_fn(impl, seq, args.block, args.block_q, args.block_k, args.dtype)
    got = jax.jit(lambda q, k, v, g: _fwd_bwd(attn, q, k, v, g))(*inputs)
  except Exception as e:  # noqa: BLE001 - a failing impl is a row with its error
    row["error"] = _error_text(e)
    row["ok"] = False
    return row
  for name, x, r in zip(("out", "dq", "dk", "dv"), got, ref):
    row[f"{name}_rel_err"] = round(_rel_err(x, r), 6)
  row["ok"] = bool(row["out_rel_err"] <= args.tolerance and
                   max(row["dq_rel_err"], row["dk_rel_err"], row["dv_rel_err"]) <= args.grad_tolerance)
  return row


def accuracy(impls: Sequence[str], seqs: Sequence[int], args: Any) -> list[dict[str, Any]]:
  rows = []
  for seq in seqs:
    q_shape, kv_shape = _shapes(args, seq)
    ks = jax.random.split(jax.random.PRNGKey(seq), 4)
    lo = jnp.dtype(args.dtype)
    q, k, v = (jax.random.normal(kk, s, jnp.float32).astype(lo) for kk, s in
               zip(ks[:3], (q_shape, kv_shape, kv_shape)))
    g = jax.random.normal(ks[3], q_shape, jnp.float32)
    ref_fn = _attention_fn("reference", seq, args.block, args.block_q, args.block_k)
    with jax.default_matmul_precision("highest"):
      ref = jax.jit(lambda q, k, v, g, f=ref_fn: _fwd_bwd(f, q, k, v, g))(
          q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), g)
    for impl in impls:
      row = accuracy_case(impl, seq, args, ref, (q, k, v, g))
      rows.append(row)
      if row["skipped"] or row["error"]:
        print(f"{impl:>10s} L={seq:6d}  {'skipped: ' + row['skipped'] if row['skipped'] else 'ERROR: ' + row['error']}",
              flush=True)
      else:
        print(f"{impl:>10s} L={seq:6d}  rel err out {row['out_rel_err']:.2e}  dq {row['dq_rel_err']:.2e}  "
              f"dk {row['dk_rel_err']:.2e}  dv {row['dv_rel_err']:.2e}  "
              f"{'ok' if row['ok'] else 'ABOVE TOLERANCE'}", flush=True)
  return rows


def _fmt_bytes(n: int | None) -> str:
  return "n/a" if n is None else f"{n / 2 ** 20:10.1f} MiB"


def _targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
  by = {(r["impl"], r["seq"]): r for r in rows}
  out: dict[str, Any] = {}
  seqs = sorted({r["seq"] for r in rows})
  if seqs:
    longest = seqs[-1]
    ref, blk = by.get(("reference", longest)), by.get(("blockwise", longest))
    if ref and blk and ref["peak_bytes"] and blk["peak_bytes"] is not None:
      ratio = blk["peak_bytes"] / ref["peak_bytes"]
      out[f"memory_ratio_at_{longest}"] = round(ratio, 5)
      out[f"memory_ratio_at_{longest}_le_0.10"] = ratio <= 0.10
  ref, blk = by.get(("reference", 2048)), by.get(("blockwise", 2048))
  if ref and blk and ref["time_s"] and blk["time_s"]:
    ratio = blk["time_s"] / ref["time_s"]
    out["time_ratio_at_2048"] = round(ratio, 4)
    out["time_ratio_at_2048_le_1.5"] = ratio <= 1.5
  return out


def define_flags(fv: flags.FlagValues) -> None:
  flags.DEFINE_string("seq", "1024,2048,4096,8192,16384", "comma-separated sequence lengths", flag_values=fv)
  flags.DEFINE_integer("heads", 8, "query heads", lower_bound=1, flag_values=fv)
  flags.DEFINE_integer("kv-heads", 0, "key/value heads; 0 = --heads (MHA)", lower_bound=0, flag_values=fv)
  flags.DEFINE_integer("head-dim", 64, "head dimension", lower_bound=1, flag_values=fv)
  flags.DEFINE_integer("batch", 1, "batch size", lower_bound=1, flag_values=fv)
  flags.DEFINE_string("impls", "reference,blockwise", f"comma-separated, from {', '.join(IMPLS)}",
                      flag_values=fv)
  flags.DEFINE_integer("block", 256, "blockwise tile size (queries and keys); 256 was fastest on CPU for "
                       "L = 2k..4k", lower_bound=1, flag_values=fv)
  flags.DEFINE_integer("block-q", 0, "override --block for queries", lower_bound=0, flag_values=fv)
  flags.DEFINE_integer("block-k", 0, "override --block for keys", lower_bound=0, flag_values=fv)
  flags.DEFINE_string("dtype", "float32", "q, k, v dtype", flag_values=fv)
  flags.DEFINE_integer("repeats", 3, "timed runs after the warm-up (median reported)", lower_bound=1, flag_values=fv)
  flags.DEFINE_float("time-budget-s", 60.0, "fewer repeats (at least 1) when warm-up time x repeats would "
                     "exceed this", lower_bound=0.0, flag_values=fv)
  flags.DEFINE_float("max-timed-temp-gb", 6.0, "do not run dense impls whose compiled temporaries exceed "
                     "this", lower_bound=0.0, flag_values=fv)
  flags.DEFINE_bool("accuracy", False, "compare each impl in --dtype with the float32 reference (output and "
                    "gradients) instead of timing", flag_values=fv)
  flags.DEFINE_float("tolerance", 2e-2, "--accuracy: largest relative error of the output", lower_bound=0.0,
                     flag_values=fv)
  flags.DEFINE_float("grad-tolerance", 5e-2, "--accuracy: largest relative error of dq, dk, dv",
                     lower_bound=0.0, flag_values=fv)
  flags.DEFINE_string("json", "", "also write the result dict to this file", flag_values=fv)


def parse_args(argv: Sequence[str] | None) -> Any:
  return cli_common.parse(argv, define_flags, doc=__doc__, prog="python -m tformer_jax.bench attention")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = parse_args(argv)
  try:
    seqs = [int(s) for s in args.seq.split(",") if s.strip()]
  except ValueError:
    cli_common.fail(f"--seq takes comma-separated integers, not {args.seq!r}")
  if not seqs or min(seqs) < 1:
    cli_common.fail(f"--seq takes comma-separated lengths >= 1, not {args.seq!r}")
  impls = cli_common.choices(args.impls, IMPLS, "impl")
  try:
    jnp.dtype(args.dtype)
  except TypeError:
    cli_common.fail(f"--dtype: unknown dtype {args.dtype!r}")
  config = {k: v for k, v in vars(args).items() if k != "json"}
  config["backend"] = jax.default_backend()
  what = "accuracy vs the float32 reference" if args.accuracy else "fwd+bwd"
  print(f"attention {what}, causal, batch={args.batch} heads={args.heads}/{args.kv_heads or args.heads} "
        f"head_dim={args.head_dim} dtype={args.dtype} block={args.block_q or args.block}x{args.block_k or args.block} "
        f"on {jax.default_backend()} ({jax.device_count()} devices)", flush=True)
  if args.accuracy:
    rows = accuracy(impls, seqs, args)
    checked = [r for r in rows if not r["skipped"]]
    result = {"config": config, "accuracy": rows, "accuracy_ok": all(r["ok"] for r in checked)}
  else:
    rows = []
    for seq in seqs:
      for impl in impls:
        row = run_case(impl, seq, args)
        rows.append(row)
        if row["error"]:
          t = f"ERROR ({row['error']})"
        elif row["time_s"] is None:
          t = f"skipped ({row['skipped']})"
        else:
          t = f"{row['time_s'] * 1e3:10.1f} ms"
        dev = "" if row["device_peak_bytes"] is None else f"  device peak {_fmt_bytes(row['device_peak_bytes'])}"
        comp = "" if row["compile_s"] is None else f"  (compile {row['compile_s']:.1f} s)"
        print(f"{impl:>10s} L={seq:6d}  peak {_fmt_bytes(row['peak_bytes'])}  "
              f"temp {_fmt_bytes(row['temp_bytes'])}{dev}  time {t}{comp}", flush=True)
    result = {"config": config, "results": rows, "targets": _targets(rows)}
    for name, value in result["targets"].items():
      print(f"target {name}: {value}")
  line = json.dumps(result)
  if args.json:
    with open(args.json, "w") as f:
      f.write(line + "\n")
  print(line, flush=True)
  return result


if __name__ == "__main__":
  sys.exit(cli_common.run_main(main))
