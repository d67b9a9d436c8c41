"""The prepared dataset format (`tformer_jax.prepared/1`: see the package docstring) and its reader,
`PreparedDataset` (shards memory-mapped, nothing loaded whole)."""
from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import numpy as np

from tformer_jax.data.corpora import DataError, sha256_file
from tformer_jax.data.tokenizers import ByteTokenizer, HFTokenizer, SentencePieceTokenizer, Tokenizer

FORMAT = "tformer_jax.prepared/1"
MANIFEST = "manifest.json"
PROGRESS = ".progress.json"
LOCK = ".prepare.lock"
TOKENIZER_EXTRAS = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def token_dtype(vocab_size: int) -> np.dtype:
  """uint16 when every id fits (vocab_size <= 65536), else uint32; DataError beyond uint32."""
  if vocab_size <= 1 << 16:
    return np.dtype("<u2")
  if vocab_size <= 1 << 32:
    return np.dtype("<u4")
  raise DataError(f"a vocabulary of {vocab_size} ids does not fit uint32 token ids (at most {1 << 32})")


def shard_files(index: int) -> tuple[str, str]:
  return f"shard-{index:05d}.tokens.npy", f"shard-{index:05d}.offsets.npy"


def convention(eos_id: int | None) -> str:
  if eos_id is None:
    return ("documents are concatenated with no separator (the tokenizer has no EOS id); "
            "boundaries are in the offsets")
  return f"every document ends with eos_id ({eos_id}); no BOS is added"



def json_of(file: pathlib.Path) -> Any:
  try:
    return json.loads(file.read_text(encoding="utf-8"))
  except (OSError, ValueError):
    return None


def _npy_header_len(path: pathlib.Path) -> int:
  with open(path, "rb") as f:
    version = np.lib.format.read_magic(f)
    if version == (1, 0):
      np.lib.format.read_array_header_1_0(f)
    else:
      np.lib.format.read_array_header_2_0(f)
    return f.tell()


