"""The data a training run reads: the prepared datasets' identity (kept in WORKDIR/data.json) and a cheap
integrity check of their shards."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import time
from typing import Any, Sequence

import numpy as np

from tformer_jax.data.corpora import DataError, cache_root, sha256_file, write_atomic
from tformer_jax.data.prepared.dataset import PreparedDataset, json_of

log = logging.getLogger(__name__)

RUN_DATA = "data.json"         # in a training workdir: the prepared datasets it trains on, and their check
RUN_DATA_FORMAT = "tformer_jax.run_data/1"


def tokenizer_sha256(spec: str) -> str | None:
  """What identifies tokenizer `spec` without training anything: the sha256 of its file (hf:, spm:), of
  the name for the byte tokenizer (as manifests record it); None for 'bpe' (trained on the data) or a
  file that is not there."""
  spec = str(spec).strip()
  if spec == "byte":
    return hashlib.sha256(b"byte").hexdigest()
  if spec.startswith(("hf:", "spm:")):
    path = pathlib.Path(spec.split(":", 1)[1]).expanduser()
    if spec.startswith("hf:") and path.is_dir():
      path = path / "tokenizer.json"
    return sha256_file(path) if path.is_file() else None
  return None


def tokenizer_spec(ds: PreparedDataset) -> str:
  """The tokenizer spec that loads `ds`'s own tokenizer (its copy in the directory)."""
  file = ds.manifest["tokenizer"].get("file")
  if not file:
    return "byte"
  return f"{'hf' if file.endswith('.json') else 'spm'}:{(ds.path / file).absolute()}"


def dataset_identity(ds: PreparedDataset) -> dict[str, Any]:
  """What a run trained on `ds` depends on: its shards' checksums and its tokenizer (sha256 of them all)."""
  t = ds.manifest["tokenizer"]
  content = [ds.manifest["dtype"], ds.eos_id, t.get("sha256"), [e["sha256"] for e in ds.manifest["shards"]]]
  return {"path": str(ds.path.absolute()), "sha256": hashlib.sha256(json.dumps(content).encode()).hexdigest(),
          "num_tokens": ds.num_tokens, "tokenizer": {k: t.get(k) for k in ("spec", "name", "vocab_size", "sha256")}}


def check_shards(ds: PreparedDataset, known: dict[str, list[int]] | None = None) -> dict[str, list[int]]:
  """Every token shard of `ds` checked against the manifest (sha256, and every id inside the vocabulary)
  unless its size, mtime, ctime and inode match `known` (an earlier check's record); the offsets are
  checked at open.
  DataError naming the shard (and, for an id outside the vocabulary, its offset). Returns the record."""
  out = {}
  for entry in ds.manifest["shards"]:
    file = ds.path / entry["tokens"]
    st = file.stat()
    stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]     # ctime: no write leaves it as it was
    if (known or {}).get(entry["tokens"]) != stamp:
      tokens = ds.shards[len(out)][0]
      if len(tokens) and int(tokens.max()) >= ds.vocab_size:
        at = int(np.argmax(np.asarray(tokens) >= ds.vocab_size))
        raise DataError(f"{file}: token id {int(tokens[at])} at offset {at} is outside the vocabulary "
                        f"({ds.vocab_size} ids): the file is damaged; prepare the dataset again")
      got = sha256_file(file)
      if got != entry["sha256"]["tokens"]:
        raise DataError(f"{file}: checksum mismatch (sha256 {got[:16]}..., the manifest says "
                        f"{entry['sha256']['tokens'][:16]}...): the file is damaged; prepare the dataset again")
    out[entry["tokens"]] = stamp
  return out


def _checked_file(ds: PreparedDataset, cache_dir: str | os.PathLike | None) -> pathlib.Path:
  key = hashlib.sha256(str(ds.path.absolute()).encode()).hexdigest()[:20]
  return cache_root(cache_dir) / "checked" / f"{key}.json"


def check_run_data(workdir: str | os.PathLike, datasets: Sequence[PreparedDataset], *, resuming: bool,
                   cache_dir: str | os.PathLike | None = None) -> dict[str, Any]:
  """Before a run changes anything in `workdir`: a resumed run's prepared datasets are the ones it started
  on (a directory prepared again with other text or another tokenizer is a DataError naming it), and
  each dataset's shards pass `check_shards`: hashed once, then again only when a file changed (the
  record is kept in the workdir and, for other runs on the same data, in the cache). Returns the record
  `write_run_data` keeps in WORKDIR/data.json."""
  file = pathlib.Path(workdir) / RUN_DATA
  old = json_of(file) if file.is_file() else None
  old = old if isinstance(old, dict) and old.get("format") == RUN_DATA_FORMAT else {}
  before = {d["path"]: d for d in old.get("datasets", [])}
  ids = [dataset_identity(ds) for ds in datasets]
  if resuming:
    for new in ids:
      was = before.get(new["path"])
      if was is not None and was["sha256"] != new["sha256"]:
        what = ("another tokenizer" if was["tokenizer"].get("sha256") != new["tokenizer"].get("sha256")
                else "other text")
        raise DataError(f"prepared:{new['path']} changed since this run started in {workdir}: it was prepared "
                        f"again with {what} ({was['num_tokens']:,} tokens then, {new['num_tokens']:,} now; data "
                        f"sha256 {was['sha256'][:12]} then, {new['sha256'][:12]} now): resume on the data the run "
                        "started on, or start a new --workdir")
  t0 = time.perf_counter()
  known, verified = old.get("verified", {}), {}
  for ds in datasets:
    path = str(ds.path.absolute())
    shared = _checked_file(ds, cache_dir)
    earlier = known.get(path) or (json_of(shared) if shared.is_file() else None)
    verified[path] = check_shards(ds, earlier if isinstance(earlier, dict) else None)
    if verified[path] != earlier:
      try:
        write_atomic(shared, json.dumps(verified[path]).encode())
      except OSError as e:
        log.warning("data: could not record the check of %s in %s (%s)", path, shared, e)
  if datasets:
    log.info("data: %d prepared dataset(s) checked (%.2f s)", len(datasets), time.perf_counter() - t0)
  return {"format": RUN_DATA_FORMAT, "datasets": ids, "verified": verified}


def write_run_data(workdir: str | os.PathLike, record: dict[str, Any]) -> None:
  if record["datasets"]:
    write_atomic(pathlib.Path(workdir) / RUN_DATA, (json.dumps(record, indent=1) + "\n").encode())


def read_run_data(workdir: str | os.PathLike) -> dict[str, Any] | None:
  """WORKDIR/data.json (the prepared datasets a run trained on), None when there is none."""
  file = pathlib.Path(workdir).expanduser() / RUN_DATA
  found = json_of(file) if file.is_file() else None
  return found if isinstance(found, dict) and found.get("format") == RUN_DATA_FORMAT else None
