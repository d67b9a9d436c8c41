"""The two layouts of a layer stack's variables (params, LoRA adapters): unrolled ('layers_0' ..
'layers_<n-1>') and scanned (`scan_layers`: 'layers' with a leading axis over the layers; for a
layer_pattern model of cycle c, 'layers/block_<j>' with a leading axis over the n // c whole cycles,
then the n % c layers left over as 'layers_<i>', as nn/transformer.py builds them)."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def cycle_of(tree: Any) -> int:
  """The layers in one scanned cycle of a scanned-layout tree: its 'layers/block_<j>' entries, 1 without."""
  layers = tree.get("layers") if hasattr(tree, "get") else None
  blocks = [k for k in (layers or {}) if str(k).startswith("block_")]
  return len(blocks) or 1


def _scanned_layers(num_layers: int, cycle: int) -> int:
  return num_layers // cycle * cycle


def stack_layers(tree: Any, num_layers: int, cycle: int = 1) -> Any:
  """Unrolled variables -> the scanned layout."""
  scanned = _scanned_layers(num_layers, cycle)
  names = [f"layers_{i}" for i in range(num_layers)]
  missing = [n for n in names if n not in tree]
  if missing:
    raise ValueError(f"params have no {missing[0]!r}: not the unscanned layout of a {num_layers}-layer model")
  out = {k: v for k, v in tree.items() if k not in names[:scanned]}
  if not scanned:
    return out
  stack = lambda layers: jax.tree.map(lambda *xs: jnp.stack(xs), *(tree[f"layers_{i}"] for i in layers))  # noqa: E731
  if cycle == 1:
    out["layers"] = stack(range(num_layers))
  else:
    out["layers"] = {f"block_{j}": stack(range(j, scanned, cycle)) for j in range(cycle)}
  return out


def unstack_layers(tree: Any, num_layers: int, cycle: int = 1) -> Any:
  """Scanned variables -> the unrolled layout."""
  scanned = _scanned_layers(num_layers, cycle)
  if scanned and "layers" not in tree:
    raise ValueError("params have no 'layers': not the scanned layout")
  out = {k: v for k, v in tree.items() if k != "layers"}
  for i in range(scanned):
    stacked = tree["layers"] if cycle == 1 else tree["layers"][f"block_{i % cycle}"]
    out[f"layers_{i}"] = jax.tree.map(lambda x, k=i // cycle: x[k], stacked)
  return out
