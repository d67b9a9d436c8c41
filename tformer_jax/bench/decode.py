"""Decoding benchmark: KV-cache generation vs full recomputation at every step.

  python -m tformer_jax.bench decode --batch 1 --prompt-len 64 --new-tokens 512 --json OUT.json
  python -m tformer_jax.bench decode --config=configs/llama_tiny.py --config.model.max_len=1024

Default model (no --config): RoPE, d_model 256, 4 layers, 4 heads, vocab 256, max_len 1024, random
weights. Greedy decoding, no stop tokens, so every run makes exactly --new-tokens tokens per row.
  python -m tformer_jax.bench decode --config=configs/bench/llama_1b_gpu.py --dtype=bfloat16 \
      --config.runtime.attention=xla --batch 1 --prompt-len 128 --new-tokens 256 --no-recompute

The model decodes in `decode.decode_layout`: scanned or unrolled layers as --scan says, else as the
runtime decides for the platform (runtime.decode_layout: unrolled on CPU, scanned elsewhere).
Cached: the first call (compiles included: compile_s = prefill_compile_s + decode_compile_s, each
lower + compile; the two compile on two threads, so compile_wall_s, the wait for both, can be less;
first_call_s the whole wait), then warm figures: ttft_ms (prefill + first token), prefill_ms,
per_token_ms and decode_tok_s of the compiled step loop, tok_s end to end; same_bucket_new_compiles
counts compiles for a prompt one token shorter in the same prompt bucket (0 expected).
Recompute: one full forward over the whole (prompt + new) buffer per token, no cache.
cache_bytes: the KV cache of this request (--cache-dtype: int8 stores K/V with per-token scales), and
cache_vs_bf16 its ratio to a bfloat16 cache.
Warm times are medians over --runs after the first call. The slow recompute path has no warm-up: its
first call counts, minus its logged compile time. The persistent compilation cache is not enabled
here, so compile times are cold.
Prints human-readable lines, then one JSON line.
"""
from __future__ import annotations

import statistics
import sys
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np
from absl import flags

from tformer_jax import backends, cli_common, decode, model_loading
from tformer_jax.bench import emit
from tformer_jax.config import default_config


def define_flags(fv: flags.FlagValues) -> None:
  flags.DEFINE_integer("d-model", 256, "model width (without --config)", lower_bound=1, flag_values=fv)
  flags.DEFINE_integer("layers", 4, "layers (without --config)", lower_bound=1, flag_values=fv)
  flags.DEFINE_integer("heads", 4, "query heads (without --config)", lower_bound=1, flag_values=fv)
  flags.DEFINE_integer("kv-heads", 0, "key/value heads, 0 = --heads (without --config)", lower_bound=0, flag_values=fv)
  flags.DEFINE_integer("vocab", 256, "vocabulary size (without --config)", lower_bound=1, flag_values=fv)
  flags.DEFINE_string("position", "rope", "position scheme (without --config)", flag_values=fv)
  flags.DEFINE_integer("max-len", 0, "model max_len (0: 1024, or the config's)", lower_bound=0, flag_values=fv)
  flags.DEFINE_integer("batch", 1, "rows decoded together", lower_bound=1, flag_values=fv)
  flags.DEFINE_integer("prompt-len", 64, "prompt tokens per row", lower_bound=1, flag_values=fv)
  flags.DEFINE_integer("new-tokens", 512, "tokens generated per row", lower_bound=1, flag_values=fv)
  flags.DEFINE_integer("runs", 3, "timed runs of the cached path", lower_bound=1, flag_values=fv)
  flags.DEFINE_integer("recompute-runs", 2, "timed runs of the recompute path", lower_bound=1, flag_values=fv)
  flags.DEFINE_bool("no-recompute", False, "skip the (slow) recompute baseline", flag_values=fv)
  flags.DEFINE_integer("seed", 0, "weights and prompts seed", lower_bound=0, flag_values=fv)
  flags.DEFINE_bool("scan", None, "decode with scanned layers (decode.decode_layout); --noscan: unrolled; "
                    "default: the runtime's choice (runtime.decode_layout)", flag_values=fv)
  flags.DEFINE_string("dtype", None, "compute and weight dtype for inference (e.g. bfloat16; default: the "
                      "config's)", flag_values=fv)
  flags.DEFINE_string("cache-dtype", None, "KV cache storage: '' (model dtype) | bfloat16 | int8 (default: the "
                      "config's decode.cache_dtype)", flag_values=fv)
  flags.DEFINE_string("json", None, "also write the result dict to this file", flag_values=fv)


