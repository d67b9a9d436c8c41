"""Prepared datasets: text sources tokenized once into shards of token ids, read memory-mapped.

The format (`tformer_jax.prepared/1`), a directory:

  manifest.json                written last, atomically: its presence means the dataset is complete. Holds the
                               dtype, the tokenizer (spec, name, vocab_size, sha256, file), eos_id / bos_id and
                               the convention, counts, the sources, and per shard its counts and sha256s.
  tokenizer.model | .json      a copy of the tokenizer (none for the byte tokenizer)
  shard-NNNNN.tokens.npy       1-D token ids, uint16 when the vocabulary has <= 65536 ids, else uint32
  shard-NNNNN.offsets.npy      1-D int64, num_documents + 1 entries: document i of the shard is
                               tokens[offsets[i]:offsets[i + 1]], its EOS included when eos_id is set

Documents never span shards; a shard closes once it holds >= shard_tokens tokens. Every document ends with
eos_id when the tokenizer has one (no BOS is added); the byte tokenizer has none, and its documents are
concatenated with no separator (the offsets hold the boundaries).

The modules, one job each:
  dataset.py   the format's names and the reader: `open_prepared(DIR)` -> `PreparedDataset` (shards
               memory-mapped; `verify()` checks the sha256s)
  build.py     `prepare(sources, DIR, tokenizer=...)` streams documents (`tformer_jax.data.sources`) through
               the workers and the writer; a rerun with the same arguments resumes where the input stands,
               and the result is byte-identical to an uninterrupted run for any worker count
  workers.py   the processes that tokenize (the main process and workers - 1 spawned ones), results in
               input order
  writer.py    each shard committed atomically (temporary file, fsync, rename), then `.progress.json`
  outdir.py    the output directory is owned: `prepare` writes only into a missing or empty directory or
               one holding its own manifest / progress / lock file (`.prepare.lock`, an flock held for the
               whole run, so a second prepare into the same directory stops at once naming the first),
               refuses anything else, and deletes only files it wrote. `overwrite=True` replaces a dataset
               of ours atomically (built beside it, then exchanged: renameat2 RENAME_EXCHANGE). A full or
               read-only disk is one DataError line; the committed shards stay resumable. A replacement is
               built in `.NAME.partial-HOST-PID-*`; a killed run's goes at the next run (`clean_partials`).
  run_data.py  at a training run's start, `check_run_data` hashes each token shard once and checks its ids
               against the vocabulary, records the datasets' identity in WORKDIR/data.json, and refuses a
               resumed run whose directory was prepared again

Nothing here imports grain or jax: tformer-prepare's worker processes start in a fraction of a second.
"""
from tformer_jax.data.prepared.build import (
    DEFAULT_BPE_VOCAB,
    DEFAULT_SAMPLE_BYTES,
    DEFAULT_SHARD_TOKENS,
    prepare,
    sample_texts,
)
from tformer_jax.data.prepared.dataset import (
    FORMAT,
    LOCK,
    MANIFEST,
    PROGRESS,
    TOKENIZER_EXTRAS,
    PreparedDataset,
    open_prepared,
    read_manifest,
    shard_files,
    token_dtype,
)
from tformer_jax.data.prepared.outdir import clean_partials, exchange_dirs, honour_umask, link_target, partial_dir
from tformer_jax.data.prepared.run_data import (
    RUN_DATA,
    RUN_DATA_FORMAT,
    check_run_data,
    check_shards,
    dataset_identity,
    read_run_data,
    tokenizer_sha256,
    tokenizer_spec,
    write_run_data,
)

__all__ = ["DEFAULT_BPE_VOCAB", "DEFAULT_SAMPLE_BYTES", "DEFAULT_SHARD_TOKENS", "FORMAT", "LOCK", "MANIFEST",
           "PROGRESS", "RUN_DATA", "RUN_DATA_FORMAT", "TOKENIZER_EXTRAS", "PreparedDataset", "check_run_data",
           "check_shards", "clean_partials", "dataset_identity", "exchange_dirs", "honour_umask", "link_target",
           "open_prepared", "partial_dir", "prepare", "read_manifest", "read_run_data", "sample_texts", "shard_files",
           "token_dtype", "tokenizer_sha256", "tokenizer_spec", "write_run_data"]
