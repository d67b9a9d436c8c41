"""Data benchmark: prepare throughput, loader throughput and peak RSS while training.

  python -m tformer_jax.bench data [--stages prepare,loader,rss] [--big-gb 2] [--train-steps 100] [--json OUT]

prepare  Shakespeare's works, repeated in shuffled order to --prepare-mb MB of text (one .txt per document),
         prepared (tformer_jax.data.prepared.prepare) with each of --tokenizers at 1 and 2 workers, against
         the tokenizer library's own batch encode of the same documents in the same run
         (bench/tokenizer.py, 1 and 2 threads): MB/s of text and tokens/s.
loader   tokens/s the main config's training iterator (--config, its data section) delivers, on Shakespeare
         and on the big corpus, against the tokens/s the main config's train step consumes (the `rss`
         stage's Shakespeare run logs it: metrics.jsonl tokens_per_s; without that stage, --step-tokens-s).
rss      peak RSS (the child's ru_maxrss, from wait4) of `python -m tformer_jax.cli.train` on the main config
         for --train-steps steps (no persistent compilation cache: both compile), on Shakespeare and on a
         ~--big-gb GB prepared corpus. The big corpus is made of real documents (the works, repeated in
         shuffled order) streamed to .txt files under --tmp, then prepared with the main config's tokenizer
         (2 workers; its prepare stats are reported) and deleted at the end.

Prints one line per measurement, then one JSON line (also written to --json).
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Sequence

import numpy as np
from absl import flags

from tformer_jax import cli_common, config as config_lib
from tformer_jax.bench.tokenizer import tokenizer_ceiling
from tformer_jax.data import corpora, pipeline, prepared
from tformer_jax.data.tokenizers import get_tokenizer

STAGES = ("prepare", "loader", "rss")
RSS_BUDGET_MB = 300          # the bound: big-corpus peak RSS - Shakespeare peak RSS
LOADER_RATIO = 20            # the bound: loader tokens/s over the train step's


def _log(msg: str) -> None:
  print(msg, flush=True)


def _works(cache_dir: str | None) -> list[str]:
  return [d.decode("utf-8") for d in corpora.load_documents("shakespeare", cache_dir)]


def _repeated(docs: list[str], target_bytes: int, seed: int = 0):
  """The documents, repeated in a new shuffled order each pass, until target_bytes of UTF-8 text."""
  rng = np.random.default_rng(seed)
  done = 0
  while done < target_bytes:
    for i in rng.permutation(len(docs)):
      yield docs[i]
      done += len(docs[i].encode("utf-8"))
      if done >= target_bytes:
        return


# --- prepare ----------------------------------------------------------------------------------------

def stage_prepare(args: Any, tmp: pathlib.Path, cache_dir: str | None) -> list[dict[str, Any]]:
  works = _works(cache_dir)
  src = tmp / "prepare_src"
  src.mkdir()
  texts = []
  for i, doc in enumerate(_repeated(works, int(args.prepare_mb * 1e6))):
    (src / f"{i:06d}.txt").write_text(doc, encoding="utf-8")
    texts.append(doc)
  rows = []
  for name in [t.strip() for t in args.tokenizers.split(",") if t.strip()]:
    if name == "bpe":
      tok = get_tokenizer("bpe", corpus="".join(works).encode("utf-8"), vocab_size=args.bpe_vocab,
                          cache_dir=cache_dir)
      spec = f"spm:{tok.path}"
    else:
      tok, spec = get_tokenizer(name), name
    row: dict[str, Any] = {"tokenizer": name, "name": tok.name, "documents": len(texts),
                           "text_mb": sum(len(t.encode("utf-8")) for t in texts) / 1e6}
    for threads in (1, 2):
      c = tokenizer_ceiling(texts, tok, threads=threads)
      row[f"ceiling_{threads}t"] = {k: c[k] for k in ("mb_per_s", "tokens_per_s", "seconds")}
      _log(f"  ceiling   {name:5s} {threads} thread(s): {c['mb_per_s']:8.2f} MB/s {c['tokens_per_s']:12,.0f} tok/s")
    for workers in (1, 2):
      out = tmp / f"prepared_{name}_{workers}"
      s = prepared.prepare([str(src)], out, tokenizer=spec, workers=workers, progress=False)
      row[f"prepare_{workers}w"] = {k: s[k] for k in ("mb_per_s", "tokens_per_s", "seconds", "peak_rss_mb",
                                                      "worker_peak_rss_mb", "tokens")}
      _log(f"  prepare   {name:5s} {workers} worker(s): {s['mb_per_s']:8.2f} MB/s {s['tokens_per_s']:12,.0f} tok/s"
           f"  ({s['seconds']:.1f} s, peak RSS {s['peak_rss_mb']:.0f} MB)")
      shutil.rmtree(out, ignore_errors=True)
    p1, p2 = row["prepare_1w"]["mb_per_s"], row["prepare_2w"]["mb_per_s"]
    row["speedup_2w_over_1w"] = p2 / max(p1, 1e-9)
    row["prepare_2w_over_ceiling_2t"] = p2 / max(row["ceiling_2t"]["mb_per_s"], 1e-9)
    row["prepare_1w_over_ceiling_1t"] = p1 / max(row["ceiling_1t"]["mb_per_s"], 1e-9)
    _log(f"  {name}: 2 workers / 1 worker {row['speedup_2w_over_1w']:.2f}x; prepare 2w / ceiling 2t "
         f"{row['prepare_2w_over_ceiling_2t']:.2f}; 1w / 1t {row['prepare_1w_over_ceiling_1t']:.2f}")
    rows.append(row)
  shutil.rmtree(src, ignore_errors=True)
  return rows


# --- the big corpus ---------------------------------------------------------------------------------

def make_big_corpus(args: Any, cfg: Any, tmp: pathlib.Path, cache_dir: str | None) -> tuple[pathlib.Path,
                                                                                                dict[str, Any]]:
  """A ~args.big_gb GB prepared corpus of real documents (the works, repeated shuffled) with the main
  config's tokenizer; the source (one .txt per document) is streamed to disk (never held whole) and deleted."""
  works = _works(cache_dir)
  tok_spec = str(cfg.data.tokenizer)
  if tok_spec == "bpe":
    tok = get_tokenizer("bpe", corpus="".join(works).encode("utf-8"), vocab_size=int(cfg.data.bpe_vocab_size),
                        cache_dir=cache_dir)
    tok_spec = f"spm:{tok.path}"
    per_byte = len(tok.encode(works[0])) / len(works[0].encode("utf-8"))
  else:
    tok = get_tokenizer(tok_spec)
    per_byte = 1.0 if tok_spec == "byte" else len(tok.encode(works[0])) / len(works[0].encode("utf-8"))
  itemsize = prepared.token_dtype(tok.vocab_size).itemsize
  text_bytes = int(args.big_gb * 1e9 / (per_byte * itemsize))
  src = tmp / "big_src"
  t0 = time.perf_counter()
  files = 0
  for files, doc in enumerate(_repeated(works, text_bytes, seed=1), 1):   # one .txt per document
    path = src / f"{(files - 1) // 1000:04d}" / f"{(files - 1) % 1000:03d}.txt"
    if (files - 1) % 1000 == 0:
      path.parent.mkdir(parents=True)
    path.write_text(doc, encoding="utf-8")
  _log(f"  big corpus: {text_bytes / 1e9:.2f} GB of text in {files} .txt files ({time.perf_counter() - t0:.0f} s)")
  out = tmp / "big_prepared"
  stats = prepared.prepare([str(src)], out, tokenizer=tok_spec, workers=2, progress=False)
  shutil.rmtree(src, ignore_errors=True)
  disk = sum(p.stat().st_size for p in out.iterdir())
  info = {"prepared_gb": disk / 1e9, "tokens": stats["tokens"], "documents": stats["documents"],
          "prepare_seconds": stats["seconds"], "prepare_mb_per_s": stats["mb_per_s"],
          "prepare_peak_rss_mb": stats["peak_rss_mb"], "prepare_worker_peak_rss_mb": stats["worker_peak_rss_mb"]}
  _log(f"  big corpus prepared: {disk / 1e9:.2f} GB on disk, {stats['tokens']:,} tokens, {stats['documents']:,} "
       f"documents, {stats['mb_per_s']:.1f} MB/s with 2 workers, peak RSS {stats['peak_rss_mb']:.0f} MB "
       f"(workers {stats['worker_peak_rss_mb']:.0f} MB)")
  return out, info


