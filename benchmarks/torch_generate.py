"""transformers `generate` on the architecture of configs/bench/llama_1b_gpu.py: the peer of `bench decode`.

  python benchmarks/torch_generate.py [--cases eager:1,eager:16,static:1,static:16] [--prompt-len 128]
                                      [--new-tokens 256] [--runs 2] [--json OUT]

LlamaForCausalLM from the config's architecture (benchmarks/torch_llama.py `llama_config`), random weights,
all in bfloat16 on the device; greedy decoding (do_sample=False) with no end-of-sequence token, so every call
makes exactly --new-tokens tokens per row (checked). Random prompts of --prompt-len tokens, no padding.
A case is MODE:BATCH:
  eager    the default dynamic cache, no compilation (what `model.generate(ids)` does)
  static   cache_implementation="static": transformers compiles the decoding forward itself
           (torch.compile, its default CompileConfig: inductor, mode 'reduce-overhead'; on a CPU device it
           does so only when asked, --cpu-compile-backend, which the CPU smoke run sets to 'eager')
Per case: first_call_s (the first full call: compilation, CUDA graphs and warm-up included), then --runs warm
full calls (median: total_s, tok_s = batch * new_tokens / total_s), each followed by a warm call with
max_new_tokens=1 (median: ttft_ms, the prefill and the first token); per_token_ms = (total_s - ttft) /
(new_tokens - 1); compile_s = first_call_s - total_s (what the first call costs over a warm one; 0 for
eager, which compiles nothing). The JSON file (--json) is rewritten after each case, so a later failure
keeps the earlier cases; a failing case records its `error`.
"""
from __future__ import annotations

import gc
import os
import pathlib
import statistics
import sys
import time
import traceback
from typing import Any, Sequence

REPO = pathlib.Path(__file__).resolve().parents[1]
HERE = pathlib.Path(__file__).resolve().parent
for p in (str(REPO), str(HERE)):
  if p not in sys.path:
    sys.path.insert(0, p)

import torch  # noqa: E402
import torch_llama  # noqa: E402
import transformers  # noqa: E402
from absl import flags  # noqa: E402

from tformer_jax import cli_common  # noqa: E402
from tformer_jax.bench import emit  # noqa: E402
from tformer_jax.config import ModelConfig  # noqa: E402

MODES = ("eager", "static")


def define_flags(fv: flags.FlagValues) -> None:
  flags.DEFINE_string("cases", "eager:1,eager:16,static:1,static:16", "MODE:BATCH,... run in this order "
                      f"(modes: {', '.join(MODES)})", flag_values=fv)
  flags.DEFINE_integer("prompt-len", 128, "prompt tokens per row", flag_values=fv)
  flags.DEFINE_integer("new-tokens", 256, "tokens generated per row", flag_values=fv)
  flags.DEFINE_integer("runs", 2, "warm timed calls per case (median)", flag_values=fv)
  flags.DEFINE_string("device", "auto", "auto (cuda if available, else cpu), cuda or cpu", flag_values=fv)
  flags.DEFINE_string("cpu-compile-backend", "", "on a CPU device, compile the static-cache decoding with this "
                      "torch.compile backend (transformers compiles only on accelerators by itself); empty: "
                      "static runs uncompiled there", flag_values=fv)
  flags.DEFINE_integer("seed", 0, "weights and prompts seed", flag_values=fv)
  flags.DEFINE_string("json", None, "write the result dict to this file (after each case)", flag_values=fv)


def parse_args(argv: Sequence[str] | None) -> Any:
  return cli_common.parse(argv, define_flags, doc=__doc__, prog="python benchmarks/torch_generate.py",
                          config=torch_llama.DEFAULT_CONFIG)


def parse_cases(text: str) -> list[tuple[str, int]]:
  out = []
  for item in (s.strip() for s in text.split(",") if s.strip()):
    mode, sep, batch = item.partition(":")
    if mode not in MODES or not sep or not batch.isdigit() or int(batch) < 1:
      cli_common.fail(f"--cases: {item!r} is not MODE:BATCH with MODE one of {MODES} and BATCH >= 1")
    out.append((mode, int(batch)))
  if not out:
    cli_common.fail("--cases: no case given")
  return out


