"""The named corpora (shakespeare, kjv, text:PATH) as prepared datasets: prepared once from their documents
(`corpora.load_documents`) into the cache, cache_root()/prepared/<key>, under an flock (concurrent runs and
the processes of one run wait for the first); `prepared:DIR` is its own directory."""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import pathlib
import shutil
from typing import Any

import numpy as np

from tformer_jax.data import prepared as prepared_lib
from tformer_jax.data.corpora import DataError, cache_root, load_documents, sha256_file, write_atomic
from tformer_jax.data.settings import setting
from tformer_jax.data.tokenizers import Tokenizer, get_tokenizer

log = logging.getLogger(__name__)

PREPARED_KEY_VERSION = 1    # bump when the way named corpora become prepared datasets changes


def prepared_path(spec: str, data_cfg: Any) -> pathlib.Path:
  """The prepared dataset directory of corpus `spec`: DIR of 'prepared:DIR', else the cache entry of
  a named corpus (prepared now if missing)."""
  return prepared_location(spec, data_cfg)[0]


def prepared_location(spec: str, data_cfg: Any) -> tuple[pathlib.Path, Tokenizer | None]:
  """(directory, tokenizer: None for prepared:DIR, whose tokenizer is in the directory)."""
  spec = spec.strip()
  if spec.startswith("prepared:"):
    if not spec[len("prepared:"):].strip():
      raise DataError("prepared:DIR needs a directory, e.g. corpus='prepared:/data/my_corpus' (written by "
                      "tformer-prepare)")
    return pathlib.Path(spec[len("prepared:"):].strip()).expanduser(), None
  cache_dir = setting(data_cfg, "cache_dir") or None
  docs = load_documents(spec, cache_dir)
  tok_spec, vocab = str(setting(data_cfg, "tokenizer")).strip(), int(setting(data_cfg, "bpe_vocab_size"))
  raw = False   # the byte tokenizer takes any bytes; the others need UTF-8 text
  for i, d in enumerate(docs):
    if tok_spec == "byte" and b"\x00" in d:   # prepare() skips NUL-holding (binary) text; bytes take it
      raw = True
      break
    try:
      d.decode("utf-8")
    except UnicodeDecodeError as e:
      if tok_spec == "byte":
        raw = True
        break
      raise DataError(f"{spec}: document {i} is not valid UTF-8 (invalid byte {d[e.start:e.start + 1]!r} at byte "
                      f"offset {e.start}); tokenizer {tok_spec!r} reads UTF-8 text: re-encode it (e.g. `iconv -f "
                      "latin1 -t utf-8`) or use tokenizer='byte', which takes any bytes") from None
  tok = get_tokenizer(tok_spec, corpus=b"".join(docs) if tok_spec == "bpe" else None, vocab_size=vocab,
                      cache_dir=cache_dir)
  h = hashlib.sha256(f"{PREPARED_KEY_VERSION} {prepared_lib.FORMAT} {tok.name}".encode())
  for d in docs:
    h.update(len(d).to_bytes(8, "little"))
    h.update(d)
  key = h.hexdigest()[:20]
  root = cache_root(cache_dir) / "prepared"
  out = root / key
  if not (out / prepared_lib.MANIFEST).is_file():
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{key}.lock", "w") as lock:
      fcntl.flock(lock, fcntl.LOCK_EX)        # concurrent runs (or the processes of one run) wait here
      if not (out / prepared_lib.MANIFEST).is_file():
        if raw:
          _write_byte_documents(docs, out, spec)
        else:
          _prepare_documents(docs, out, tok, tok_spec, spec)
  return out, tok


def _prepare_documents(docs: list[bytes], out: pathlib.Path, tok: Tokenizer, tok_spec: str, spec: str) -> None:
  """Write `docs` (one .txt file each) and prepare them into `out` with the tokenizer `tok` (a trained
  BPE as its cached model file). A leftover of an interrupted attempt is overwritten."""
  log.info("data: preparing %s (%d documents, %d bytes, tokenizer %s) into %s", spec, len(docs),
           sum(map(len, docs)), tok.name, out)
  src = out.parent / f".{out.name}.documents"
  shutil.rmtree(src, ignore_errors=True)
  src.mkdir(parents=True)
  try:
    for i, d in enumerate(docs):
      (src / f"{i:06d}.txt").write_bytes(d)
    spec_for_prepare = f"spm:{tok.path}" if tok_spec == "bpe" else tok_spec
    prepared_lib.prepare([str(src)], out, tokenizer=spec_for_prepare, workers=1, progress=False,
                         on_bad_utf8="fail", overwrite=True)
  finally:
    shutil.rmtree(src, ignore_errors=True)



def _write_byte_documents(docs: list[bytes], out: pathlib.Path, spec: str) -> None:
  """Byte-tokenized documents that are not all UTF-8, as a prepared dataset (the format of data/prepared:
  one shard, tokens = the bytes, no EOS). prepare() reads UTF-8 text only; the byte tokenizer takes any bytes."""
  log.info("data: %s is not UTF-8 text: writing its bytes as byte tokens into %s", spec, out)
  tmp = out.parent / f".{out.name}.bytes"
  shutil.rmtree(tmp, ignore_errors=True)
  tmp.mkdir(parents=True)
  tokens_name, offsets_name = prepared_lib.shard_files(0)
  lengths = np.array([len(d) for d in docs if d], np.int64)
  np.save(tmp / tokens_name, np.frombuffer(b"".join(docs), np.uint8).astype(prepared_lib.token_dtype(256)))
  np.save(tmp / offsets_name, np.concatenate([[0], np.cumsum(lengths)]).astype("<i8"))
  manifest = {
      "format": prepared_lib.FORMAT, "dtype": prepared_lib.token_dtype(256).name,
      "tokenizer": {"spec": "byte", "name": "byte", "vocab_size": 256,
                    "sha256": hashlib.sha256(b"byte").hexdigest(), "file": None},
      "eos_id": None, "bos_id": None,
      "convention": "documents are concatenated with no separator (the tokenizer has no EOS id); "
                    "boundaries are in the offsets; the bytes are not all UTF-8",
      "num_documents": len(lengths), "num_tokens": int(lengths.sum()),
      "skipped_documents": {"not_utf8": 0, "empty": len(docs) - len(lengths)}, "sources": [spec],
      "text_field": None, "shard_tokens": int(lengths.sum()),
      "shards": [{"tokens": tokens_name, "offsets": offsets_name, "num_documents": len(lengths),
                  "num_tokens": int(lengths.sum()),
                  "sha256": {"tokens": sha256_file(tmp / tokens_name), "offsets": sha256_file(tmp / offsets_name)}}]}
  write_atomic(tmp / prepared_lib.MANIFEST, json.dumps(manifest, indent=1).encode())
  os.replace(tmp, out)

