"""Splash attention: jax's Pallas TPU kernel (`jax.experimental.pallas.ops.tpu.splash_attention`) as
`runtime.attention='splash'`.

The one `ops.masks.Visibility` rule becomes the kernel's static mask: causal and a sliding window w
(w - 1 keys back; also w - 1 ahead when not causal) -> `BandMask`, a lazy band over the rows' global
positions whose tile lookups the band's bounds answer (the kernel's mask tables then cost O(partial
tiles) at trace time, not O(L x S)), neither -> `FullMask`; packed documents and padding become
`SegmentIds` (a query sees only keys with its id). GQA runs natively (the kernel maps query head h
to K/V head h // G: K/V are never repeated). The kernel takes one sequence (H, L, D): it is vmapped
over the batch and run per shard inside `jax.shard_map` over the mesh axes the logical 'batch' and
'heads' axes map to; with the 'length' axis sharded too (context parallelism, strategy 'all_gather')
queries stay sharded, K/V are gathered and the mask's block tables are split over the query shards,
as the kernel's `manual_sharding_spec` describes. A striped sequence (context load balancing,
`ops.context_parallel.stripe`) puts the mask's rows at their striped positions and the gathered K/V
back in natural order, so every query shard has the same visible tiles.

`interpret` comes from the target platform (resolve_runtime): native Mosaic on TPU, the Pallas
interpreter elsewhere (exact, slow: tests). Splash applies no softmax scale: q is pre-scaled.
What the kernel cannot express (a dense bias, ALiBi, dropout, global tokens, random blocks, a traced
decode offset) is `unsupported(...)`'s reason; config validation refuses those for 'splash'.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu import splash_attention as sa
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib
from jax.sharding import NamedSharding, PartitionSpec as P

from tformer_jax.ops import context_parallel as cp_ops
from tformer_jax.ops.masks import Visibility

Array = jax.Array
LANES = 128   # the kernel's key tiles are multiples of the TPU lane width, interpret mode included


def unsupported(vis: Visibility, l: int, s: int, *, bias: bool, alibi: bool, dropout: bool) -> str | None:
  """Why splash cannot compute this call (None when it can)."""
  if bias or alibi or dropout:
    return "a dense bias, ALiBi or attention dropout"
  if vis.num_global or vis.random is not None:
    return "global tokens or random blocks"
  if not vis.static_offset or vis.q_offset != 0 or l != s or vis.kv_positions_BxS is not None:
    return "decoding against a cache (a query offset)"
  return None


def block_size(block: int, length: int) -> int:
  """The largest tile <= block that divides `length` (a multiple of LANES)."""
  return math.gcd(min(block, length), length)


class BandMask(mask_lib._ComputableMask):
  """The Visibility band (causal and/or a sliding window) of query rows at global positions
  `q_sequence` (0..L-1, or the striped order of context load balancing) against key indices 0..S-1:
  key j is visible from position p when -right <= p - j <= left (None: unbounded on that side).

  The kernel's mask tables ask for every (q, kv) tile of the mask at trace time; a tile that the band's
  bounds decide (all visible, none visible) is answered with a shared constant block instead of an
  evaluated one, so building the tables costs O(partial tiles) mask work, not O(L x S). In the kernel
  the same function runs on the tile's positions (`mask_function`)."""

  def __init__(self, shape: tuple[int, int], left: int | None, right: int | None, q_sequence: np.ndarray,
               shard_count: int = 1):
    self.left, self.right = left, right

    def band(q_ids, kv_ids):
      ok = None if left is None else q_ids - left <= kv_ids
      if right is not None:
        ahead = q_ids + right >= kv_ids
        ok = ahead if ok is None else ok & ahead
      return ok

    super().__init__(shape=shape, mask_function=band, shard_count=shard_count)
    self.q_sequence = np.asarray(q_sequence, np.int32)
    self._blocks: dict[tuple[tuple[int, int], bool], np.ndarray] = {}

  def _constant(self, shape: tuple[int, int], value: bool) -> np.ndarray:
    block = self._blocks.get((shape, value))
    if block is None:
      block = np.full(shape, value, np.bool_)
      block.flags.writeable = False
      self._blocks[(shape, value)] = block
    return block

  def __getitem__(self, idx) -> np.ndarray:
    q_slice, kv_slice = idx
    rows = self.q_sequence[q_slice]
    k0, k1, _ = kv_slice.indices(self.shape[1])
    d_lo, d_hi = int(rows.min()) - (k1 - 1), int(rows.max()) - k0   # the range of p - j in the tile
    left, right = self.left, self.right
    shape = (len(rows), k1 - k0)
    if (left is None or d_hi <= left) and (right is None or d_lo >= -right):
      return self._constant(shape, True)
    if (left is not None and d_lo > left) or (right is not None and d_hi < -right):
      return self._constant(shape, False)
    return self.mask_function(rows[:, None], np.arange(k0, k1)[None, :])

  def __eq__(self, other: object):
    return (isinstance(other, BandMask) and np.array_equal(self.q_sequence, other.q_sequence)
            and (self.shape, self.left, self.right) == (other.shape, other.left, other.right))

  def __hash__(self):
    return hash((BandMask, self.shape, self.left, self.right, self.q_sequence.tobytes()))


