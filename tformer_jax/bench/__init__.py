"""Benchmarks: `python -m tformer_jax.bench {train,attention,compile,decode,moe,compare}`."""
from __future__ import annotations

import json
import pathlib


def emit(res: dict, json_path: str | None = None) -> dict:
  """Every benchmark's ending: the result to `json_path` (if given), then as the last stdout line."""
  if json_path:
    pathlib.Path(json_path).write_text(json.dumps(res, indent=2))
  print(json.dumps(res))
  return res
