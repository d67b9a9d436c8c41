"""Low-rank adapters (LoRA, Hu et al. 2021) as pure functions on a parameter tree: no Flax.

A targeted kernel W (in_dims..., out_dims...) is used as W + (alpha / rank) * A @ B, with
A (in, rank) and B (rank, out) over the flattened in/out dimensions. B starts at zero, so the
adapted model starts as the base; only A and B are trained.

  adapters = init(rng, params, targets=("q", "v"), rank=8)       # {'layers': {'attn': {'wq': {'lora_a', 'lora_b'}}}}
  merged = merge(params, adapters, scale=alpha / rank)         # the params tree with W + scale * A @ B
  model.apply({"params": params, "lora": scaled(adapters, alpha / rank)}, x)   # the same, unmerged

Training applies the adapters unmerged, inside each projection (nn.common.project: x W + (x A) B): the
gradients of A and B then cost O(rank) per token, where the merged kernel's gradient would cost a
whole x^T dy per kernel. Evaluation, generation and export merge them once.

`params` is the model's tree as `Transformer.init` gives it (unscanned `layers_i` or scanned `layers`
with a leading layer axis: the adapters then carry that axis too). Targets name projections:
q, k, v, o (attention) and up, gate, down (the dense FFN's wi, wg, wo): `TARGETS` is the one list
(config validation reads it). `axes` names the adapters' logical axes after their kernel's, so a mesh
shards A like W's inputs and B like W's outputs (the rank dimension is never split).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp

PyTree = Any
# target -> (module name, kernel name, the kernel's own ndim, how many of its leading dims are inputs);
# the one owner of the target names (config's validation of train.lora.targets reads its keys)
TARGETS: dict[str, tuple[str, str, int, int]] = {
    "q": ("attn", "wq", 3, 1), "k": ("attn", "wk", 3, 1), "v": ("attn", "wv", 3, 1), "o": ("attn", "wo", 3, 2),
    "up": ("mlp", "wi", 2, 1), "gate": ("mlp", "wg", 2, 1), "down": ("mlp", "wo", 2, 1),
}
A, B = "lora_a", "lora_b"


class NoTargets(ValueError):
  """The targets name no kernel of the parameter tree."""


class RankTooLarge(ValueError):
  """A rank above a targeted kernel's smaller side: the product A @ B could not be of that rank."""


def parse_targets(spec: str | Sequence[str]) -> tuple[str, ...]:
  """'q,k,v,o' (or a sequence) -> ('q', 'k', 'v', 'o'); ValueError naming an unknown target."""
  names = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec) if s.strip()]
  bad = [n for n in names if n not in TARGETS]
  if bad:
    raise ValueError(f"unknown target {bad[0]!r} (choose from {', '.join(TARGETS)})")
  return tuple(dict.fromkeys(names))


def _targeted(params: PyTree, targets: Sequence[str]) -> list[tuple[tuple[str, ...], jax.Array, int, int]]:
  """(dict-key path, kernel, leading stacked dims, input dims) of every kernel a target names."""
  want = {(TARGETS[t][0], TARGETS[t][1]): TARGETS[t][2:] for t in targets}
  out = []
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    keys = tuple(str(getattr(k, "key", k)) for k in path)
    if len(keys) >= 2 and keys[-2:] in want:
      ndim, n_in = want[keys[-2:]]
      if jnp.ndim(x) >= ndim:
        out.append((keys, x, jnp.ndim(x) - ndim, n_in))
  return out