def _mask(vis: Visibility, l: int, s: int, heads: int, shards: int, stripes: int) -> sa.MultiHeadMask:
  """Causal -> left unbounded, right 0; a window w -> left w - 1 (right w - 1 too when not causal);
  neither -> FullMask. Rows at their global positions (striped over `stripes` shards, or 0..L-1)."""
  if not (vis.causal or vis.window):
    return sa.MultiHeadMask([sa.FullMask((l, s))] * heads)
  left = vis.window - 1 if vis.window else None
  right = 0 if vis.causal else vis.window - 1
  rows = cp_ops.stripe_positions(l, stripes) if stripes > 1 else np.arange(l, dtype=np.int32)
  return sa.MultiHeadMask([BandMask((l, s), left, right, rows, shard_count=shards)] * heads)


def make_kernel(causal: bool, window: int, l: int, s: int, heads: int, head_shards: int, q_seq_shards: int,
                block_q: int, block_kv: int, interpret: bool, stripes: int = 0, softcap: float = 0.0):
  """The splash kernel for one (L, S) self-attention over `heads` query heads; tiles of block_q
  queries over L / q_seq_shards (over a stripe chunk when the rows are striped over `stripes` shards)
  and block_kv keys, forward and backward. Built per trace (its mask tables become constants of that
  trace: a cached kernel would leak them into the next; the kernel caches the tables themselves)."""
  vis = Visibility(causal=causal, window=window)
  chunk = l // (2 * stripes) if stripes > 1 else l // q_seq_shards
  bq, bk = block_size(block_q, chunk), block_size(block_kv, s)
  sizes = sa.BlockSizes(block_q=bq, block_kv=bk, block_kv_compute=bk, block_q_dkv=bq, block_kv_dkv=bk,
                        block_kv_dkv_compute=bk, block_q_dq=bq, block_kv_dq=bk)
  return sa.make_splash_mha(_mask(vis, l, s, heads, q_seq_shards, stripes), block_sizes=sizes,
                            head_shards=head_shards, q_seq_shards=q_seq_shards, interpret=interpret,
                            attn_logits_soft_cap=float(softcap) if softcap else None)


def _segments(vis: Visibility, b: int, l: int, s: int) -> tuple[Array, Array] | None:
  """(q ids (B, L), kv ids (B, S)) for the kernel, or None. Our padding (segment 0, invalid keys)
  gets kv id -1, which no query carries; queries of segment 0 see nothing (zeroed by `_seen`)."""
  if vis.q_segment_ids_BxL is None and vis.kv_valid_BxS is None:
    return None
  if vis.q_segment_ids_BxL is not None:
    q_ids = vis.q_segment_ids_BxL.astype(jnp.int32)
    kv = vis.kv_segment_ids_BxS if vis.kv_segment_ids_BxS is not None else vis.q_segment_ids_BxL
    kv_ids = jnp.where(kv == 0, -1, kv.astype(jnp.int32))
  else:
    q_ids, kv_ids = jnp.ones((b, l), jnp.int32), jnp.ones((b, s), jnp.int32)
  if vis.kv_valid_BxS is not None:
    kv_ids = jnp.where(vis.kv_valid_BxS.astype(bool), kv_ids, -1)
  return q_ids, kv_ids


def _seen(vis: Visibility, l: int, stripes: int) -> Array | None:
  """(B, L) bool: the query sees at least one key (the reference returns zeros for the others; the
  kernel would average over masked keys). Self-attention at offset 0 only; rows and keys in striped
  order over `stripes` shards when > 1."""
  seen = None
  if vis.q_segment_ids_BxL is not None:
    seen = vis.q_segment_ids_BxL != 0
  if vis.kv_valid_BxS is not None:   # a valid key within the query's band: cumulative counts
    valid = vis.kv_valid_BxS.astype(jnp.int32)
    valid = cp_ops.unstripe(valid, stripes) if stripes > 1 else valid
    c = jnp.pad(jnp.cumsum(valid, axis=1), ((0, 0), (1, 0)))
    i = jnp.asarray(cp_ops.stripe_positions(l, stripes)) if stripes > 1 else jnp.arange(l)
    hi = (i + 1) if vis.causal else jnp.minimum(l, i + vis.window) if vis.window else jnp.full((l,), l)
    lo = jnp.maximum(0, i - vis.window + 1) if vis.window else jnp.zeros((l,), jnp.int32)
    any_valid = (c[:, hi] - c[:, lo]) > 0
    seen = any_valid if seen is None else seen & any_valid
  return seen


