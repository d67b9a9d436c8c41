"""The tokenizer library's own batch encode: the throughput ceiling `tformer-prepare` (reading, parsing and
writing included) is measured against (`tformer-prepare --benchmark`, `tformer-bench data`)."""
from __future__ import annotations

import multiprocessing
import os
import time
from typing import Any, Sequence

from tformer_jax.data.prepared.workers import load_tokenizer
from tformer_jax.data.tokenizers import HFTokenizer, Tokenizer, get_tokenizer


def _ceiling_child(kind: str, file: str | None, texts: list[str], threads: int) -> tuple[int, float]:
  os.environ["RAYON_NUM_THREADS"] = str(threads)      # before the library's first parallel call
  tok = load_tokenizer(kind, file)
  t = time.perf_counter()
  ids = tok.encode_batch(texts, num_threads=threads)
  return sum(len(x) for x in ids), time.perf_counter() - t


def tokenizer_ceiling(texts: Sequence[str], tokenizer: str | Tokenizer, *, threads: int = 1) -> dict[str, Any]:
  """The tokenizer library's own batch encode of `texts` on `threads` threads (sentencepiece's encode of a
  list with num_threads, HF tokenizers' encode_batch on a pool of `threads`): {bytes, tokens, seconds,
  mb_per_s, tokens_per_s, threads}. The throughput `prepare` (reading, parsing, writing included) is
  compared with."""
  tok = get_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
  texts = list(texts)
  nbytes = sum(len(t.encode("utf-8")) for t in texts)
  if isinstance(tok, HFTokenizer) and threads > 1:
    ctx = multiprocessing.get_context("spawn")        # the thread pool's size is fixed at its first use
    with ctx.Pool(1) as pool:
      ntok, seconds = pool.apply(_ceiling_child, ("hf", str(tok.path), texts, threads))
  else:
    t = time.perf_counter()
    ids = tok.encode_batch(texts, num_threads=threads)
    seconds = time.perf_counter() - t
    ntok = sum(len(x) for x in ids)
  seconds = max(seconds, 1e-9)
  return {"bytes": nbytes, "tokens": ntok, "seconds": seconds, "mb_per_s": nbytes / 1e6 / seconds,
          "tokens_per_s": ntok / seconds, "threads": threads}