def init(rng: jax.Array, params: PyTree, targets: Sequence[str], rank: int,
         dtype: Any = jnp.float32) -> PyTree:
  """Adapters for every kernel of `params` a target names: A ~ N(0, 1/in), B = 0 (nested dicts on the
  kernels' paths). ValueError when the targets match no kernel."""
  found = _targeted(params, targets)
  if not found:
    has = [t for t in TARGETS if _targeted(params, [t])]
    raise NoTargets(f"{','.join(targets)} match no parameter of this model (it has: {','.join(has) or 'none'})")
  for keys, w, lead, n_in in found:
    n, m = math.prod(w.shape[lead:lead + n_in]), math.prod(w.shape[lead + n_in:])
    if rank > min(n, m):
      raise RankTooLarge(f"{rank} exceeds the smaller side of {'/'.join(keys[-2:])} ({n} x {m}): a rank-{rank} "
                         f"update of it is at most rank {min(n, m)}; use a rank <= {min(n, m)} or drop that target")
  tree: dict = {}
  for i, (keys, w, lead, n_in) in enumerate(found):
    lead_shape, in_shape = w.shape[:lead], w.shape[lead:lead + n_in]
    out_shape = w.shape[lead + n_in:]
    fan_in = math.prod(in_shape)
    a = jax.random.normal(jax.random.fold_in(rng, i), (*lead_shape, *in_shape, rank), dtype) / math.sqrt(fan_in)
    node = tree
    for k in keys[:-1]:
      node = node.setdefault(k, {})
    node[keys[-1]] = {A: a, B: jnp.zeros((*lead_shape, rank, *out_shape), dtype)}
  return tree


def axes(kernel_axes: Sequence[str | None], a_ndim: int, b_ndim: int) -> tuple[tuple, tuple]:
  """Logical axis names of (A, B) for a kernel whose axes are `kernel_axes` (stacked..., in..., out...):
  A (stacked..., in..., None), B (stacked..., None, out...); None for the rank dimension."""
  k = tuple(kernel_axes)
  n_lead = a_ndim + b_ndim - 2 - len(k)
  n_split = a_ndim - 1                               # stacked + input dims
  return k[:n_split] + (None,), k[:n_lead] + (None,) + k[n_split:]


def delta(a: jax.Array, b: jax.Array, kernel_shape: tuple[int, ...]) -> jax.Array:
  """A @ B in the kernel's shape (leading stacked dims batched): a (..., in..., r), b (..., r, out...)."""
  rank = a.shape[-1]
  n_lead = a.ndim + b.ndim - 2 - len(kernel_shape)   # each of a and b carries the stacked dims once
  lead_shape = a.shape[:n_lead]
  a2 = a.reshape(*lead_shape, -1, rank)
  b2 = b.reshape(*lead_shape, rank, -1)
  return jnp.matmul(a2, b2).reshape(kernel_shape)


def merge(params: PyTree, adapters: PyTree, scale: float) -> PyTree:
  """params with each adapted kernel W replaced by W + scale * A @ B (in W's dtype); other leaves as given."""
  if not adapters:
    return params

  def walk(p: Any, a: Any) -> Any:
    if isinstance(a, dict) and set(a) == {A, B}:
      return (p + scale * delta(a[A], a[B], p.shape).astype(jnp.float32)).astype(p.dtype)
    if not isinstance(p, dict):
      raise ValueError("adapters do not match the parameter tree")
    missing = set(a) - set(p)
    if missing:
      raise ValueError(f"adapters for {sorted(missing)[0]!r}, which the parameters do not have")
    return {k: walk(v, a[k]) if k in a else v for k, v in p.items()}

  return walk(dict(params), adapters)


def scaled(adapters: PyTree, scale: float) -> PyTree:
  """The adapters with every B multiplied by `scale`, so that (x A) B' = scale (x A) B: the form a model
  applies unmerged (nn.common.project), with the gradients of A and B flowing back through it."""
  def walk(a: Any) -> Any:
    if isinstance(a, dict) and set(a) == {A, B}:
      return {A: a[A], B: a[B] * jnp.asarray(scale, a[B].dtype)}
    return {k: walk(v) for k, v in a.items()}

  return walk(adapters)


def count(adapters: PyTree) -> int:
  """Adapter parameters."""
  return int(sum(x.size for x in jax.tree.leaves(adapters)))
