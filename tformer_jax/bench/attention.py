"""Attention benchmark: compiled memory and wall time of one causal attention layer, forward + backward.

  python -m tformer_jax.bench attention --seq 1024,2048,4096,8192,16384 --impls reference,blockwise \
      --block 512 --json OUT.json

For each impl and length it jits grad(sum(attention(q, k, v))) w.r.t. q, k, v, reads the compiled
memory (`memory_analysis()`: temporaries, arguments, outputs) without running it, then times it (median
of a few runs after a warm-up). Lengths whose temporaries exceed --max-timed-temp-gb are compiled and
reported but not run. Prints one human-readable line per case and, last, one JSON line.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from absl import flags

from tformer_jax import cli_common
from tformer_jax.ops import masks
from tformer_jax.ops.attention import dot_product_attention
from tformer_jax.ops.blockwise import blockwise_attention
from tformer_jax.ops.chunked_attention import chunked_attention
from tformer_jax.ops.cpu_kernel import chunked_attention_cpu

IMPLS = ("reference", "xla", "blockwise", "chunked", "chunked_cpu")
GB = 1024 ** 3


def _attention_fn(impl: str, seq: int, block: int, block_q: int, block_k: int) -> Callable:
  if impl == "blockwise":
    return lambda q, k, v: blockwise_attention(q, k, v, causal=True, block_q=block_q or block,
                                               block_k=block_k or block)
  if impl == "chunked":  # --block-q (else --block) is the query chunk
    return lambda q, k, v: chunked_attention(q, k, v, causal=True, chunk=block_q or block)
  if impl == "chunked_cpu":  # the C++ CPU kernel; same chunking
    return lambda q, k, v: chunked_attention_cpu(q, k, v, causal=True, chunk=block_q or block)
  if impl in ("reference", "xla"):
    return lambda q, k, v: dot_product_attention(q, k, v, mask=masks.causal_mask(seq), impl=impl)
  raise ValueError(f"unknown impl {impl!r}; expected one of {IMPLS}")


def _memory(compiled: Any) -> dict[str, int | None]:
  ma = compiled.memory_analysis()
  if ma is None:
    return {"temp_bytes": None, "arg_bytes": None, "out_bytes": None, "peak_bytes": None}
  temp, arg, out = (int(getattr(ma, n, 0) or 0) for n in
                    ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes"))
  alias = int(getattr(ma, "alias_size_in_bytes", 0) or 0)
  return {"temp_bytes": temp, "arg_bytes": arg, "out_bytes": out, "peak_bytes": temp + arg + out - alias}


def run_case(impl: str, seq: int, args: Any) -> dict[str, Any]:
  """Compile (and maybe time) one impl at one length; returns a result row."""
  dtype = jnp.dtype(args.dtype)
  kv_heads = args.kv_heads or args.heads
  q_shape = (args.batch, seq, args.heads, args.head_dim)
  kv_shape = (args.batch, seq, kv_heads, args.head_dim)
  attn = _attention_fn(impl, seq, args.block, args.block_q, args.block_k)
  step = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2)))
  t0 = time.perf_counter()
  compiled = step.lower(jax.ShapeDtypeStruct(q_shape, dtype), jax.ShapeDtypeStruct(kv_shape, dtype),
                        jax.ShapeDtypeStruct(kv_shape, dtype)).compile()
  row: dict[str, Any] = {"impl": impl, "seq": seq, "compile_s": round(time.perf_counter() - t0, 3)}
  row.update(_memory(compiled))
  row.update({"time_s": None, "times_s": [], "skipped": None})
  temp = row["temp_bytes"]
  if temp is not None and impl != "blockwise" and temp > args.max_timed_temp_gb * GB:
    row["skipped"] = f"temp {temp / GB:.1f} GB > {args.max_timed_temp_gb} GB"
    return row
  if args.repeats <= 0:
    row["skipped"] = "--repeats 0"
    return row
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
  return row


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
  flags.DEFINE_integer("heads", 8, "query heads", flag_values=fv)
  flags.DEFINE_integer("kv-heads", 0, "key/value heads; 0 = --heads (MHA)", flag_values=fv)
  flags.DEFINE_integer("head-dim", 64, "head dimension", flag_values=fv)
  flags.DEFINE_integer("batch", 1, "batch size", flag_values=fv)
  flags.DEFINE_string("impls", "reference,blockwise", f"comma-separated, from {', '.join(IMPLS)}",
                      flag_values=fv)
  flags.DEFINE_integer("block", 256, "blockwise tile size (queries and keys); 256 was fastest on CPU for "
                       "L = 2k..4k", flag_values=fv)
  flags.DEFINE_integer("block-q", 0, "override --block for queries", flag_values=fv)
  flags.DEFINE_integer("block-k", 0, "override --block for keys", flag_values=fv)
  flags.DEFINE_string("dtype", "float32", "q, k, v dtype", flag_values=fv)
  flags.DEFINE_integer("repeats", 3, "timed runs after the warm-up (median reported)", flag_values=fv)
  flags.DEFINE_float("time-budget-s", 60.0, "fewer repeats (at least 1) when warm-up time x repeats would "
                     "exceed this", flag_values=fv)
  flags.DEFINE_float("max-timed-temp-gb", 6.0, "do not run dense impls whose compiled temporaries exceed "
                     "this", flag_values=fv)
  flags.DEFINE_string("json", "", "also write the result dict to this file", flag_values=fv)


def parse_args(argv: Sequence[str] | None) -> Any:
  return cli_common.parse(argv, define_flags, doc=__doc__, prog="python -m tformer_jax.bench attention")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = parse_args(argv)
  try:
    seqs = [int(s) for s in args.seq.split(",") if s.strip()]
  except ValueError:
    cli_common.fail(f"--seq takes comma-separated integers, not {args.seq!r}")
  impls = [s.strip() for s in args.impls.split(",") if s.strip()]
  for impl in impls:
    if impl not in IMPLS:
      cli_common.fail(f"unknown impl {impl!r}; expected one of {IMPLS}")
  config = {k: v for k, v in vars(args).items() if k != "json"}
  config["backend"] = jax.default_backend()
  print(f"attention fwd+bwd, causal, batch={args.batch} heads={args.heads} head_dim={args.head_dim} "
        f"dtype={args.dtype} block={args.block_q or args.block}x{args.block_k or args.block} "
        f"on {jax.default_backend()} ({jax.device_count()} devices)", flush=True)
  rows = []
  for seq in seqs:
    for impl in impls:
      row = run_case(impl, seq, args)
      rows.append(row)
      t = f"skipped ({row['skipped']})" if row["time_s"] is None else f"{row['time_s'] * 1e3:10.1f} ms"
      print(f"{impl:>10s} L={seq:6d}  peak {_fmt_bytes(row['peak_bytes'])}  "
            f"temp {_fmt_bytes(row['temp_bytes'])}  time {t}  (compile {row['compile_s']:.1f} s)", flush=True)
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
