"""Serving throughput: the HTTP server with continuous batching at 1, 4, 16 concurrent clients vs
sequential `decode.generate` calls (one request at a time, no server).

  python -m tformer_jax.bench serve --requests 32 --max-tokens 64 --json OUT.json
  python -m tformer_jax.bench serve --config=configs/llama_tiny.py --slots 16

Default model (no --config): RoPE GQA, d_model 256, 4 layers, 4/2 heads, vocab 256, max_len 512,
random weights. Every request is greedy with its own prompt (lengths spread over [prompt-min,
prompt-max] tokens) and makes exactly --max-tokens tokens (no stop). Each figure is the completion
tokens of all requests over the wall time from the first send to the last answer (the server warmed
up first: prefill buckets and the step compiled); the ratios to sequential generate come from one run.
"""
from __future__ import annotations

import concurrent.futures
import sys
import time
from typing import Any, Sequence

import jax
import numpy as np
from absl import flags

from tformer_jax import backends, cli_common, decode, model_loading
from tformer_jax.bench import emit
from tformer_jax.config import default_config


def define_flags(fv: flags.FlagValues) -> None:
  flags.DEFINE_integer("d-model", 256, "model width (without --config)", lower_bound=1, flag_values=fv)
  flags.DEFINE_integer("layers", 4, "layers (without --config)", lower_bound=1, flag_values=fv)
  flags.DEFINE_integer("requests", 32, "requests per measurement", lower_bound=1, flag_values=fv)
  flags.DEFINE_integer("max-tokens", 64, "completion tokens per request", lower_bound=1, flag_values=fv)
  flags.DEFINE_integer("prompt-min", 8, "shortest prompt (tokens)", lower_bound=1, flag_values=fv)
  flags.DEFINE_integer("prompt-max", 64, "longest prompt (tokens)", lower_bound=1, flag_values=fv)
  flags.DEFINE_integer("slots", 16, "server cache slots", lower_bound=1, flag_values=fv)
  flags.DEFINE_integer("max-len", 256, "tokens per slot", lower_bound=2, flag_values=fv)
  flags.DEFINE_list("clients", ["1", "4", "16"], "concurrent client counts", flag_values=fv)
  flags.DEFINE_string("json", None, "also write the result dict to this file", flag_values=fv)


def _prompts(args: Any, vocab: int) -> list[list[int]]:
  rng = np.random.default_rng(0)
  lengths = rng.integers(args.prompt_min, args.prompt_max + 1, args.requests)
  return [rng.integers(1, vocab, n).tolist() for n in lengths]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = cli_common.parse(argv, define_flags, doc=__doc__, prog="python -m tformer_jax.bench serve", config=True)
  import openai  # noqa: PLC0415 (the test extra: the official client)

  from tformer_jax.serve import Engine  # noqa: PLC0415 (aiohttp: the serve extra)
  from tformer_jax.serve.http import BackgroundServer, Service  # noqa: PLC0415
  try:
    clients = [int(c) for c in args.clients]
  except ValueError:
    clients = []
  if not clients or min(clients) < 1:
    raise cli_common.UsageError(f"--clients: positive integers, got {args.clients}")
  if args.config is None:
    cfg = default_config()
    cfg.model.update(dict(d_model=args.d_model, num_layers=args.layers, num_heads=4, num_kv_heads=2,
                          vocab_size=256, position="rope", max_len=512))
  else:
    cfg = args.config
  model, params, tok = model_loading.random_init(cfg, 0)
  runtime = backends.resolve_runtime(cfg, model=model.cfg, quiet=True)
  prompts = _prompts(args, model.cfg.vocab_size)
  n_tokens = args.requests * args.max_tokens
  res: dict[str, Any] = dict(requests=args.requests, max_tokens=args.max_tokens, slots=args.slots,
                             d_model=model.cfg.d_model, layers=model.cfg.num_layers, backend=jax.default_backend(),
                             runtime=runtime.backend.describe())
  with backends.use(runtime.backend):
    gen = lambda p: decode.generate(model, params, [p], max_new_tokens=args.max_tokens, temperature=0.0,  # noqa: E731
                                    max_len=args.max_len)
    by_bucket = list({decode.prompt_bucket(len(p)): p for p in prompts}.values())
    for p in by_bucket:
      gen(p)                                                        # compile every bucket first
    t0 = time.perf_counter()
    for p in prompts:
      gen(p)
    seq_s = time.perf_counter() - t0
    res["sequential_generate_tok_s"] = round(n_tokens / seq_s, 1)
    print(f"sequential generate: {res['sequential_generate_tok_s']:.1f} tok/s", flush=True)
    engine = Engine(model, params, num_slots=args.slots, max_len=args.max_len, max_queue=4 * args.requests)
    engine.warmup()
    engine.start()
  server = BackgroundServer(Service(engine, tok, "bench"))
  client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)

  def one(p: list[int]) -> int:
    r = client.completions.create(model="bench", prompt=p, max_tokens=args.max_tokens, temperature=0)
    return r.usage.completion_tokens

  try:
    with concurrent.futures.ThreadPoolExecutor(max(clients)) as pool:
      list(pool.map(one, by_bucket))                                # warm: every prefill bucket compiled
      for c in clients:
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(c) as group:
          made = sum(group.map(one, prompts))
        s = time.perf_counter() - t0
        res[f"server_c{c}_tok_s"] = round(made / s, 1)
        res[f"server_c{c}_vs_sequential"] = round(seq_s / s * made / n_tokens, 3)
        print(f"server, {c:>2} concurrent clients: {made / s:.1f} tok/s = "
              f"{res[f'server_c{c}_vs_sequential']:.2f}x sequential generate", flush=True)
  finally:
    server.close()
    engine.close()
  res["step_compiles"] = sum(1 for n, _ in decode.COMPILE_LOG if n == "slot_step")
  return emit(res, args.json)


if __name__ == "__main__":
  sys.exit(cli_common.run_main(main))