def parse_args(argv: Sequence[str] | None) -> Any:
  return cli_common.parse(argv, define_flags, doc=__doc__, prog="python -m tformer_jax.bench decode",
                          config=True)


def build_config(args: Any) -> Any:
  if args.config is not None:
    cfg = args.config
    if args.max_len:
      cfg.model.max_len = args.max_len
    return cfg
  cfg = default_config()
  cfg.model.update(dict(d_model=args.d_model, num_layers=args.layers, num_heads=args.heads,
                        num_kv_heads=args.kv_heads, vocab_size=args.vocab, position=args.position,
                        max_len=args.max_len or 1024))
  return cfg


def _timed(fn: Callable[[], Any], runs: int, warmup: bool) -> tuple[list[float], float, Any]:
  """Per-run seconds, total compile seconds, last result. warmup: an extra untimed first call;
  otherwise the first call counts, minus its logged compile time (for the slow recompute path)."""
  times, compile_s, out = [], 0.0, None
  for i in range(max(runs, 1) + int(warmup)):
    logged = len(decode.COMPILE_LOG)
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn())
    dt = time.perf_counter() - t0
    c = sum(s for _, s in decode.COMPILE_LOG[logged:])
    compile_s += c
    if not (warmup and i == 0):
      times.append(dt - c)
  return times, compile_s, out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = parse_args(argv)
  cfg = build_config(args)
  if args.dtype:   # inference: compute and store the weights in this dtype
    cfg.model.dtype = cfg.model.param_dtype = args.dtype
  runtime = backends.resolve_runtime(cfg, quiet=True)
  with backends.use(runtime.backend):
    return _run(args, cfg, runtime)


