"""Decoding benchmark: KV-cache generation vs full recomputation at every step.

  python -m tformer_jax.bench decode --batch 1 --prompt-len 64 --new-tokens 512 --json OUT.json
  python -m tformer_jax.bench decode --config=configs/llama_tiny.py --config.model.max_len=1024

Default model (no --config): RoPE, d_model 256, 4 layers, 4 heads, vocab 256, max_len 1024, random
weights. Greedy decoding, no stop tokens, so every run makes exactly --new-tokens tokens per row.
Cached: prefill latency, then per-token latency and tokens/s of the compiled step loop.
Recompute: one full forward over the whole (prompt + new) buffer per token, no cache.
Times are medians over --runs after a warm-up call; compile time is reported separately. The slow
recompute path has no warm-up: its first call counts, minus its logged compile time.
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

from tformer_jax import cli_common, decode, decode_io
from tformer_jax.bench import emit
from tformer_jax.config import default_config


def define_flags(fv: flags.FlagValues) -> None:
  flags.DEFINE_integer("d-model", 256, "model width (without --config)", flag_values=fv)
  flags.DEFINE_integer("layers", 4, "layers (without --config)", flag_values=fv)
  flags.DEFINE_integer("heads", 4, "query heads (without --config)", flag_values=fv)
  flags.DEFINE_integer("kv-heads", 0, "key/value heads, 0 = --heads (without --config)", flag_values=fv)
  flags.DEFINE_integer("vocab", 256, "vocabulary size (without --config)", flag_values=fv)
  flags.DEFINE_string("position", "rope", "position scheme (without --config)", flag_values=fv)
  flags.DEFINE_integer("max-len", 0, "model max_len (0: 1024, or the config's)", flag_values=fv)
  flags.DEFINE_integer("batch", 1, "rows decoded together", flag_values=fv)
  flags.DEFINE_integer("prompt-len", 64, "prompt tokens per row", flag_values=fv)
  flags.DEFINE_integer("new-tokens", 512, "tokens generated per row", flag_values=fv)
  flags.DEFINE_integer("runs", 3, "timed runs of the cached path", flag_values=fv)
  flags.DEFINE_integer("recompute-runs", 2, "timed runs of the recompute path", flag_values=fv)
  flags.DEFINE_bool("no-recompute", False, "skip the (slow) recompute baseline", flag_values=fv)
  flags.DEFINE_integer("seed", 0, "weights and prompts seed", flag_values=fv)
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
  model, params, _ = decode_io.random_init(cfg, args.seed)
  m = model.cfg
  b, p, n = args.batch, args.prompt_len, args.new_tokens
  prompts = np.asarray(jax.random.randint(jax.random.PRNGKey(args.seed + 1), (b, p), 0, m.vocab_size))
  req = decode.make_request(model, prompts, max_new_tokens=n, temperature=0.0)
  n_params = sum(int(x.size) for x in jax.tree.leaves(params))
  print(f"model: d_model={m.d_model} layers={m.num_layers} heads={m.num_heads}/{m.kv_heads} "
        f"vocab={m.vocab_size} position={m.position} params={n_params / 1e6:.2f}M; "
        f"batch={b} prompt={p} new={n} cache_slots={req.slots} backend={jax.default_backend()}")

  pre_times, pre_compile, st = _timed(lambda: req.prefill(params), args.runs, True)
  dec_times, dec_compile, (_, out) = _timed(lambda: req.steps(params, st, n, n, False), args.runs, True)
  prefill_s, decode_s = statistics.median(pre_times), statistics.median(dec_times)
  cached_total = prefill_s + decode_s
  res: dict[str, Any] = dict(
      batch=b, prompt_len=p, new_tokens=n, d_model=m.d_model, layers=m.num_layers, position=m.position,
      params_m=round(n_params / 1e6, 3), backend=jax.default_backend(),
      cached_compile_s=round(pre_compile + dec_compile, 3), prefill_ms=round(1e3 * prefill_s, 3),
      cached_per_token_ms=round(1e3 * decode_s / n, 4), cached_decode_tok_s=round(b * n / decode_s, 1),
      cached_total_s=round(cached_total, 4), cached_tok_s=round(b * n / cached_total, 1))
  print(f"cached:    compile {res['cached_compile_s']:.2f}s | prefill {res['prefill_ms']:.2f} ms | "
        f"{res['cached_per_token_ms']:.3f} ms/token ({res['cached_decode_tok_s']:.0f} tok/s decode) | "
        f"total {cached_total:.3f}s = {res['cached_tok_s']:.0f} tok/s")

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
