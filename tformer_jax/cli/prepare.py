"""Tokenize text sources once into a prepared dataset (sharded token ids + document offsets + manifest).

  tformer-prepare --source=DATA --out=DIR --tokenizer=bpe [--field=title --field=paragraphs] [--workers=2]
  python -m tformer_jax.cli.prepare ...    (the same)

Sources (--source, repeatable; a file, a directory or a glob pattern): .txt (one document per file, line or
paragraph: --txt_split), .jsonl / .ndjson, .json arrays, .parquet (pyarrow), a `datasets` directory from
save_to_disk (datasets); .gz after any file extension. Structured records take their text from --field /
--column (the same spec: key paths `a.b`, several joined with newlines, lists joined with newlines).
Tokenizers: byte | bpe (a sentencepiece BPE trained on a --train_tokenizer_sample_mb sample of the sources) |
spm:MODEL | hf:tokenizer.json. A rerun of an interrupted command resumes it; the output is byte-identical for
any --workers. `--verify=DIR` checks an existing prepared dataset's checksums; `--benchmark` also measures
the tokenizer library's own batch encode on a sample of the same text (the throughput ceiling).
Training reads the result with data.corpus='prepared:DIR'.
"""
from __future__ import annotations

import json
import logging
import sys
from typing import Any, Sequence

from absl import flags

from tformer_jax import cli_common
from tformer_jax.bench.tokenizer import tokenizer_ceiling
from tformer_jax.data import prepared, sources as sources_lib


def define_flags(fv: flags.FlagValues) -> None:
  flags.DEFINE_multi_string("source", [], "input file, directory or glob pattern (repeatable)", flag_values=fv)
  flags.DEFINE_string("out", None, "output directory of the prepared dataset", flag_values=fv)
  flags.DEFINE_string("tokenizer", "bpe", "byte | bpe | spm:MODEL | hf:tokenizer.json", flag_values=fv)
  flags.DEFINE_multi_string("field", [], "text field of JSON records: a key path a.b; repeat (or comma-separate) to "
                            "join several with newlines", flag_values=fv)
  flags.DEFINE_multi_string("column", [], "text column of Parquet / datasets records (same spec as --field)",
                            flag_values=fv)
  flags.DEFINE_integer("workers", 1, "processes that tokenize: this one and workers - 1 spawned", lower_bound=1,
                       flag_values=fv)
  flags.DEFINE_integer("shard_tokens", prepared.DEFAULT_SHARD_TOKENS, "a shard closes once it holds this many "
                       "tokens", lower_bound=1, flag_values=fv)
  flags.DEFINE_enum("on_bad_utf8", "skip", ["skip", "fail"], "a document that is not UTF-8: skip it (counted in "
                    "the manifest) or stop with an error naming it", flag_values=fv)
  flags.DEFINE_enum("txt_split", "file", list(sources_lib.TXT_SPLITS), ".txt documents: one per file, per "
                    "non-empty line, or per paragraph (blank-line separated)", flag_values=fv)
  flags.DEFINE_integer("bpe_vocab_size", prepared.DEFAULT_BPE_VOCAB, "vocabulary of the bpe tokenizer",
                       lower_bound=1, flag_values=fv)
  flags.DEFINE_float("train_tokenizer_sample_mb", prepared.DEFAULT_SAMPLE_BYTES / 1e6, "MB of text (spread over "
                     "the sources) the bpe tokenizer is trained on", lower_bound=0.001, flag_values=fv)
  flags.DEFINE_bool("overwrite", False, "replace a prepared dataset (or unfinished prepare) made with other "
                    "arguments", flag_values=fv)
  flags.DEFINE_bool("progress", True, "show a progress bar (documents, tokens, MB/s)", flag_values=fv)
  flags.DEFINE_string("cache_dir", None, "cache for trained tokenizers (default $TFORMER_CACHE or "
                      "~/.cache/tformer_jax)", flag_values=fv)
  flags.DEFINE_string("verify", None, "only check the prepared dataset DIR (manifest, sizes, sha256s) and exit",
                      flag_values=fv)
  flags.DEFINE_bool("benchmark", False, "after preparing, measure the tokenizer's own batch encode on a sample "
                    "of the same text at 1 and --workers threads", flag_values=fv)
  flags.DEFINE_float("benchmark_mb", 20.0, "MB of text the --benchmark ceiling encodes", lower_bound=0.001,
                     flag_values=fv)
  flags.DEFINE_string("json", None, "also write the stats as JSON to this file", flag_values=fv)


