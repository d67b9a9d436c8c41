"""`prepare`: text sources tokenized into a prepared dataset (see the package docstring), resumable and
byte-identical for any worker count."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import resource
import time
from typing import Any, Sequence

import numpy as np
import tqdm

from tformer_jax.data import sources as sources_lib
from tformer_jax.data.corpora import DataError, sha256_file, write_atomic
from tformer_jax.data.prepared.dataset import (
  FORMAT,
  MANIFEST,
  PROGRESS,
  TOKENIZER_EXTRAS,
  convention,
  json_of,
  open_prepared,
  token_dtype,
)
from tformer_jax.data.prepared.outdir import (
  Lock,
  check_committed,
  check_out_dir,
  clean_partials,
  clear,
  disk_error,
  exchange_dirs,
  link_target,
  ours,
  partial_dir,
  refuse_foreign,
  remove_ours,
)
from tformer_jax.data.prepared.workers import Pool, Recipe, results
from tformer_jax.data.prepared.writer import ShardWriter, fsync_dir, write_file
from tformer_jax.data.sources import Position
from tformer_jax.data.tokenizers import SentencePieceTokenizer, get_tokenizer

log = logging.getLogger(__name__)

DEFAULT_SHARD_TOKENS = 1 << 24
DEFAULT_BPE_VOCAB = 8192
DEFAULT_SAMPLE_BYTES = 20_000_000


def _tokenizer_kind(spec: str) -> str:
  spec = spec.strip()
  if spec == "byte":
    return "byte"
  if spec == "bpe" or spec.startswith("spm:"):
    return "spm"
  if spec.startswith("hf:"):
    return "hf"
  get_tokenizer(spec)        # raises the one-line error naming the known specs
  raise AssertionError(spec)


def sample_texts(srcs: Sequence[sources_lib.Source], fields: sources_lib.Fields, *, max_bytes: int,
                 txt_split: str = "file", on_bad_utf8: str = "skip", seed: int = 0) -> list[str]:
  """About `max_bytes` of document text spread evenly over all sources (deterministic for a seed): each
  document is kept with probability p = max_bytes / (the sources' text), the text estimated from their size
  on disk times the text share of the units read so far (JSON syntax is not text). Only units kept with
  probability min(1, 8p) are parsed (their documents then with p / that), so a small sample of a large
  corpus reads a small part of it."""
  total = sum(s.bytes for s in srcs) or 1
  rng = np.random.default_rng(seed)
  out, size, seen_input, seen_text = [], 0, 0, 0
  for unit in sources_lib.iter_units(srcs, fields, txt_split=txt_split):
    share = seen_text / seen_input if seen_input else 1.0
    p = min(1.0, max_bytes / max(total * share, 1.0))
    q = min(1.0, 8 * p)
    if q < 1.0 and rng.random() >= q:
      continue
    unit_text = 0
    for doc in sources_lib.unit_documents(unit, fields, on_bad_utf8, txt_split):
      if not isinstance(doc, str):
        continue
      n = len(doc.encode("utf-8"))
      unit_text += n
      if p >= 1.0 or rng.random() < p / q:
        out.append(doc)
        size += n
        if size >= max_bytes:
          return out
    if unit.input_bytes:
      seen_input += unit.input_bytes
      seen_text += unit_text
  return out


def _setup_tokenizer(spec: str, srcs: Sequence[sources_lib.Source], fields: sources_lib.Fields, *,
                     bpe_vocab_size: int, sample_bytes: int, txt_split: str, on_bad_utf8: str,
                     cache_dir: str | os.PathLike | None) -> tuple[Any, pathlib.Path | None, dict[str, Any]]:
  """(tokenizer, its file, extra manifest info); 'bpe' is trained on a sample of the sources."""
  kind = _tokenizer_kind(spec)
  extra: dict[str, Any] = {}
  if spec.strip() == "bpe":
    texts = sample_texts(srcs, fields, max_bytes=sample_bytes, txt_split=txt_split, on_bad_utf8=on_bad_utf8)
    corpus = "\n".join(texts).encode("utf-8")
    if not corpus.strip():
      raise DataError("empty dataset: the sources hold no text to train the bpe tokenizer on")
    log.info("training a %d-token BPE on a %.1f MB sample of %d documents", bpe_vocab_size, len(corpus) / 1e6,
             len(texts))
    tok = SentencePieceTokenizer.train(corpus, bpe_vocab_size, cache_dir)
    extra = {"trained_on": {"documents": len(texts), "bytes": len(corpus)}}
  else:
    tok = get_tokenizer(spec)
  file = getattr(tok, "path", None) if kind != "byte" else None
  return tok, file, extra


def _arguments(srcs: Sequence[sources_lib.Source], fields: sources_lib.Fields, tokenizer: str, *,
               shard_tokens: int, on_bad_utf8: str, txt_split: str, bpe_vocab_size: int,
               sample_bytes: int) -> dict[str, Any]:
  """Everything the output depends on (a rerun must match it to resume)."""
  args: dict[str, Any] = {
      "format": FORMAT, "sources": [dict(s.describe(), mtime_ns=s.mtime_ns) for s in srcs],
      "fields": sources_lib.fields_text(fields), "txt_split": txt_split, "tokenizer": tokenizer.strip(),
      "shard_tokens": shard_tokens, "on_bad_utf8": on_bad_utf8}
  spec = tokenizer.strip()
  if spec == "bpe":
    args.update(bpe_vocab_size=bpe_vocab_size, train_tokenizer_sample_bytes=sample_bytes)
  elif spec.startswith(("spm:", "hf:")):
    path = pathlib.Path(spec.split(":", 1)[1]).expanduser()
    if spec.startswith("hf:") and path.is_dir():
      path = path / "tokenizer.json"
    args["tokenizer_sha256"] = sha256_file(path) if path.is_file() else None
  return args


def _peak_rss_mb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def prepare(sources: Sequence[str] | str, out_dir: str | os.PathLike, *, tokenizer: str,
            text_field: str | Sequence[str] | None = None, column: str | Sequence[str] | None = None,
            workers: int = 1, shard_tokens: int = DEFAULT_SHARD_TOKENS, on_bad_utf8: str = "skip",
            bpe_vocab_size: int = DEFAULT_BPE_VOCAB, train_tokenizer_sample_bytes: int = DEFAULT_SAMPLE_BYTES,
            txt_split: str = "file", overwrite: bool = False, progress: bool = True,
            cache_dir: str | os.PathLike | None = None, unit_bytes: int = sources_lib.BLOCK_BYTES) -> dict[str, Any]:
  """Tokenize `sources` into the prepared dataset `out_dir` (see the package docstring); resumes an
  interrupted run with the same arguments. `workers` processes tokenize: this one and workers - 1 spawned;
  each task is about `unit_bytes` of input (this changes nothing in the output).
  Returns stats: documents, tokens, bytes (UTF-8 text), seconds (all), tokenizer_seconds (sampling and BPE
  training), encode_seconds (the rest: reading, tokenizing, writing; worker start-up not hidden by the
  tokenizer's), mb_per_s and tokens_per_s (over encode_seconds), skipped, peak_rss_mb (this process),
  worker_peak_rss_mb (the largest spawned process; 0 with 1 worker), shards, resumed."""
  t0 = time.perf_counter()
  if on_bad_utf8 not in ("skip", "fail"):
    raise DataError(f"on_bad_utf8 must be 'skip' or 'fail', got {on_bad_utf8!r}")
  if workers < 1:
    raise DataError(f"workers must be >= 1, got {workers}")
  if shard_tokens < 1:
    raise DataError(f"shard_tokens must be >= 1, got {shard_tokens}")
  if text_field is not None and column is not None:
    raise DataError("pass the text field(s) as text_field (--field) or column (--column), not both")
  if txt_split not in sources_lib.TXT_SPLITS:
    raise DataError(f"txt_split must be one of {', '.join(sources_lib.TXT_SPLITS)}, got {txt_split!r}")
  kind = _tokenizer_kind(tokenizer)
  fields = sources_lib.parse_fields(text_field if text_field is not None else column)
  srcs = sources_lib.resolve_sources(sources)
  sources_lib.check_fields(srcs, fields)
  root = link_target(pathlib.Path(out_dir).expanduser())   # a symlinked --out: its target is written
  # an output inside a source directory: its own files (manifest.json, ...) are not sources
  srcs = [s for s in srcs if not (root.absolute() in pathlib.Path(s.path).parents and ours(pathlib.Path(s.path).name))]
  if not srcs:
    raise DataError(f"no sources besides the output {root}'s own files")
  args = _arguments(srcs, fields, tokenizer, shard_tokens=shard_tokens, on_bad_utf8=on_bad_utf8,
                    txt_split=txt_split, bpe_vocab_size=bpe_vocab_size, sample_bytes=train_tokenizer_sample_bytes)
  refuse_foreign(root)                            # before creating anything (the lock) in it
  created = not root.exists()
  try:
    root.mkdir(parents=True, exist_ok=True)
    lock = Lock(root).acquire()
  except OSError as e:
    found = json_of(root / MANIFEST) if (root / MANIFEST).is_file() else None
    if not overwrite and isinstance(found, dict) and found.get("arguments") == args:
      return _already_prepared(root, workers)      # finished, on a read-only disk: nothing to write
    raise disk_error(root, e) from None
  done = started = False
  try:
    clean_partials(root)                          # a killed --overwrite's replacement (its pid gone)
    state = check_out_dir(root, args, overwrite)
    if state is not None and state.get("complete"):
      done = True
      return _already_prepared(root, workers)
    target = root
    if state is not None and state.get("overwrite"):   # build beside it, then exchange the two
      target = partial_dir(root)
      state = None
    started = target == root
    pool = Pool(workers)
    try:
      stats = _prepare(srcs, target, fields, args, state, pool, t0, tokenizer=tokenizer, kind=kind,
                       workers=workers, shard_tokens=shard_tokens, on_bad_utf8=on_bad_utf8,
                       bpe_vocab_size=bpe_vocab_size, sample_bytes=train_tokenizer_sample_bytes,
                       txt_split=txt_split, progress=progress, cache_dir=cache_dir, unit_bytes=unit_bytes)
    except BaseException:
      if target != root:
        remove_ours(target)
      raise
    finally:
      pool.shutdown()
    if target != root:
      exchange_dirs(target, root)
      remove_ours(target)                         # the replaced dataset (all ours: checked above)
      fsync_dir(root.parent)
      stats["path"] = str(root)
    log.info("prepared %s: %d documents, %d tokens in %d shards (%.1f MB/s of text, %.1f s)", root,
             stats["documents"], stats["tokens"], stats["shards"], stats["mb_per_s"], stats["seconds"])
    done = True
    return stats
  except OSError as e:
    raise disk_error(root, e) from None
  finally:
    _release(root, lock, done, started and not done, created)


def _release(root: pathlib.Path, lock: Lock, done: bool, failed: bool, created: bool) -> None:
  """A finished dataset is owned by its manifest, an unfinished one by its progress: the lock file goes.
  A run that failed before its first commit leaves nothing of its own (a directory it created goes too)."""
  try:
    if failed and not (root / PROGRESS).is_file() and not (root / MANIFEST).is_file():
      clear(root)
    lock.release(remove=True)
    if created and not done and not any(root.iterdir()):
      root.rmdir()
  except OSError as e:
    log.warning("prepare %s: could not tidy up (%s)", root, e)


def _already_prepared(root: pathlib.Path, workers: int) -> dict[str, Any]:
  ds = open_prepared(root)
  log.info("%s is already prepared with these arguments (%d documents, %d tokens)", root, ds.num_documents,
           ds.num_tokens)
  return {"documents": ds.num_documents, "tokens": ds.num_tokens, "bytes": 0, "seconds": 0.0, "mb_per_s": 0.0,
          "tokens_per_s": 0.0, "skipped": ds.manifest["skipped_documents"], "peak_rss_mb": _peak_rss_mb(),
          "worker_peak_rss_mb": 0.0, "shards": len(ds.shards), "workers": workers, "resumed": False,
          "already_prepared": True, "path": str(root)}


def _prepare(srcs: Sequence[sources_lib.Source], root: pathlib.Path, fields: sources_lib.Fields,
             args: dict[str, Any], state: dict[str, Any] | None, pool: Pool, t0: float, *, tokenizer: str, kind: str,
             workers: int, shard_tokens: int, on_bad_utf8: str, bpe_vocab_size: int, sample_bytes: int,
             txt_split: str, progress: bool, cache_dir: str | os.PathLike | None, unit_bytes: int) -> dict[str, Any]:
  resumed = state is not None
  if state is None:
    tok, file, extra = _setup_tokenizer(tokenizer, srcs, fields, bpe_vocab_size=bpe_vocab_size,
                                        sample_bytes=sample_bytes, txt_split=txt_split,
                                        on_bad_utf8=on_bad_utf8, cache_dir=cache_dir)
    dtype = token_dtype(tok.vocab_size)
    copy, extras = None, {}
    if file is not None:
      copy = "tokenizer.json" if kind == "hf" else "tokenizer.model"
      write_file(root / copy, pathlib.Path(file).read_bytes())
      for name in TOKENIZER_EXTRAS if kind == "hf" else ():     # its chat template and special tokens travel too
        if (pathlib.Path(file).parent / name).is_file():
          write_file(root / name, (pathlib.Path(file).parent / name).read_bytes())
          extras[name] = sha256_file(root / name)
    info = {"spec": tokenizer.strip(), "name": tok.name, "vocab_size": int(tok.vocab_size),
            "sha256": sha256_file(root / copy) if copy else hashlib.sha256(tok.name.encode()).hexdigest(),
            "file": copy, **({"extra_files": extras} if extras else {}), **extra}
    state = {"arguments": args, "tokenizer": info, "eos_id": tok.eos_id, "bos_id": tok.bos_id,
             "dtype": dtype.name, "shards": [], "next": {"position": Position().as_dict(), "record": 0},
             "counts": {"documents": 0, "tokens": 0, "not_utf8": 0, "empty": 0}}
    write_atomic(root / PROGRESS, json.dumps(state, indent=1).encode())
  else:
    check_committed(root, state)
    log.info("resuming the prepare of %s after %d shards (%d documents)", root, len(state["shards"]),
             state["counts"]["documents"])
  info = state["tokenizer"]
  dtype = np.dtype(state["dtype"])
  recipe = Recipe(kind, str(root / info["file"]) if info["file"] else None, state["eos_id"], dtype.str, fields,
                   on_bad_utf8, txt_split)
  writer = ShardWriter(root, dtype, shard_tokens, state)
  start = Position(**state["next"]["position"])
  skip_first = int(state["next"]["record"])
  total_input = sum(s.bytes for s in srcs)
  done_input = sum(s.bytes for s in srcs[:start.source]) + start.offset * (srcs[start.source].format in
                                                                             ("txt", "jsonl"))
  text_bytes, worker_rss_kb, tokens_before = 0, 0, state["counts"]["tokens"]
  bar = tqdm.tqdm(total=total_input, initial=done_input, unit="B", unit_scale=True, disable=not progress,
                  desc=f"prepare {root.name}", dynamic_ncols=True, leave=True)
  t_run = time.perf_counter()
  try:
    units = sources_lib.iter_units(srcs, fields, txt_split=txt_split, start=start, block_bytes=unit_bytes)
    for position, input_bytes, (tokens, lengths, nbytes, rss_kb) in results(units, pool, recipe):
      writer.add(position, tokens, lengths, skip_first if position == start else 0)
      text_bytes += nbytes
      worker_rss_kb = max(worker_rss_kb, rss_kb)
      if progress:
        dt = max(time.perf_counter() - t_run, 1e-9)
        counts = state["counts"]
        bar.set_postfix_str(f"docs {counts['documents'] + sum(len(x) for x in writer.lengths):,} "
                            f"tokens {counts['tokens'] + writer.tokens:,} text {text_bytes / 1e6 / dt:.1f} MB/s",
                            refresh=False)
        bar.update(input_bytes)
    writer.close(None)
  finally:
    bar.close()
  counts = state["counts"]
  if counts["documents"] == 0:
    clear(root)
    raise DataError(f"empty dataset: the sources ({', '.join(s.path for s in srcs[:3])}"
                    f"{', ...' if len(srcs) > 3 else ''}) hold no documents ({counts['empty']} empty, "
                    f"{counts['not_utf8']} not UTF-8 skipped)")
  if counts["not_utf8"]:
    log.warning("skipped %d documents that are not valid UTF-8 (on_bad_utf8=skip)", counts["not_utf8"])
  manifest = {
      "format": FORMAT, "dtype": dtype.name, "tokenizer": state["tokenizer"], "eos_id": state["eos_id"],
      "bos_id": state["bos_id"], "convention": convention(state["eos_id"]),
      "num_documents": counts["documents"], "num_tokens": counts["tokens"],
      "skipped_documents": {"not_utf8": counts["not_utf8"], "empty": counts["empty"]},
      "sources": [s.describe() for s in srcs], "text_field": sources_lib.fields_text(fields) or None,
      "txt_split": txt_split, "shard_tokens": shard_tokens, "shards": state["shards"], "arguments": args}
  write_file(root / MANIFEST, (json.dumps(manifest, indent=1, ensure_ascii=False) + "\n").encode("utf-8"))
  (root / PROGRESS).unlink(missing_ok=True)
  fsync_dir(root)
  seconds = time.perf_counter() - t0
  run_seconds = max(time.perf_counter() - t_run, 1e-9)
  stats = {"documents": counts["documents"], "tokens": counts["tokens"], "bytes": text_bytes,
           "seconds": seconds, "tokenizer_seconds": t_run - t0, "encode_seconds": run_seconds,
           "mb_per_s": text_bytes / 1e6 / run_seconds,
           "tokens_per_s": (counts["tokens"] - tokens_before) / run_seconds,
           "skipped": manifest["skipped_documents"], "peak_rss_mb": _peak_rss_mb(),
           "worker_peak_rss_mb": worker_rss_kb / 1024,
           "shards": len(state["shards"]), "workers": workers, "units": dict(pool.units), "resumed": resumed,
           "already_prepared": False,
           "path": str(root)}
  return stats