# --- loader -----------------------------------------------------------------------------------------

def loader_tokens_per_s(data_cfg: Any, batches: int) -> dict[str, Any]:
  ds = pipeline.build_dataset(data_cfg)
  it = pipeline.train_iterator(ds, data_cfg)
  for _ in range(20):
    next(it)
  t0 = time.perf_counter()
  for _ in range(batches):
    b = next(it)
  dt = time.perf_counter() - t0
  it.close()
  tokens = batches * b["inputs"].size
  return {"batches": batches, "seconds": dt, "tokens_per_s": tokens / dt, "batches_per_s": batches / dt,
          "keys": sorted(b)}


# --- rss --------------------------------------------------------------------------------------------

def train_peak_rss(args: Any, corpus: str, workdir: pathlib.Path) -> dict[str, Any]:
  """Train the main config on `corpus` for args.train_steps steps in a child; its peak RSS and speed."""
  steps = int(args.train_steps)
  cmd = [sys.executable, "-m", "tformer_jax.cli.train", f"--config={args.config}", f"--workdir={workdir}",
         f"--config.data.corpus={corpus}", f"--config.train.steps={steps}",
         f"--config.train.eval_every={steps}", f"--config.train.ckpt_every={steps}",
         "--config.train.sample_tokens=0", f"--config.train.log_every={max(1, steps // 8)}",
         f"--config.optim.warmup_steps={min(100, steps // 2)}"]
  t0 = time.perf_counter()
  with open(workdir.parent / f"{workdir.name}.log", "w") as log:
    # both runs compile from scratch: a persistent-cache hit would spare the second run XLA's compile memory
    env = {**os.environ, "JAX_ENABLE_COMPILATION_CACHE": "false"}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
  proc.returncode = os.waitstatus_to_exitcode(status)
  seconds = time.perf_counter() - t0
  if proc.returncode != 0:
    tail = (workdir.parent / f"{workdir.name}.log").read_text()[-2000:]
    raise RuntimeError(f"training on {corpus} failed (exit {proc.returncode}):\n{tail}")
  rates = []
  metrics = workdir / "metrics.jsonl"
  for line in metrics.read_text().splitlines():
    m = json.loads(line)
    if "tokens_per_s" in m:
      rates.append(float(m["tokens_per_s"]))
  val = [json.loads(line).get("val_loss") for line in metrics.read_text().splitlines()]
  return {"corpus": corpus, "steps": steps, "peak_rss_mb": usage.ru_maxrss / 1024, "seconds": seconds,
          "train_tokens_per_s": statistics.median(rates[1:] or rates), "val_loss": [v for v in val if v][-1]}