class PreparedDataset:
  """A prepared dataset directory, its shards memory-mapped (nothing is loaded whole)."""

  def __init__(self, path: str | os.PathLike, manifest: dict[str, Any]):
    self.path = pathlib.Path(path)
    self.manifest = manifest
    self.dtype = np.dtype(manifest["dtype"])
    self.num_documents = int(manifest["num_documents"])
    self.num_tokens = int(manifest["num_tokens"])
    self.eos_id = manifest.get("eos_id")
    self.bos_id = manifest.get("bos_id")
    self.vocab_size = int(manifest["tokenizer"]["vocab_size"])
    self.shards: list[tuple[np.ndarray, np.ndarray]] = []
    for entry in manifest["shards"]:
      self.shards.append((self._load(entry["tokens"], self.dtype, entry["num_tokens"]),
                          self._load(entry["offsets"], np.dtype("<i8"), entry["num_documents"] + 1, mmap=False)))
    for (tokens, offsets), entry in zip(self.shards, manifest["shards"]):
      if offsets[0] != 0 or offsets[-1] != len(tokens) or np.any(np.diff(offsets) < 0):
        raise DataError(f"{self.path / entry['offsets']}: offsets are not 0..{len(tokens)} ascending: the file is "
                        "corrupt; prepare the dataset again")
    self.shard_token_starts = np.concatenate([[0], np.cumsum([len(t) for t, _ in self.shards])]).astype(np.int64)
    self.shard_doc_starts = np.concatenate([[0], np.cumsum([len(o) - 1 for _, o in self.shards])]).astype(np.int64)
    if self.shard_token_starts[-1] != self.num_tokens or self.shard_doc_starts[-1] != self.num_documents:
      raise DataError(f"{self.path / MANIFEST}: the shards hold {self.shard_token_starts[-1]} tokens and "
                      f"{self.shard_doc_starts[-1]} documents, the manifest says {self.num_tokens} and "
                      f"{self.num_documents}: prepare the dataset again")
    self._doc_offsets: np.ndarray | None = None

  def _load(self, name: str, dtype: np.dtype, length: int, mmap: bool = True) -> np.ndarray:
    file = self.path / name
    if not file.is_file():
      raise DataError(f"{file}: missing shard file of the prepared dataset {self.path}; prepare it again")
    try:
      expected = _npy_header_len(file) + length * dtype.itemsize
      size = file.stat().st_size
      if size != expected:
        raise ValueError(f"{size} bytes, expected {expected}")
      array = np.load(file, mmap_mode="r" if mmap else None, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
      raise DataError(f"{file}: truncated or not a .npy file of {length} {dtype.name} ({e}); "
                      "prepare the dataset again") from None
    if array.dtype != dtype or array.shape != (length,):
      raise DataError(f"{file}: holds {array.dtype}{list(array.shape)}, the manifest says {dtype.name}[{length}]")
    return array

  def __repr__(self) -> str:
    return (f"PreparedDataset({str(self.path)!r}, {self.num_documents} documents, {self.num_tokens} tokens, "
            f"{len(self.shards)} shards, {self.dtype.name})")

  @property
  def doc_offsets(self) -> np.ndarray:
    """int64 start offsets of every document (and the end), over all shards concatenated."""
    if self._doc_offsets is None:
      parts = [offsets[:-1] + start for (_, offsets), start in zip(self.shards, self.shard_token_starts)]
      self._doc_offsets = np.concatenate(parts + [np.array([self.num_tokens], np.int64)]).astype(np.int64)
    return self._doc_offsets

  def tokens_at(self, start: int, n: int) -> np.ndarray:
    """Tokens [start, start + n) of all shards concatenated (a copy, in the dataset's dtype)."""
    if start < 0 or n < 0 or start + n > self.num_tokens:
      raise IndexError(f"tokens [{start}, {start + n}) out of range: the dataset holds {self.num_tokens}")
    out = np.empty(n, self.dtype)
    done = 0
    shard = int(np.searchsorted(self.shard_token_starts, start, side="right")) - 1
    while done < n:
      tokens = self.shards[shard][0]
      lo = start + done - int(self.shard_token_starts[shard])
      take = min(n - done, len(tokens) - lo)
      out[done:done + take] = tokens[lo:lo + take]
      done += take
      shard += 1
    return out

  def document(self, i: int) -> np.ndarray:
    """The tokens of document i (with its EOS when the dataset has one)."""
    if not 0 <= i < self.num_documents:
      raise IndexError(f"document {i} out of range: the dataset holds {self.num_documents}")
    shard = int(np.searchsorted(self.shard_doc_starts, i, side="right")) - 1
    tokens, offsets = self.shards[shard]
    j = i - int(self.shard_doc_starts[shard])
    return np.asarray(tokens[offsets[j]:offsets[j + 1]])

  def tokenizer(self) -> Tokenizer:
    """The tokenizer the dataset was made with (its copy in the directory), eos_id/bos_id as in the manifest."""
    info = self.manifest["tokenizer"]
    file = info.get("file")
    if not file:
      tok: Any = ByteTokenizer()
    elif file.endswith(".json"):
      tok = HFTokenizer(self.path / file)
    else:
      tok = SentencePieceTokenizer(self.path / file, name=info.get("name"))
    tok.eos_id, tok.bos_id = self.eos_id, self.bos_id
    return tok

  def verify(self) -> None:
    """Check every file against the manifest's sha256; DataError naming the first bad file."""
    info = self.manifest["tokenizer"]
    files = [(e[kind], e["sha256"][kind]) for e in self.manifest["shards"] for kind in ("tokens", "offsets")]
    if info.get("file"):
      files.append((info["file"], info["sha256"]))
    files += sorted(info.get("extra_files", {}).items())
    for name, want in files:
      file = self.path / name
      if not file.is_file():
        raise DataError(f"{file}: missing file of the prepared dataset {self.path}; prepare it again")
      got = sha256_file(file)
      if got != want:
        raise DataError(f"{file}: checksum mismatch (sha256 {got[:16]}..., the manifest says {want[:16]}...): "
                        "the file is corrupt; prepare the dataset again")


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
  root = pathlib.Path(path).expanduser()
  file = root / MANIFEST
  if not file.is_file():
    if not root.exists():
      raise DataError(f"prepared dataset {root}: no such directory")
    if (root / PROGRESS).is_file():
      raise DataError(f"{file} is missing: the prepare of {root} did not finish; rerun the same "
                      "tformer-prepare command to resume it")
    raise DataError(f"{file} is missing: {root} is not a prepared dataset (make one with tformer-prepare)")
  try:
    manifest = json.loads(file.read_text(encoding="utf-8"))
  except (OSError, ValueError) as e:
    raise DataError(f"{file}: unreadable manifest ({e}); prepare the dataset again") from None
  if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
    found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
    raise DataError(f"{file}: format {found!r}, expected {FORMAT!r}")
  missing = [k for k in ("dtype", "tokenizer", "num_documents", "num_tokens", "shards") if k not in manifest]
  if missing:
    raise DataError(f"{file}: incomplete manifest (no {', '.join(missing)}); prepare the dataset again")
  return manifest


def open_prepared(path: str | os.PathLike, *, verify: bool = False) -> PreparedDataset:
  """The prepared dataset at `path`, shards memory-mapped. DataError naming the file when the manifest is
  missing or incomplete, a shard is missing or truncated, or (verify=True) a checksum differs."""
  root = pathlib.Path(path).expanduser()
  ds = PreparedDataset(root, read_manifest(root))
  if verify:
    ds.verify()
  return ds


