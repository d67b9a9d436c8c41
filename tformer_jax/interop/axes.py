"""A tiny rearrange language for weight layouts: "(h 3 k) d" <-> "d h k".

A pattern lists the tensor's dimensions; a parenthesised group is one dimension made of several
elementary axes (row-major). Axis names are letters whose sizes come from a `sizes` dict; a number
is a literal axis (the '3' of a fused q/k/v). Converting between two patterns reshapes to the
elementary axes, transposes, and reshapes again. An axis on the source side only is *selected*
(one index of a fused tensor); an axis on the destination side only is *stacked* (several source
tensors, e.g. one per expert, combined into one). These are exact (bitwise) and invertible.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

Groups = list[list[str]]


class LayoutError(ValueError):
  """A tensor whose shape does not match its pattern (the message gives the expected shape)."""


def parse(pattern: str) -> Groups:
  """'(h 3 k) d' -> [['h', '3', 'k'], ['d']]."""
  groups: Groups = []
  current: list[str] | None = None
  for tok in pattern.replace("(", " ( ").replace(")", " ) ").split():
    if tok == "(":
      if current is not None:
        raise ValueError(f"nested parentheses in layout {pattern!r}")
      current = []
    elif tok == ")":
      if not current:
        raise ValueError(f"empty or unbalanced group in layout {pattern!r}")
      groups.append(current)
      current = None
    elif current is not None:
      current.append(tok)
    else:
      groups.append([tok])
  if current is not None:
    raise ValueError(f"unbalanced parentheses in layout {pattern!r}")
  names = [a for g in groups for a in g]
  if len(set(names)) != len(names):
    raise ValueError(f"repeated axis in layout {pattern!r}")
  return groups


def axis_size(axis: str, sizes: Mapping[str, int]) -> int:
  if axis.isdigit():
    return int(axis)
  if axis not in sizes:
    raise ValueError(f"layout axis {axis!r} has no size (known: {sorted(sizes)})")
  return int(sizes[axis])


def shape_of(pattern: str, sizes: Mapping[str, int]) -> tuple[int, ...]:
  """The tensor shape a pattern describes."""
  return tuple(math.prod(axis_size(a, sizes) for a in g) for g in parse(pattern))


def _elementary(arr: np.ndarray, groups: Groups, sizes: Mapping[str, int], what: str) -> np.ndarray:
  want = tuple(math.prod(axis_size(a, sizes) for a in g) for g in groups)
  if tuple(arr.shape) != want:
    raise LayoutError(f"{what} has shape {tuple(arr.shape)}, expected {want}")
  return arr.reshape([axis_size(a, sizes) for g in groups for a in g])


def _grouped(arr: np.ndarray, groups: Groups, sizes: Mapping[str, int]) -> np.ndarray:
  return arr.reshape([math.prod(axis_size(a, sizes) for a in g) for g in groups])


def rearrange(arrays: Sequence[np.ndarray], src: str, dst: str, sizes: Mapping[str, int], *,
              what: str = "tensor") -> list[np.ndarray]:
  """Convert tensors in layout `src` to layout `dst`.

  At most one axis may be source-only (selected: one output per index, so the number of outputs
  is that axis' size) and at most one destination-only (stacked: one input per index). Without
  either, one input gives one output.
  """
  sg, dg = parse(src), parse(dst)
  s_axes = [a for g in sg for a in g]
  d_axes = [a for g in dg for a in g]
  sel = [a for a in s_axes if a not in d_axes]
  stk = [a for a in d_axes if a not in s_axes]
  if len(sel) > 1 or len(stk) > 1:
    raise ValueError(f"layouts {src!r} -> {dst!r}: at most one selected and one stacked axis")
  n_in = axis_size(stk[0], sizes) if stk else 1
  if len(arrays) != n_in:
    raise ValueError(f"{what}: {src!r} -> {dst!r} needs {n_in} input(s), got {len(arrays)}")
  elem = [_elementary(np.asarray(a), sg, sizes, what) for a in arrays]
  if stk:
    # Put the stacked axis where it sits among the destination axes that exist in the source.
    x = np.stack(elem, axis=0)
    cur = stk + s_axes
  else:
    x, cur = elem[0], list(s_axes)
  outs = []
  n_out = axis_size(sel[0], sizes) if sel else 1
  for j in range(n_out):
    y, axes = x, list(cur)
    if sel:
      pos = axes.index(sel[0])
      y = np.take(y, j, axis=pos)
      axes.pop(pos)
    y = np.transpose(y, [axes.index(a) for a in d_axes])
    outs.append(np.ascontiguousarray(_grouped(y, dg, sizes)))
  return outs