# --- main -------------------------------------------------------------------------------------------

def define_flags(fv: flags.FlagValues) -> None:
  flags.DEFINE_string("stages", ",".join(STAGES), f"comma-separated, from {', '.join(STAGES)}", flag_values=fv)
  flags.DEFINE_string("config", "shakespeare_char", "the main config (a path or a shipped name)", flag_values=fv)
  flags.DEFINE_float("prepare-mb", 20.0, "prepare stage: MB of text", lower_bound=0.0, flag_values=fv)
  flags.DEFINE_string("tokenizers", "bpe,byte", "prepare stage: tokenizers (bpe = trained on Shakespeare)",
                      flag_values=fv)
  flags.DEFINE_integer("bpe-vocab", 8192, "prepare stage: the BPE's vocabulary", lower_bound=1, flag_values=fv)
  flags.DEFINE_float("big-gb", 2.0, "size of the big prepared corpus on disk (GB)", lower_bound=0.0, flag_values=fv)
  flags.DEFINE_integer("train-steps", 100, "rss stage: training steps per run", lower_bound=1, flag_values=fv)
  flags.DEFINE_integer("loader-batches", 1000, "loader stage: timed batches", lower_bound=1, flag_values=fv)
  flags.DEFINE_float("step-tokens-s", 0.0, "loader stage without the rss stage: the train step's tokens/s",
                     lower_bound=0.0, flag_values=fv)
  flags.DEFINE_string("tmp", "/tmp", "where the big corpus is written (and deleted)", flag_values=fv)
  flags.DEFINE_string("json", "", "also write the result dict to this file", flag_values=fv)