def benchmark_ceiling(stats: dict[str, Any], sources: Sequence[str], *, fields: Any, txt_split: str,
                      sample_bytes: int, threads: Sequence[int]) -> dict[str, Any]:
  """The prepared dataset's tokenizer's batch-encode ceiling on a sample of the sources, beside `stats`."""
  ds = prepared.open_prepared(stats["path"])
  srcs = sources_lib.resolve_sources(sources)
  texts = prepared.sample_texts(srcs, sources_lib.parse_fields(fields), max_bytes=sample_bytes, txt_split=txt_split)
  tok = ds.tokenizer()
  out = {}
  for n in dict.fromkeys(threads):
    c = tokenizer_ceiling(texts, tok, threads=n)
    out[f"{n}t"] = c
    print(f"ceiling: {tok.name} batch encode on {n} thread(s): {c['mb_per_s']:.2f} MB/s, "
          f"{c['tokens_per_s']:,.0f} tokens/s ({c['bytes'] / 1e6:.1f} MB)")
  return out


def run(argv: Sequence[str] | None = None) -> int:
  args = cli_common.parse(argv, define_flags, doc=__doc__, prog="tformer-prepare")
  cli_common.setup_logging(logging.INFO, "%(message)s")
  if args.verify:
    ds = prepared.open_prepared(args.verify, verify=True)
    print(f"ok: {ds.path}: {ds.num_documents:,} documents, {ds.num_tokens:,} tokens in {len(ds.shards)} shards, "
          f"checksums match")
    return 0
  if not args.source:
    raise cli_common.UsageError("pass at least one --source (a file, directory or glob pattern)")
  if not args.out:
    raise cli_common.UsageError("pass --out=DIR, the directory of the prepared dataset")
  if args.field and args.column:
    raise cli_common.UsageError("pass the text as --field (JSON) or --column (Parquet / datasets), not both")
  stats = prepared.prepare(
      args.source, args.out, tokenizer=args.tokenizer, text_field=args.field or None, column=args.column or None,
      workers=args.workers, shard_tokens=args.shard_tokens, on_bad_utf8=args.on_bad_utf8,
      bpe_vocab_size=args.bpe_vocab_size, train_tokenizer_sample_bytes=int(args.train_tokenizer_sample_mb * 1e6),
      txt_split=args.txt_split, overwrite=args.overwrite, progress=args.progress, cache_dir=args.cache_dir)
  skipped = stats["skipped"]
  print(f"prepared {stats['path']}: {stats['documents']:,} documents, {stats['tokens']:,} tokens, "
        f"{stats['shards']} shards; skipped {skipped['not_utf8']} not UTF-8, {skipped['empty']} empty; "
        f"{stats['mb_per_s']:.2f} MB/s of text, {stats['tokens_per_s']:,.0f} tokens/s with {stats['workers']} "
        f"worker(s); peak RSS {stats['peak_rss_mb']:.0f} MB (workers {stats['worker_peak_rss_mb']:.0f} MB)")
  if args.benchmark:
    stats["ceiling"] = benchmark_ceiling(stats, args.source, fields=args.field or args.column or None,
                                         txt_split=args.txt_split, sample_bytes=int(args.benchmark_mb * 1e6),
                                         threads=(1, args.workers))
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(stats, f, indent=1)
  print(json.dumps(stats))
  return 0


def main(argv: Sequence[str] | None = None) -> int:
  """The command (`tformer-prepare`): anticipated errors (a full or read-only disk, Ctrl-C included) are one
  line on stderr and status 2."""
  try:
    return cli_common.run_main(run, argv)
  except KeyboardInterrupt:
    sys.stdout.flush()
    print("error: interrupted (SIGINT): the committed shards are kept; rerun the same command to resume",
          file=sys.stderr)
    return 2


def entry() -> None:
  """The console command, as tformer_jax/cli/*.py spell it."""
  sys.exit(main())


if __name__ == "__main__":
  entry()

