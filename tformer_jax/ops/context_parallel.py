"""Context parallelism: one sequence's attention split over a mesh axis ('context'), pure JAX.

Queries, keys and values arrive sharded contiguously along the sequence: shard i of n holds the
positions [i * C, (i + 1) * C) (C = L / n), the layout the logical 'length' rule gives activations.
Two strategies, both exact (the online-softmax rule of `ops.blockwise`), both for GQA (K/V never
repeated), causal or not, sliding windows, ALiBi, padding and packed documents (segment ids):

  all_gather  each shard gathers the whole K/V (and key masks) and attends its own queries at their
              global offset i * C with blockwise attention (which skips the tiles its band cannot
              see); the gather's transpose (a reduce-scatter) returns dK/dV to their owners.
  ring        K/V blocks travel round the ring with `ppermute` inside a scan, each step's partial
              (output, logsumexp) merged into the running one: no shard ever holds more than its own
              block and one visiting block. The backward (`jax.custom_vjp`) sends the blocks round
              again with their dK/dV accumulators (FlashAttention-2 per block, against the saved
              global output and logsumexp), so it needs no more memory than the forward.

Layouts. Contiguous: shard i holds positions [i * C, (i + 1) * C); with a causal mask shard i then
does i + 1 blocks of work, so the last shard is the busiest (time, not memory). Striped (MaxText's
load balancing, `stripe` / `unstripe`): the sequence is cut into 2n chunks and shard i holds chunks i
and 2n - 1 - i, so every shard sees the same number of visible keys. The caller permutes the token
order before the model (every (B, L) array of the batch: inputs, targets, positions, segment ids, loss
weights; `stripe_batch`) and says so (`striped=True`); 'all_gather' then un-permutes the gathered K/V
to natural order and attends each of its two query chunks at that chunk's global offset. RoPE takes
the explicit (permuted) positions, and a token-sum loss does not depend on the order.
`context_parallel_attention` runs either strategy inside `jax.shard_map` over the named axis.
"""
from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from tformer_jax.ops import blockwise
from tformer_jax.ops.blockwise import blockwise_attention

Array = jax.Array
STRATEGIES = ("all_gather", "ring")


def stripe_chunks(n: int) -> np.ndarray:
  """The 2n chunks in striped order: shard i of n holds chunks i and 2n - 1 - i ([0, 2n-1, 1, 2n-2, ..])."""
  return np.stack([np.arange(n), 2 * n - 1 - np.arange(n)], axis=1).reshape(-1)


def stripe_positions(length: int, n: int) -> np.ndarray:
  """(L,) int32: the global position at each index of the striped order over n shards."""
  if length % (2 * n):
    raise ValueError(f"context load balancing: sequence length {length} is not divisible by 2 x {n} chunks")
  c = length // (2 * n)
  return (stripe_chunks(n)[:, None] * c + np.arange(c)[None, :]).reshape(-1).astype(np.int32)


def _reorder(x: Array, order: np.ndarray, axis: int) -> Array:
  axis = axis % x.ndim
  shape = x.shape
  chunks = x.reshape(shape[:axis] + (len(order), shape[axis] // len(order)) + shape[axis + 1:])
  return jnp.take(chunks, jnp.asarray(order), axis=axis).reshape(shape)


def stripe(x: Array, n: int, axis: int = 1) -> Array:
  """Natural order -> striped order along `axis` (n shards, 2n chunks)."""
  return _reorder(x, stripe_chunks(n), axis)


def unstripe(x: Array, n: int, axis: int = 1) -> Array:
  """Striped order -> natural order along `axis` (the inverse of `stripe`)."""
  return _reorder(x, np.argsort(stripe_chunks(n)), axis)


def stripe_batch(batch: dict[str, Array], n: int) -> dict[str, Array]:
  """A training batch in striped order: every array shaped (B, L, ...) like batch['inputs'] permuted
  along L, with explicit positions (0..L-1 unless the batch has its own, e.g. packed documents)."""
  b, l = batch["inputs"].shape[:2]
  out = dict(batch)
  if "positions" not in out:
    out["positions"] = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l))
  return {k: stripe(x, n) if getattr(x, "ndim", 0) >= 2 and x.shape[:2] == (b, l) else x for k, x in out.items()}