def parse_args(argv: Sequence[str] | None) -> Any:
  return cli_common.parse(argv, define_flags, doc=__doc__, prog="python -m tformer_jax.bench data")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = parse_args(argv)
  stages = cli_common.choices(args.stages, STAGES, "stage")
  args.config = str(cli_common.find_config_file(args.config).resolve())
  cfg = cli_common.load_named_config(args.config)
  config_lib.validate(cfg)
  cache_dir = str(cfg.data.cache_dir) or None
  free = shutil.disk_usage(args.tmp).free / 1e9
  need = args.big_gb * 1.6 if ("loader" in stages or "rss" in stages) else 0.5
  if free < need + 1:
    cli_common.fail(f"--tmp {args.tmp} has {free:.1f} GB free; the big corpus needs about {need:.1f} GB "
                    "(lower --big-gb or pick another --tmp)")
  result: dict[str, Any] = {"config": {k: v for k, v in vars(args).items() if k != "json"},
                            "cpu_count": os.cpu_count()}
  tmp = pathlib.Path(tempfile.mkdtemp(dir=args.tmp, prefix="tformer_bench_data-"))
  try:
    if "prepare" in stages:
      _log(f"prepare: {args.prepare_mb:.0f} MB of Shakespeare's works, tokenizers {args.tokenizers}")
      result["prepare"] = stage_prepare(args, tmp, cache_dir)
    if "loader" in stages or "rss" in stages:
      _log(f"big corpus: ~{args.big_gb} GB prepared, tokenizer {cfg.data.tokenizer}, under {tmp}")
      big, result["big_corpus"] = make_big_corpus(args, cfg, tmp, cache_dir)
    if "rss" in stages:
      _log(f"rss: {args.config}, {args.train_steps} steps, Shakespeare then the big corpus")
      small = train_peak_rss(args, str(cfg.data.corpus), tmp / "run_small")
      _log(f"  {small['corpus']}: peak RSS {small['peak_rss_mb']:.0f} MB, {small['train_tokens_per_s']:,.0f} "
           f"tok/s, val_loss {small['val_loss']:.3f}, {small['seconds']:.0f} s")
      large = train_peak_rss(args, f"prepared:{big}", tmp / "run_big")
      _log(f"  big corpus: peak RSS {large['peak_rss_mb']:.0f} MB, {large['train_tokens_per_s']:,.0f} tok/s, "
           f"val_loss {large['val_loss']:.3f}, {large['seconds']:.0f} s")
      delta = large["peak_rss_mb"] - small["peak_rss_mb"]
      result["rss"] = {"shakespeare": small, "big": large, "delta_mb": delta, "budget_mb": RSS_BUDGET_MB,
                       "meets": delta <= RSS_BUDGET_MB}
      _log(f"  peak RSS big - Shakespeare: {delta:+.0f} MB (budget {RSS_BUDGET_MB} MB: "
           f"{'met' if delta <= RSS_BUDGET_MB else 'MISSED'})")
    if "loader" in stages:
      step = result.get("rss", {}).get("shakespeare", {}).get("train_tokens_per_s") or args.step_tokens_s
      rows = {}
      for name, corpus in (("shakespeare", str(cfg.data.corpus)), ("big", f"prepared:{big}")):
        data_cfg = cli_common.load_named_config(args.config).data
        data_cfg.corpus = corpus
        rows[name] = loader_tokens_per_s(data_cfg, args.loader_batches)
        ratio = rows[name]["tokens_per_s"] / step if step else None
        rows[name]["over_train_step"] = ratio
        _log(f"  loader {name}: {rows[name]['tokens_per_s']:12,.0f} tok/s ({rows[name]['batches_per_s']:.0f} "
             f"batches/s)" + (f" = {ratio:.0f}x the train step's {step:,.0f} tok/s" if ratio else ""))
      result["loader"] = {"train_step_tokens_per_s": step, **rows, "ratio_bound": LOADER_RATIO,
                          "meets": all((r["over_train_step"] or 0) >= LOADER_RATIO for r in rows.values())
                          if step else None}
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  line = json.dumps(result)
  print(line, flush=True)
  if args.json:
    with open(args.json, "w") as fh:
      fh.write(line + "\n")
  return result


if __name__ == "__main__":
  sys.exit(cli_common.run_main(main))