def _run(args: Any, cfg: Any, runtime: backends.Runtime) -> dict[str, Any]:
  t0 = time.perf_counter()
  model, params, _ = model_loading.random_init(cfg, args.seed)
  jax.block_until_ready(params)
  init_s = time.perf_counter() - t0
  train_layout = "scanned" if model.cfg.scan_layers else "unrolled"
  t0 = time.perf_counter()
  cache_dtype = args.cache_dtype if args.cache_dtype is not None else cfg.decode.get("cache_dtype", "")
  model, params = decode.decode_layout(decode.with_cache_dtype(model, cache_dtype), params, args.scan)
  jax.block_until_ready(params)
  layout_s = time.perf_counter() - t0
  m = model.cfg
  b, p, n = args.batch, args.prompt_len, args.new_tokens
  prompts = np.asarray(jax.random.randint(jax.random.PRNGKey(args.seed + 1), (b, p), 0, m.vocab_size))
  req = decode.make_request(model, prompts, max_new_tokens=n, temperature=0.0)
  n_params = sum(int(x.size) for x in jax.tree.leaves(params))
  print(f"model: d_model={m.d_model} layers={m.num_layers} ({train_layout} in the config, scanned for decoding: "
        f"{m.scan_layers}) heads={m.num_heads}/{m.kv_heads} vocab={m.vocab_size} position={m.position} "
        f"dtype={m.dtype} params={n_params / 1e6:.2f}M (init {init_s:.1f}s, layout {layout_s:.2f}s); "
        f"batch={b} prompt={p} (bucket {req.tokens_BxP.shape[1]}) new={n} cache_slots={req.slots} "
        f"{runtime.backend.describe()} on {jax.default_backend()}", flush=True)
  cache_bytes = decode.cache_bytes(model, b, req.slots)
  bf16_bytes = decode.cache_bytes(decode.with_cache_dtype(model, "bfloat16"), b, req.slots)
  print(f"KV cache ({cache_dtype or m.dtype}): {cache_bytes / 2**20:.2f} MiB = {cache_bytes / bf16_bytes:.3f}x "
        "the bfloat16 cache", flush=True)

  # first call: what a user waits for (compiles included), split into compile and run
  logged = len(decode.COMPILE_LOG)
  t0 = time.perf_counter()
  req.compile(params, n, False)   # prefill and step loop compiled together, as decode.generate does
  compile_wall_s = time.perf_counter() - t0
  st = req.prefill(params)
  jax.block_until_ready(st)
  first_prefill_s = time.perf_counter() - t0
  st1, _ = req.steps(params, st, 1, n, False)   # the same executable as n steps (n_steps is traced)
  jax.block_until_ready(st1)
  _, out = req.steps(params, st, n, n, False)
  jax.block_until_ready(out)
  first_call_s = time.perf_counter() - t0
  compiles = decode.COMPILE_LOG[logged:]
  prefill_compile = sum(s for name, s in compiles if name.startswith("prefill"))   # or its pieces
  decode_compile = sum(s for name, s in compiles if name == "decode_loop")
  print(f"first call: {first_call_s:.2f}s, of which compiling {compile_wall_s:.2f}s (prefill {prefill_compile:.2f}s "
        f"and decode loop {decode_compile:.2f}s, together; prefill call {first_prefill_s:.2f}s)", flush=True)

  # another prompt length in the same bucket: must compile nothing
  p2 = max(1, p - 1) if decode.prompt_bucket(max(1, p - 1)) == decode.prompt_bucket(p) else p
  req2 = decode.make_request(model, prompts[:, :p2], max_new_tokens=n, temperature=0.0)
  logged = len(decode.COMPILE_LOG)
  jax.block_until_ready(req2.steps(params, req2.prefill(params), n, n, False))
  second_compiles = len(decode.COMPILE_LOG) - logged

  pre_times, _, st = _timed(lambda: req.prefill(params), args.runs, False)
  ttft_times, _, _ = _timed(lambda: req.steps(params, req.prefill(params), 1, n, False), args.runs, False)
  dec_times, _, (_, out) = _timed(lambda: req.steps(params, st, n, n, False), args.runs, False)
  prefill_s, decode_s = statistics.median(pre_times), statistics.median(dec_times)
  cached_total = prefill_s + decode_s
  res: dict[str, Any] = dict(
      batch=b, prompt_len=p, prompt_bucket=int(req.tokens_BxP.shape[1]), new_tokens=n, d_model=m.d_model,
      layers=m.num_layers, position=m.position, dtype=m.dtype, params_m=round(n_params / 1e6, 3),
      backend=jax.default_backend(), runtime=runtime.backend.describe(), config_layout=train_layout,
      decode_layout="scanned" if m.scan_layers else "unrolled", layout_s=round(layout_s, 3),
      compile_s=round(prefill_compile + decode_compile, 3), prefill_compile_s=round(prefill_compile, 3),
      decode_compile_s=round(decode_compile, 3), compile_wall_s=round(compile_wall_s, 3),
      first_call_s=round(first_call_s, 3),
      same_bucket_new_compiles=second_compiles, cache_dtype=cache_dtype or m.dtype, cache_bytes=cache_bytes,
      cache_vs_bf16=round(cache_bytes / bf16_bytes, 4),
      prefill_ms=round(1e3 * prefill_s, 3), ttft_ms=round(1e3 * statistics.median(ttft_times), 3),
      per_token_ms=round(1e3 * decode_s / n, 4), decode_tok_s=round(b * n / decode_s, 1),
      total_s=round(cached_total, 4), tok_s=round(b * n / cached_total, 1))
  print(f"cached:    compile {res['compile_s']:.2f}s | first call {first_call_s:.2f}s | ttft {res['ttft_ms']:.2f} ms | "
        f"prefill {res['prefill_ms']:.2f} ms | {res['per_token_ms']:.3f} ms/token ({res['decode_tok_s']:.0f} tok/s "
        f"decode) | total {cached_total:.3f}s = {res['tok_s']:.0f} tok/s | prompt length {p2} in the same bucket: "
        f"{second_compiles} new compiles", flush=True)

  if not args.no_recompute:
    rec = lambda: decode.generate_recompute(model, params, prompts, max_new_tokens=n, temperature=0.0)  # noqa
    rec_times, rec_compile, rec_out = _timed(rec, args.recompute_runs, False)
    rec_s = statistics.median(rec_times)
    res.update(recompute_compile_s=round(rec_compile, 3), recompute_per_token_ms=round(1e3 * rec_s / n, 4),
               recompute_tok_s=round(b * n / rec_s, 1), recompute_total_s=round(rec_s, 4),
               speedup=round(rec_s / cached_total, 2),
               tokens_match=bool(np.array_equal(np.asarray(out), np.asarray(rec_out))))
    print(f"recompute: compile {rec_compile:.2f}s | {res['recompute_per_token_ms']:.3f} ms/token | "
          f"total {rec_s:.3f}s = {res['recompute_tok_s']:.0f} tok/s")
    print(f"speedup (cached vs recompute, end to end): {res['speedup']:.1f}x; "
          f"same greedy tokens: {res['tokens_match']}")
  return emit(res, args.json)


if __name__ == "__main__":
  sys.exit(cli_common.run_main(main))
