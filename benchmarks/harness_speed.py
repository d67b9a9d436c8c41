"""lm-evaluation-harness speed: our `tformer` model class vs the harness's Hugging Face backend (HFLM).

  python benchmarks/harness_speed.py [--tasks shakespeare_next_line,shakespeare_ppl,shakespeare_continue]
                                     [--limit 0] [--gen_limit 16] [--batch_size 8] [--runs 2] [--json OUT]

One random float32 Llama with a byte-level BPE trained on Shakespeare (--vocab tokens), saved as an HF
directory (--d_model, --layers, --heads/--kv_heads, --max_len positions), is evaluated by both backends
on the shipped offline tasks (tformer_jax/eval/tasks), --runs times each, the backends alternating per
task. Per (backend, task, run): seconds of `lm_eval.simple_evaluate` and requests/s (the task's requests:
4 per multiple-choice document, 1 per perplexity or generation document). Run 1 of ours includes XLA
compilation (one step per length bucket); later runs reuse it (the same LM instance). --limit caps the
documents of every task (0: all), --gen_limit those of generation tasks; --torch_threads sets torch's
intra-op threads (a shared machine: torch's OpenMP threads suffer from oversubscription). Prints and
writes (--json) the rows, the warm-run ratio ours/hf per task, and the machine's load average.
"""
from __future__ import annotations

import json
import os
import pathlib
import sys
import tempfile
import time
from typing import Any, Sequence

from absl import flags

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tformer_jax import cli_common  # noqa: E402


def define_flags(fv: flags.FlagValues) -> None:
  flags.DEFINE_string("tasks", "shakespeare_next_line,shakespeare_ppl,shakespeare_continue", "tasks",
                      flag_values=fv)
  flags.DEFINE_integer("limit", 0, "documents per task (0: all)", flag_values=fv)
  flags.DEFINE_integer("gen_limit", 16, "documents per generation task", flag_values=fv)
  flags.DEFINE_integer("batch_size", 8, "requests per step (both backends)", flag_values=fv)
  flags.DEFINE_integer("runs", 2, "evaluations per backend and task", flag_values=fv)
  flags.DEFINE_integer("d_model", 256, "hidden size", flag_values=fv)
  flags.DEFINE_integer("layers", 4, "layers", flag_values=fv)
  flags.DEFINE_integer("heads", 8, "query heads", flag_values=fv)
  flags.DEFINE_integer("kv_heads", 2, "key/value heads", flag_values=fv)
  flags.DEFINE_integer("max_len", 256, "positions (the harness's max_length)", flag_values=fv)
  flags.DEFINE_integer("vocab", 1024, "BPE vocabulary", flag_values=fv)
  flags.DEFINE_integer("torch_threads", 0, "torch.set_num_threads for the hf backend (0: torch's default)",
                       flag_values=fv)
  flags.DEFINE_string("json", None, "write the result to this file", flag_values=fv)


def build_model(d: pathlib.Path, args: Any) -> None:
  import tokenizers
  import torch
  import transformers
  from tokenizers import decoders, models, pre_tokenizers, processors, trainers

  from tformer_jax.data.corpora import load_corpus
  text = load_corpus("shakespeare")[:1_000_000].decode("utf-8", "replace")
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(text.splitlines(), trainers.BpeTrainer(
      vocab_size=args.vocab, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
  tok.save(str(d / "tokenizer.json"))
  (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                       "tokenizer_class": "PreTrainedTokenizerFast"}))
  torch.manual_seed(0)
  cfg = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=args.d_model,
                                 intermediate_size=args.d_model * 8 // 3, num_hidden_layers=args.layers,
                                 num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                                 max_position_embeddings=args.max_len, tie_word_embeddings=False,
                                 bos_token_id=0, eos_token_id=1)
  transformers.LlamaForCausalLM(cfg).save_pretrained(d)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = cli_common.parse(argv, define_flags, doc=__doc__, prog="benchmarks/harness_speed.py")
  import lm_eval
  import torch
  from lm_eval.models.huggingface import HFLM

  from tformer_jax.eval import harness
  tasks = [t for t in args.tasks.split(",") if t]
  if args.torch_threads:
    torch.set_num_threads(args.torch_threads)
  load_before = os.getloadavg()
  with tempfile.TemporaryDirectory() as tmp:
    d = pathlib.Path(tmp)
    build_model(d, args)
    manager = harness.task_manager(include_defaults=False)
    backends = {"tformer": harness.TformerLM(hf=str(d), batch_size=args.batch_size),
                "hf": HFLM(pretrained=str(d), batch_size=args.batch_size, device="cpu", dtype="float32")}
    rows = []
    for task in tasks:
      kinds = {t.config.output_type for t in manager.load_task_or_group([task]).values()}
      limit = args.gen_limit if "generate_until" in kinds else (args.limit or None)
      for run in range(1, args.runs + 1):
        for name, lm in backends.items():
          t0 = time.perf_counter()
          res = lm_eval.simple_evaluate(model=lm, tasks=[task], limit=limit, task_manager=manager,
                                        log_samples=True, bootstrap_iters=0)
          seconds = time.perf_counter() - t0
          n = sum(len(s["resps"]) for s in res["samples"][task])
          metrics = {k: v for k, v in res["results"][task].items() if isinstance(v, float) and "stderr" not in k}
          rows.append({"backend": name, "task": task, "run": run, "requests": n, "seconds": round(seconds, 3),
                       "requests_per_s": round(n / seconds, 2), "metrics": metrics})
          print(json.dumps(rows[-1]), flush=True)
  warm = {}
  for task in tasks:
    last = {r["backend"]: r for r in rows if r["task"] == task and r["run"] == args.runs}
    warm[task] = round(last["tformer"]["requests_per_s"] / last["hf"]["requests_per_s"], 2)
  out = {"model": {k: getattr(args, k) for k in ("d_model", "layers", "heads", "kv_heads", "max_len", "vocab")},
         "batch_size": args.batch_size, "torch_threads": torch.get_num_threads(), "rows": rows,
         "warm_speedup_tformer_over_hf": warm,
         "cpu_count": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": os.getloadavg()}
  print(json.dumps({"warm_speedup_tformer_over_hf": warm, "loadavg_before": load_before,
                    "loadavg_after": out["loadavg_after"]}))
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
  return out


if __name__ == "__main__":
  main()