def splash_attention(q_BxLxHxD: Array, k_BxSxKxD: Array, v_BxSxKxD: Array, vis: Visibility, *,
                     scale: float | None, block_q: int, block_kv: int, interpret: bool,
                     mesh=None, batch_axes=None, head_axes=None, context_axes=None, stripes: int = 0,
                     softcap: float = 0.0, sinks_H: Array | None = None) -> Array:
  """softmax(q k^T * scale) v under `vis` with the splash kernel; (B, L, H, D) like q. softcap > 0 caps
  the scores (the kernel's attn_logits_soft_cap); sinks_H (H,): a learned logit per head in every row's
  denominator (the kernel's sinks).

  mesh (an abstract mesh) with the mesh axes of the logical batch / heads / length axes: the kernel
  runs per shard inside shard_map (context_axes: queries sharded, K/V gathered). stripes > 1: the
  sequence (q, k, v, segment ids, padding) is in `ops.context_parallel.stripe` order over that many
  context shards; the gathered K/V go back to natural order in each shard and the mask's rows sit at
  their striped positions. Without a mesh, one program. L must be a multiple of 128 per shard, S a
  multiple of 128."""
  b, l, h, d = q_BxLxHxD.shape
  s = k_BxSxKxD.shape[1]
  scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
  sizes = dict(mesh.shape) if mesh is not None else {}

  def ways(axes) -> int:
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    return math.prod(sizes.get(a, 1) for a in axes)

  head_shards, q_shards = ways(head_axes), ways(context_axes)
  stripes = stripes if stripes > 1 and q_shards == stripes else 0
  kernel = make_kernel(bool(vis.causal), int(vis.window), l, s, h, head_shards, q_shards, block_q,
                       block_kv, bool(interpret), stripes, softcap)
  sinks = None if sinks_H is None else sinks_H.astype(jnp.float32)
  scope = _window_scope(vis, l, s, block_size(block_q, l), block_size(block_kv, s)) if vis.window else "splash"
  segs = _segments(vis, b, l, s)
  seen_BxL = _seen(vis, l, stripes)
  q_BxHxLxD = jnp.transpose(q_BxLxHxD * jnp.asarray(scale, q_BxLxHxD.dtype), (0, 2, 1, 3))
  k_BxKxSxD = jnp.transpose(k_BxSxKxD, (0, 2, 1, 3))
  v_BxKxSxD = jnp.transpose(v_BxSxKxD, (0, 2, 1, 3))

  def per_shard(kern, q, k, v, segs, sinks):
    if stripes:   # the whole K/V (gathered by shard_map) back to natural order, locally
      k, v = cp_ops.unstripe(k, stripes, axis=2), cp_ops.unstripe(v, stripes, axis=2)
      segs = None if segs is None else (segs[0], cp_ops.unstripe(segs[1], stripes))
    seg = None if segs is None else sa.SegmentIds(*segs)
    def run(q1, k1, v1, s1):
      return kern(q1, k1, v1, segment_ids=s1, sinks=sinks)

    return jax.vmap(run, in_axes=(0, 0, 0, None if seg is None else 0))(q, k, v, seg)

  with jax.named_scope(scope):
    out_BxHxLxD = _run(per_shard, kernel, q_BxHxLxD, k_BxKxSxD, v_BxKxSxD, segs, sinks, mesh, batch_axes,
                       head_axes, context_axes)
  out_BxLxHxD = jnp.transpose(out_BxHxLxD, (0, 2, 1, 3))
  if seen_BxL is not None:
    out_BxLxHxD = jnp.where(seen_BxL[:, :, None, None], out_BxLxHxD, 0.0).astype(q_BxLxHxD.dtype)
  return out_BxLxHxD


def _window_scope(vis: Visibility, l: int, s: int, block_q: int, block_kv: int) -> str:
  """The name scope of a sliding-window kernel's calls: 'splash_window_blocks_<visited>_of_<all>', the
  (query tile, key tile) pairs its band reaches against the whole grid, so `analysis.hlo` counts the band the
  kernel computes, not the (L x S) square (a causal kernel's skipped half stays counted: the FLOP formula's
  'full' convention)."""
  q0 = np.arange(0, l, block_q)[:, None]            # each tile's first and last query, first and last key
  q1 = np.minimum(q0 + block_q, l) - 1
  k0 = np.arange(0, s, block_kv)[None, :]
  k1 = np.minimum(k0 + block_kv, s) - 1
  w = vis.window
  visited = (k1 > q0 - w) & ((k0 <= q1) if vis.causal else (k0 < q1 + w))
  return f"splash_window_blocks_{int(visited.sum())}_of_{visited.size}"


def _run(per_shard, kernel, q, k, v, segs, sinks, mesh, batch_axes, head_axes, context_axes) -> Array:
  """per_shard over the whole arrays (no mesh), or per mesh shard in a shard_map."""
  if mesh is None or not mesh.shape:
    return per_shard(kernel, q, k, v, segs, sinks)
  q_spec = P(batch_axes, head_axes, context_axes, None)
  kv_spec = P(batch_axes, head_axes, None, None)
  kern_spec = kernel.manual_sharding_spec(NamedSharding(mesh, P(head_axes, context_axes)))
  seg_spec = None if segs is None else (P(batch_axes, context_axes), P(batch_axes, None))
  sink_spec = None if sinks is None else P(head_axes)
  specs = (kern_spec, q_spec, kv_spec, kv_spec, seg_spec, sink_spec)
  return jax.shard_map(per_shard, mesh=mesh, in_specs=specs, out_specs=q_spec,
                       check_vma=False)(kernel, q, k, v, segs, sinks)
