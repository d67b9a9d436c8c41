"""Greedy decoding on CPU: ours (each decode layout) vs transformers `generate`, same weights, same prompt.

  python benchmarks/decode_vs_transformers.py [--new-tokens 128] [--prompt-len 32] [--rounds 3]
                                               [--layouts scanned,unrolled] [--json OUT]

The model is a SmolLM2-135M-shaped Llama built by transformers with random weights (d_model 576, 30
layers, 9 query / 3 KV heads, SwiGLU 1536, vocab 49152, tied embeddings, RoPE theta 100000; float32)
and converted with `interop.hf.load_hf`, so both sides hold the same weights. Batch 1, one random prompt
of --prompt-len tokens, --new-tokens tokens with no end-of-sequence token (both make exactly that many).
Each layout's first call is timed apart (compile_s: the lower+compile seconds `decode.COMPILE_LOG`
records, first_call_s: the whole wait). Then --rounds rounds, each timing one full call of every
contender in turn (transformers first), so a load change on a shared machine hits all of them;
tok_s = new_tokens / the median call. ratio_vs_transformers = our tok_s / theirs. tokens_equal: our
greedy tokens equal transformers' (float32 both; random weights can put two logits within rounding).
"""
from __future__ import annotations

import os
import pathlib
import statistics
import sys
import time
from typing import Any, Sequence

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
  sys.path.insert(0, str(REPO))

from tformer_jax.backends import maybe_reexec  # noqa: E402

SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
             num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True, rope_theta=100000.0,
             max_position_embeddings=2048, rms_norm_eps=1e-5, hidden_act="silu")


def parse_args(argv: Sequence[str] | None) -> Any:
  from absl import flags  # noqa: PLC0415

  from tformer_jax import cli_common  # noqa: PLC0415

  def define(fv: flags.FlagValues) -> None:
    flags.DEFINE_integer("new-tokens", 128, "tokens generated", flag_values=fv)
    flags.DEFINE_integer("prompt-len", 32, "prompt tokens", flag_values=fv)
    flags.DEFINE_integer("rounds", 3, "timed rounds (each: one call of every contender)", flag_values=fv)
    flags.DEFINE_string("layouts", "scanned,unrolled", "our decode layouts (decode.decode_layout)",
                        flag_values=fv)
    flags.DEFINE_integer("seed", 0, "weights and prompt seed", flag_values=fv)
    flags.DEFINE_string("json", None, "write the result dict to this file", flag_values=fv)
  return cli_common.parse(argv, define, doc=__doc__, prog="python benchmarks/decode_vs_transformers.py")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = parse_args(argv)
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  import torch  # noqa: PLC0415
  import transformers  # noqa: PLC0415

  from tformer_jax import backends, decode  # noqa: PLC0415
  from tformer_jax.bench import emit  # noqa: PLC0415
  from tformer_jax.config import default_config  # noqa: PLC0415
  from tformer_jax.interop import hf  # noqa: PLC0415

  torch.set_num_threads(os.cpu_count() or 1)
  torch.manual_seed(args.seed)
  hf_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE)).eval()
  model, params = hf.load_hf(hf_model)
  rng = np.random.default_rng(args.seed)
  prompt = rng.integers(1, SHAPE["vocab_size"], (1, args.prompt_len)).astype(np.int64)
  n = args.new_tokens
  ids = torch.from_numpy(prompt)
  kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)

  def theirs() -> np.ndarray:
    with torch.inference_mode():
      return hf_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)[0, prompt.shape[1]:].numpy()

  runtime = backends.resolve_runtime(default_config(), model=model.cfg, quiet=True)
  layouts = [s for s in args.layouts.split(",") if s]
  res: dict[str, Any] = dict(bench="decode_vs_transformers", shape=SHAPE, dtype="float32", batch=1,
                             prompt_len=args.prompt_len, new_tokens=n, rounds=args.rounds,
                             torch=torch.__version__, transformers=transformers.__version__, jax=jax.__version__,
                             cpus=os.cpu_count(), load_before=os.getloadavg()[0], runtime=runtime.summary())
  contenders: dict[str, Any] = {"transformers": theirs}
  with backends.use(runtime.backend):
    for lay in layouts:
      scan = lay == "scanned"
      m, p = decode.decode_layout(model, params, scan)   # converted once, outside the timed calls

      def call(m: Any = m, p: Any = p, scan: bool = scan) -> np.ndarray:
        return decode.generate(m, p, prompt, max_new_tokens=n, temperature=0.0, scan_layers=scan)[0]
      logged = len(decode.COMPILE_LOG)
      t0 = time.perf_counter()
      out = call()
      first = time.perf_counter() - t0
      res[f"{lay}_compile_s"] = round(sum(s for _, s in decode.COMPILE_LOG[logged:]), 3)
      res[f"{lay}_first_call_s"] = round(first, 3)
      res[f"{lay}_out"] = out
      contenders[lay] = call
      print(f"{lay}: first call {first:.2f} s (compile {res[f'{lay}_compile_s']:.2f} s)", flush=True)
    res["transformers_out"] = theirs()   # warm-up call
    times: dict[str, list[float]] = {k: [] for k in contenders}
    for r in range(args.rounds):
      for name, fn in contenders.items():
        t0 = time.perf_counter()
        fn()
        times[name].append(time.perf_counter() - t0)
      print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()), flush=True)
  ref = res.pop("transformers_out")
  for name, ts in times.items():
    res[f"{name}_tok_s"] = round(n / statistics.median(ts), 2)
    res[f"{name}_times_s"] = [round(t, 3) for t in ts]
  for lay in layouts:
    out = res.pop(f"{lay}_out")
    res[f"{lay}_ratio_vs_transformers"] = round(res[f"{lay}_tok_s"] / res["transformers_tok_s"], 3)
    res[f"{lay}_tokens_equal"] = bool(np.array_equal(out, ref))
    res[f"{lay}_tokens_agree"] = int(np.argmin(np.append(out == ref, False)))
    print(f"{lay}: {res[f'{lay}_tok_s']:.1f} tok/s = {res[f'{lay}_ratio_vs_transformers']:.2f}x transformers "
          f"({res['transformers_tok_s']:.1f} tok/s); same tokens: {res[f'{lay}_tokens_equal']}", flush=True)
  res["load_after"] = os.getloadavg()[0]
  return emit(res, args.json)


if __name__ == "__main__":
  maybe_reexec()   # tcmalloc / hugetlb as the CLIs run (tformer_jax/backends/cpu/host_alloc.py)
  main()