def _tile(block: int, length: int) -> int:
  return math.gcd(max(1, min(block, length)), length)


def _merge(o_a: Array, lse_a: Array, o_b: Array, lse_b: Array) -> tuple[Array, Array]:
  """Two partial softmax results over disjoint key sets -> their union's. lse = -inf: no key seen."""
  lse = jnp.logaddexp(lse_a, lse_b)
  seen = lse > -jnp.inf
  w_a = jnp.where(seen, jnp.exp(lse_a - jnp.where(seen, lse, 0.0)), 0.0)
  w_b = jnp.where(seen, jnp.exp(lse_b - jnp.where(seen, lse, 0.0)), 0.0)
  return o_a * w_a[..., None] + o_b * w_b[..., None], lse


def _block_aux(aux: dict, kv: tuple, i: Array, j: Array, c: int) -> dict:
  """blockwise's mask inputs for local queries (shard i) against the key block of shard j."""
  kv_valid, kv_seg = kv
  return dict(aux, q_offset=((i - j) * c).astype(jnp.int32), kv_valid=kv_valid, kv_seg=kv_seg)


def _rotate(xs: tuple, axis: str, n: int) -> tuple:
  perm = [(s, (s + 1) % n) for s in range(n)]
  return tuple(None if x is None else jax.lax.ppermute(x, axis, perm) for x in xs)


