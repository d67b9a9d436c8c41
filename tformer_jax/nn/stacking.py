"""The two layouts of a layer stack's variables (params, LoRA adapters): unrolled ('layers_0' ..
'layers_<n-1>') and scanned (`scan_layers`: 'layers' with a leading axis over the layers; for a
layer_pattern model of cycle c, 'layers/block_<j>' with a leading axis over the n // c whole cycles,
then the n % c layers left over as 'layers_<i>', as nn/transformer.py builds them). An MoE model's
`dense` first layers (moe.first_k_dense, a multiple of c) are a stack of their own, 'dense_layers'
(same form), and the MoE layers after them are 'layers' (their layer k - dense at index k - dense)."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def cycle_of(tree: Any) -> int:
  """The layers in one scanned cycle of a scanned-layout tree: its 'layers/block_<j>' entries, 1 without."""
  layers = tree.get("layers") if hasattr(tree, "get") else None
  blocks = [k for k in (layers or {}) if str(k).startswith("block_")]
  return len(blocks) or 1


def dense_of(tree: Any) -> int:
  """The dense first layers of a scanned-layout tree: the leading axis of its 'dense_layers' (times its
  cycle), 0 without."""
  dense = tree.get("dense_layers") if hasattr(tree, "get") else None
  leaves = jax.tree.leaves(dense) if dense else []
  return int(leaves[0].shape[0]) * cycle_of(tree) if leaves else 0


def _segments(num_layers: int, cycle: int, dense: int) -> list[tuple[str, int, int]]:
  """(stack name, first layer, scanned layers) of each scanned stack."""
  if dense % cycle:
    raise ValueError(f"{dense} dense first layers are not a multiple of the cycle {cycle}")
  rest = num_layers - dense
  return [("dense_layers", 0, dense), ("layers", dense, rest // cycle * cycle)]


def stack_layers(tree: Any, num_layers: int, cycle: int = 1, dense: int = 0) -> Any:
  """Unrolled variables -> the scanned layout (`dense`: moe.first_k_dense, 0 for other models)."""
  names = [f"layers_{i}" for i in range(num_layers)]
  missing = [n for n in names if n not in tree]
  if missing:
    raise ValueError(f"params have no {missing[0]!r}: not the unscanned layout of a {num_layers}-layer model")
  segments = _segments(num_layers, cycle, dense)
  in_stacks = {f"layers_{i}" for _, a, n in segments for i in range(a, a + n)}
  out = {k: v for k, v in tree.items() if k not in in_stacks}
  stack = lambda layers: jax.tree.map(lambda *xs: jnp.stack(xs), *(tree[f"layers_{i}"] for i in layers))  # noqa: E731
  for name, a, n in segments:
    if not n:
      continue
    if cycle == 1:
      out[name] = stack(range(a, a + n))
    else:
      out[name] = {f"block_{j}": stack(range(a + j, a + n, cycle)) for j in range(cycle)}
  return out


def unstack_layers(tree: Any, num_layers: int, cycle: int = 1, dense: int | None = None) -> Any:
  """Scanned variables -> the unrolled layout (`dense` None: read from the tree's 'dense_layers')."""
  dense = dense_of(tree) if dense is None else dense
  segments = _segments(num_layers, cycle, dense)
  for name, _, n in segments:
    if n and name not in tree:
      raise ValueError(f"params have no {name!r}: not the scanned layout")
  out = {k: v for k, v in tree.items() if k not in ("layers", "dense_layers")}
  for name, a, n in segments:
    for i in range(n):
      stacked = tree[name] if cycle == 1 else tree[name][f"block_{i % cycle}"]
      out[f"layers_{a + i}"] = jax.tree.map(lambda x, k=i // cycle: x[k], stacked)
  return out