def generate_kwargs(mode: str, new_tokens: int, device: torch.device, cpu_backend: str) -> dict[str, Any]:
  kw: dict[str, Any] = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                            eos_token_id=None, pad_token_id=0)
  if mode == "static":
    kw["cache_implementation"] = "static"
    if device.type == "cpu" and cpu_backend:
      cc = transformers.CompileConfig(backend=cpu_backend, mode=None, fullgraph=False)
      cc._compile_all_devices = True   # transformers' switch for compiling off accelerators
      kw["compile_config"] = cc
  return kw


def run_case(model: Any, mode: str, batch: int, args: Any, device: torch.device) -> dict[str, Any]:
  g = torch.Generator(device="cpu").manual_seed(args.seed + batch)
  ids = torch.randint(1, model.config.vocab_size, (batch, args.prompt_len), generator=g).to(device)
  mask = torch.ones_like(ids)
  kw = generate_kwargs(mode, args.new_tokens, device, args.cpu_compile_backend)

  def call(n: int) -> tuple[float, torch.Tensor]:
    torch_llama.sync(device)
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, **dict(kw, max_new_tokens=n, min_new_tokens=n))
    torch_llama.sync(device)
    return time.perf_counter() - t0, out

  first, out = call(args.new_tokens)
  made = int(out.shape[1]) - args.prompt_len
  # full and one-token calls interleaved, so that a slow spell of the machine hits both alike
  totals, ttfts = zip(*[(call(args.new_tokens)[0], call(1)[0]) for _ in range(args.runs)])
  total, ttft = statistics.median(totals), statistics.median(ttfts)
  n = args.new_tokens
  return {"mode": mode, "batch": batch, "first_call_s": round(first, 3),
          "compile_s": round(max(first - total, 0.0), 3) if mode == "static" else 0.0,
          "ttft_ms": round(1e3 * ttft, 3), "per_token_ms": round(1e3 * (total - ttft) / max(n - 1, 1), 4),
          "tok_s": round(batch * n / total, 1), "total_s": round(total, 4), "new_tokens_made": made,
          "tokens_ok": made == n}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = parse_args(argv)
  cases = parse_cases(args.cases)
  if args.prompt_len < 1 or args.new_tokens < 2 or args.runs < 1:
    cli_common.fail("--prompt-len >= 1, --new-tokens >= 2 and --runs >= 1")
  m = ModelConfig.from_config(args.config.model)
  if args.prompt_len + args.new_tokens > m.max_len:
    cli_common.fail(f"--prompt-len + --new-tokens = {args.prompt_len + args.new_tokens} exceeds model.max_len "
                    f"{m.max_len}")
  lc = torch_llama.llama_config(m)
  lc.use_cache = True
  device = torch_llama.device_of(args.device)
  if device.type == "cpu":
    torch.set_num_threads(os.cpu_count() or 1)
  model = torch_llama.build_model(lc, device, args.seed, torch.bfloat16).eval()
  dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
  res: dict[str, Any] = {"bench": "torch_generate", "config": args.config_file, "overrides": args.overrides,
                         "torch": torch.__version__, "transformers": transformers.__version__, "device": dev_name,
                         "dtype": "bfloat16", "params": sum(p.numel() for p in model.parameters()),
                         "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "runs": args.runs,
                         "results": []}
  print(f"transformers {transformers.__version__} generate on {dev_name}: {res['params'] / 1e6:.1f}M params "
        f"bf16, prompt {args.prompt_len} + {args.new_tokens} new, greedy", flush=True)
  for mode, batch in cases:
    try:
      row = run_case(model, mode, batch, args, device)
      print(f"{mode:>6} batch {batch:3d}: first call {row['first_call_s']:.1f} s | ttft {row['ttft_ms']:.1f} ms | "
            f"{row['per_token_ms']:.2f} ms/token | {row['tok_s']:,.0f} tok/s", flush=True)
    except Exception as e:  # noqa: BLE001 - one case's failure (OOM, compiler) is its result
      oom = isinstance(e, torch.OutOfMemoryError)
      row = {"mode": mode, "batch": batch,
             "error": ("out of memory: " if oom else f"{type(e).__name__}: ") + cli_common.one_line(e)[:400]}
      print(f"{mode:>6} batch {batch:3d}: FAILED: {row['error']}\n{traceback.format_exc(limit=4)}", flush=True)
    res["results"].append(row)
    gc.collect()
    if device.type == "cuda":
      torch.cuda.empty_cache()
    if args.json:
      torch_llama.emit_file(res, args.json)
  return emit(res, None)


if __name__ == "__main__":
  sys.exit(cli_common.run_main(main))
