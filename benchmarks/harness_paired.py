"""Is a fine-tune's gain on a perplexity task larger than its noise? Paired, per document, on the harness.

  python benchmarks/harness_paired.py --models=hf:models/base,runs/ft,runs/lora [--task=shakespeare_ppl
                                      --bootstrap=10000 --json OUT]

Each model (hf:DIR, or a training workdir: its latest checkpoint, a LoRA run merged) is scored by
lm-evaluation-harness with the `tformer` model class on a loglikelihood_rolling task (default the shipped
shakespeare_ppl: 30 passages of the held-out plays), every document's log-likelihood kept (log_samples).
bits_per_byte is the harness's aggregate (-sum log-likelihood / sum UTF-8 bytes / ln 2). For every model after
the first: the difference from the first, and its standard error over documents, from a paired bootstrap
(documents resampled with replacement, the same resample for both models; the harness itself reports no
stderr for this metric). The harness scores deterministically (the same weights give the same numbers), so
this is the spread of the held-out text, not of the evaluation. Prints one JSON line.
"""
from __future__ import annotations

import math
import pathlib
import sys
from typing import Any, Sequence

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
  sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
from absl import flags  # noqa: E402

from tformer_jax import cli_common  # noqa: E402
from tformer_jax.bench import emit  # noqa: E402


def define_flags(fv: flags.FlagValues) -> None:
  flags.DEFINE_list("models", None, "hf:DIR or a workdir, comma-separated; the first is the baseline", flag_values=fv)
  flags.DEFINE_string("task", "shakespeare_ppl", "a loglikelihood_rolling harness task", flag_values=fv)
  flags.DEFINE_integer("bootstrap", 10000, "paired bootstrap resamples", flag_values=fv)
  flags.DEFINE_integer("batch_size", 8, "requests per step", flag_values=fv)
  flags.DEFINE_string("json", None, "also write the result to this file", flag_values=fv)


def per_document(source: str, task: str, batch_size: int) -> tuple[np.ndarray, np.ndarray, float]:
  """(log-likelihood per document, UTF-8 bytes per document, the harness's bits_per_byte) of one model."""
  import lm_eval  # noqa: PLC0415 (the eval extra)

  from tformer_jax.eval import harness  # noqa: PLC0415

  kind = {"hf": source[3:]} if source.startswith("hf:") else {"workdir": source}
  lm = harness.TformerLM(batch_size=batch_size, **kind)
  res = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=harness.task_manager(include_defaults=False),
                                log_samples=True, bootstrap_iters=0)
  samples = sorted(res["samples"][task], key=lambda s: s["doc_id"])
  ll = np.array([float(np.ravel(s["filtered_resps"])[0]) for s in samples])
  nbytes = np.array([len(str(s["target"]).encode("utf-8")) for s in samples])
  return ll, nbytes, float(res["results"][task]["bits_per_byte,none"])


def bpb(ll: np.ndarray, nbytes: np.ndarray) -> float:
  return float(-ll.sum() / nbytes.sum() / math.log(2))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = cli_common.parse(argv, define_flags, doc=__doc__, prog="benchmarks/harness_paired.py")
  if not args.models or len(args.models) < 2:
    cli_common.fail("--models needs at least two models (the first is the baseline)")
  scored = {m: per_document(m, args.task, args.batch_size) for m in args.models}
  base = args.models[0]
  ll0, nb, _ = scored[base]
  rng = np.random.default_rng(0)
  idx = rng.integers(0, len(nb), (args.bootstrap, len(nb)))
  res: dict[str, Any] = {"bench": "harness_paired", "task": args.task, "documents": int(len(nb)),
                         "bytes": int(nb.sum()), "bootstrap": args.bootstrap, "baseline": base, "models": {}}
  for m, (ll, nbytes, harness_bpb) in scored.items():
    if not np.array_equal(nbytes, nb):
      raise RuntimeError(f"{m}: the documents differ from the baseline's")
    row: dict[str, Any] = {"bits_per_byte": round(bpb(ll, nb), 5), "harness_bits_per_byte": round(harness_bpb, 5)}
    if m != base:
      diff = (-(ll - ll0)[idx].sum(1) / nb[idx].sum(1)) / math.log(2)
      row["diff_vs_baseline"] = round(bpb(ll, nb) - bpb(ll0, nb), 5)
      row["diff_stderr"] = round(float(diff.std(ddof=1)), 5)
      row["docs_better"] = int(((ll - ll0) > 0).sum())
    res["models"][m] = row
  return emit(res, args.json)


if __name__ == "__main__":
  main()