def _ring_forward(st, axis: str, n: int, q: Array, k: Array, v: Array, aux: dict, kv: tuple):
  """Head-major q (B, K, G, C, D) pre-scaled, k/v (B, K, C, D): (o float32, lse with +inf = unseen)."""
  i = jax.lax.axis_index(axis)
  c = q.shape[3]

  def partial(k_j, v_j, kv_j, j):
    o_t, lse_t = blockwise._forward(st, q, k_j, v_j, _block_aux(aux, kv_j, i, j, c))
    return o_t.astype(jnp.float32), jnp.where(jnp.isinf(lse_t), -jnp.inf, lse_t)

  o, lse = partial(k, v, kv, i)

  def step(carry, t):
    o, lse, k_j, v_j, kv_j = carry
    k_j, v_j, *kv_j = _rotate((k_j, v_j) + tuple(kv_j), axis, n)
    o_t, lse_t = partial(k_j, v_j, tuple(kv_j), (i - t) % n)
    o, lse = _merge(o, lse, o_t, lse_t)
    return (o, lse, k_j, v_j, tuple(kv_j)), None

  (o, lse, *_), _ = jax.lax.scan(step, (o, lse, k, v, kv), jnp.arange(1, n))
  return o, jnp.where(lse == -jnp.inf, jnp.inf, lse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _ring(st, axis: str, n: int, q: Array, k: Array, v: Array, aux: dict, kv: tuple) -> Array:
  return _ring_forward(st, axis, n, q, k, v, aux, kv)[0].astype(q.dtype)


def _ring_fwd(st, axis, n, q, k, v, aux, kv):
  o, lse = _ring_forward(st, axis, n, q, k, v, aux, kv)
  o = o.astype(q.dtype)
  return o, (q, k, v, aux, kv, o, lse)


def _ring_bwd(st, axis, n, res, do):
  q, k, v, aux, kv, o, lse = res
  i = jax.lax.axis_index(axis)
  c = q.shape[3]

  def step(carry, t):
    dq, k_j, v_j, kv_j, dk_j, dv_j = carry
    aux_j = _block_aux(aux, kv_j, i, (i - t) % n, c)
    dq_t, dk_t, dv_t, _ = blockwise._backward(st, q, k_j, v_j, aux_j, o, lse, do)
    k_j, v_j, dk_j, dv_j, *kv_j = _rotate((k_j, v_j, dk_j + dk_t, dv_j + dv_t) + tuple(kv_j), axis, n)
    return (dq + dq_t, k_j, v_j, tuple(kv_j), dk_j, dv_j), None

  zeros = jnp.zeros(k.shape, jnp.float32)
  init = (jnp.zeros(q.shape, jnp.float32), k, v, kv, zeros, zeros)
  (dq, _, _, _, dk, dv), _ = jax.lax.scan(step, init, jnp.arange(n))   # n hops: dK/dV are home again
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), blockwise.zero_cotangents(aux),
          blockwise.zero_cotangents(kv))


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention(q_BxCxHxD: Array, k_BxCxKxD: Array, v_BxCxKxD: Array, *, axis: str, causal: bool = True,
                   window: int = 0, alibi_slopes_H: Array | None = None, kv_valid_BxC: Array | None = None,
                   q_segment_ids_BxC: Array | None = None, kv_segment_ids_BxC: Array | None = None,
                   scale: float | None = None, block_q: int = 128, block_k: int = 128) -> Array:
  """Per-shard ring attention (call inside shard_map over `axis`): this shard's queries against
  every shard's keys, (B, C, H, D). Semantics of `ops.blockwise.blockwise_attention` on the whole
  sequence."""
  b, c, h, d = q_BxCxHxD.shape
  kh = k_BxCxKxD.shape[2]
  g = h // kh
  n = jax.lax.axis_size(axis)
  scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
  st = blockwise._Static(causal=bool(causal), window=int(window), scale=scale, block_q=_tile(block_q, c),
                         block_k=_tile(block_k, c))
  kv_seg = q_seg = None
  if q_segment_ids_BxC is not None:
    q_seg = q_segment_ids_BxC.astype(jnp.int32)
    kv_seg = q_seg if kv_segment_ids_BxC is None else kv_segment_ids_BxC.astype(jnp.int32)
  slopes = None if alibi_slopes_H is None else jnp.asarray(alibi_slopes_H, jnp.float32).reshape(h)
  aux = {"q_offset": jnp.int32(0), "slopes": slopes, "kv_valid": None, "q_seg": q_seg, "kv_seg": None}
  kv = (None if kv_valid_BxC is None else kv_valid_BxC.astype(bool), kv_seg)
  q = (q_BxCxHxD * jnp.asarray(scale, q_BxCxHxD.dtype)).reshape(b, c, kh, g, d).transpose(0, 2, 3, 1, 4)
  k = jnp.transpose(k_BxCxKxD, (0, 2, 1, 3))
  v = jnp.transpose(v_BxCxKxD, (0, 2, 1, 3))
  o_BxKxGxCxD = _ring(st, axis, n, q, k, v, aux, kv)
  return jnp.transpose(o_BxKxGxCxD, (0, 3, 1, 2, 4)).reshape(b, c, h, d)


