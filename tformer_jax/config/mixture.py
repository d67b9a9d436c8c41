"""The data.mixture syntax: 'SPEC=W,SPEC=W' -> normalised (spec, weight) pairs."""
from __future__ import annotations

import math
from typing import Any, Sequence

from tformer_jax.config.errors import _fail


def parse_mixture(mixture: str | Sequence[Any]) -> list[tuple[str, float]]:
  """data.mixture 'SPEC=W,SPEC=W' (or a list of 'SPEC=W' / (SPEC, W)) -> [(spec, weight)], the weights
  normalised to sum 1: the one reader of the syntax (validate and the data pipeline). ConfigError naming an
  item that is not SPEC=WEIGHT, a weight that is not a positive number, or a synthetic task."""
  items = mixture.split(",") if isinstance(mixture, str) else list(mixture)
  out = []
  for item in items:
    if isinstance(item, (tuple, list)) and len(item) == 2:
      spec, weight = str(item[0]).strip(), item[1]
    else:
      spec, sep, weight = str(item).strip().rpartition("=")
      spec = spec.strip()
      if not sep or not spec:
        _fail("data.mixture", f"{str(item).strip()!r} is not SPEC=WEIGHT "
              "(e.g. 'prepared:/data/a=0.7,prepared:/data/b=0.3')")
    try:
      w = float(weight)
    except (TypeError, ValueError):
      w = math.nan
    if not (math.isfinite(w) and w > 0):
      _fail("data.mixture", f"weight {weight!r} of {spec!r} must be a positive number")
    if spec.startswith("synthetic:"):
      _fail("data.mixture", f"{spec!r}: synthetic tasks cannot be mixed with text")
    out.append((spec, w))
  if not out:
    _fail("data.mixture", "is empty; give 'SPEC=WEIGHT,SPEC=WEIGHT'")
  total = sum(w for _, w in out)
  return [(s, w / total) for s, w in out]