def all_gather_attention(q_BxCxHxD: Array, k_BxCxKxD: Array, v_BxCxKxD: Array, *, axis: str,
                         causal: bool = True, window: int = 0, alibi_slopes_H: Array | None = None,
                         kv_valid_BxC: Array | None = None, q_segment_ids_BxC: Array | None = None,
                         kv_segment_ids_BxC: Array | None = None, scale: float | None = None,
                         block_q: int = 128, block_k: int = 128, striped: bool = False) -> Array:
  """Per-shard all-gather attention (inside shard_map over `axis`): (B, C, H, D). striped: the
  sequence is in `stripe` order; the gathered K/V go back to natural order and each of this shard's
  two query chunks attends at its own global offset."""
  c = q_BxCxHxD.shape[1]
  n = jax.lax.axis_size(axis)
  i = jax.lax.axis_index(axis)

  def gather(x):
    if x is None:
      return None
    x = jax.lax.all_gather(x, axis, axis=1, tiled=True)
    return unstripe(x, n) if striped else x

  kv_seg = q_segment_ids_BxC if kv_segment_ids_BxC is None else kv_segment_ids_BxC
  kw = dict(causal=causal, window=window, alibi_slopes_H=alibi_slopes_H, kv_valid_BxS=gather(kv_valid_BxC),
            kv_segment_ids_BxS=gather(kv_seg), scale=scale, block_q=block_q, block_k=block_k)
  k, v = gather(k_BxCxKxD), gather(v_BxCxKxD)
  if not striped:
    return blockwise_attention(q_BxCxHxD, k, v, q_offset=i * c, q_segment_ids_BxL=q_segment_ids_BxC, **kw)
  h = c // 2
  outs = []
  for half, offset in enumerate((i * h, (2 * n - 1 - i) * h)):   # chunks i and 2n - 1 - i
    seg = None if q_segment_ids_BxC is None else q_segment_ids_BxC[:, half * h:(half + 1) * h]
    outs.append(blockwise_attention(q_BxCxHxD[:, half * h:(half + 1) * h], k, v, q_offset=offset,
                                    q_segment_ids_BxL=seg, **kw))
  return jnp.concatenate(outs, axis=1)


def context_parallel_attention(q_BxLxHxD: Array, k_BxLxKxD: Array, v_BxLxKxD: Array, *, mesh: Any,
                               axis: str, strategy: str = "all_gather", batch_axes: Any = None,
                               head_axes: Any = None, kv_head_axes: Any = None, striped: bool = False,
                               **kw) -> Array:
  """Self-attention over a sequence sharded along mesh axis `axis` (and the batch / heads over
  `batch_axes` / `head_axes`): `strategy` ('all_gather' | 'ring') run per shard under shard_map.
  striped: the sequence (q, k, v and every per-token array) is in `stripe` order ('all_gather' only).
  kw: causal, window, alibi_slopes_H, kv_valid_BxS, q_segment_ids_BxL, kv_segment_ids_BxS, scale,
  block_q, block_k (as `ops.blockwise.blockwise_attention`). Returns (B, L, H, D) sharded like q."""
  if strategy not in STRATEGIES:
    raise ValueError(f"context strategy {strategy!r}: expected one of {STRATEGIES}")
  if striped and strategy != "all_gather":
    raise ValueError(f"context load balancing (a striped sequence) runs with 'all_gather', not {strategy!r}")
  fn = ring_attention if strategy == "ring" else functools.partial(all_gather_attention, striped=striped)
  n = dict(mesh.shape)[axis]
  if q_BxLxHxD.shape[1] % (2 * n if striped else n):
    raise ValueError(f"context parallelism: sequence length {q_BxLxHxD.shape[1]} is not divisible by "
                     f"{'2 x ' if striped else ''}the {axis!r} axis size {n}")
  arrays = dict(alibi_slopes_H=kw.pop("alibi_slopes_H", None), kv_valid_BxC=kw.pop("kv_valid_BxS", None),
                q_segment_ids_BxC=kw.pop("q_segment_ids_BxL", None),
                kv_segment_ids_BxC=kw.pop("kv_segment_ids_BxS", None))
  arrays = {name: x for name, x in arrays.items() if x is not None}
  seq = P(batch_axes, axis)
  specs = {name: P(head_axes) if name == "alibi_slopes_H" else seq for name in arrays}
  q_spec, kv_spec = P(batch_axes, axis, head_axes, None), P(batch_axes, axis, kv_head_axes, None)

  def per_shard(q, k, v, arrays):
    return fn(q, k, v, axis=axis, **arrays, **kw)

  return jax.shard_map(per_shard, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, specs), out_specs=q_spec,
                       check_vma=False)(q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, arrays)
