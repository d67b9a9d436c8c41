"""Expert-parallel MoE FFN: each device runs only its own experts, on the rows routed to them.

Pure jax (no Flax), one `jax.shard_map` over a mesh. The experts are split over `expert_axis` (P devices,
E_l = E / P experts each, device j owning experts j*E_l .. (j+1)*E_l - 1); the tokens are split over
`token_axes` (the batch axes, the expert axis among them). Per device, with its T_l tokens and their
N_l = T_l * K (token, expert) rows:

  1. sort the local rows by expert; all-gather the per-expert row counts over the expert axis, so every
     device knows the whole (source, destination, local expert) count matrix;
  2. send each row to the device owning its expert (`exchange`): 'ragged' is
     `jax.lax.ragged_all_to_all` (TPU, GPU); 'all_to_all' the same exchange emulated exactly with a
     dense `all_to_all` over fixed (P, C, D) buffers (XLA:CPU has no ragged-all-to-all);
  3. sort the received rows by local expert and run the expert FFN as grouped matmuls (`gmm`):
     `jax.lax.ragged_dot`, or the Pallas megablox kernel (TPU; `interpret=True` elsewhere);
  4. send the results back the same way, unsort, and combine each token's K rows with its routing
     weights.

Each device receives into R rows. Dropless: R = the worst case P * T_l * min(K, E_l) (nothing can
drop), or, with `buffer_factor` f > 0, R = ceil(f * N_l) (N_l is the balanced load): rows past R are
dropped (from the last sources, last experts first) and counted. Capacity: the caller's `keep_TxK`
(the global GShard priority of `ops.moe.kept_assignments`) removes rows before the exchange, and
R = E_l * capacity bounds what can arrive. The router and its losses stay outside (the global batch).
Expert weights may be split along their other dims (FSDP 'embed'): they are all-gathered inside,
whose transpose is the gradient's reduce-scatter.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.megablox import ops as megablox
from jax.sharding import PartitionSpec as P

from tformer_jax.ops import moe as moe_ops

Array = jax.Array
Params = Mapping[str, Array]
EXCHANGES = ("all_to_all", "ragged")
GMMS = ("ragged_dot", "megablox")


def receive_rows(num_tokens: int, num_experts: int, top_k: int, experts_axis_size: int,
                 token_shards: int, *, capacity: int | None = None, buffer_factor: float = 0.0) -> int:
  """R, the rows each device receives into (see the module docstring); a multiple of 8 when it
  can be (never above the worst case)."""
  t_l = num_tokens // token_shards
  e_l = num_experts // experts_axis_size
  worst = experts_axis_size * t_l * min(top_k, e_l)
  if capacity is not None:
    want = e_l * capacity
  elif buffer_factor > 0:
    want = int(math.ceil(buffer_factor * t_l * top_k))
  else:
    want = worst
  return max(1, min(worst, -(-want // 8) * 8))


def _excl_cumsum(x: Array, axis: int) -> Array:
  return jnp.cumsum(x, axis=axis) - x


def emulated_ragged_all_to_all(operand: Array, output: Array, input_offsets: Array, send_sizes: Array,
                               output_offsets: Array, recv_sizes: Array, *, axis_name: str,
                               chunk: int) -> Array:
  """`jax.lax.ragged_all_to_all`'s result through a dense `all_to_all` of (P, chunk, D) buffers.

  chunk: an upper bound of every send size. Exact (rows are copied, never summed); moves P * chunk
  rows per device where the ragged form moves sum(send_sizes)."""
  n = operand.shape[0]
  q_C = jnp.arange(chunk)
  src_PxC = jnp.clip(input_offsets[:, None] + q_C[None], 0, n - 1)
  ok_PxC = q_C[None] < send_sizes[:, None]
  buf_PxCxD = jnp.where(ok_PxC[..., None], jnp.take(operand, src_PxC, axis=0), 0)
  got_PxCxD = jax.lax.all_to_all(buf_PxCxD, axis_name, 0, 0)
  # where each source put its chunk in our buffer (the senders' output_offsets, transposed)
  off_P = jax.lax.all_to_all(output_offsets[:, None], axis_name, 0, 0)[:, 0]
  dst_PxC = jnp.where(q_C[None] < recv_sizes[:, None], off_P[:, None] + q_C[None], output.shape[0])
  return output.at[dst_PxC.reshape(-1)].set(got_PxCxD.reshape(-1, operand.shape[-1]), mode="drop",
                                           unique_indices=True)


def _exchange(kind: str, chunk: int, axis: str, *args) -> Array:
  if kind == "ragged":
    return jax.lax.ragged_all_to_all(*args, axis_name=axis)
  return emulated_ragged_all_to_all(*args, axis_name=axis, chunk=chunk)


def _tile(n: int, pref: int = 128) -> int:
  t = pref
  while t > 1 and n % t:
    t //= 2
  return t


def grouped_matmul(x_MxD: Array, w_GxDxF: Array, group_sizes_G: Array, *, gmm: str = "ragged_dot",
                   interpret: bool = False) -> Array:
  """Rows of x (sorted by group, sum(group_sizes) <= M) times their group's matrix: (M, F)."""
  w = w_GxDxF.astype(x_MxD.dtype)
  if gmm == "megablox":
    m, k = x_MxD.shape
    tiling = (_tile(m), _tile(k), _tile(w.shape[-1]))
    return megablox.gmm(x_MxD, w, group_sizes_G.astype(jnp.int32), x_MxD.dtype, tiling, None, None,
                        False, interpret)
  if gmm != "ragged_dot":
    raise ValueError(f"unknown grouped matmul {gmm!r}; expected one of {GMMS}")
  return jax.lax.ragged_dot(x_MxD, w, group_sizes_G)


def _experts(x_MxD: Array, params: Params, group_sizes_G: Array, valid_M: Array, group_M: Array,
             activation: str, gmm: str, interpret: bool, swiglu_limit: float, swiglu_alpha: float) -> Array:
  """The local experts on their sorted rows; group_M: each row's local expert (for the expert biases)."""
  def mm(h, name):
    y = grouped_matmul(h, params[name], group_sizes_G, gmm=gmm, interpret=interpret)
    return jnp.where(valid_M[:, None], y, 0)   # rows past the groups: zero (megablox leaves them unset)

  def bias(name):
    b = params.get(moe_ops.bias_name(name))
    return None if b is None else jnp.take(b, jnp.clip(group_M, 0, b.shape[0] - 1), axis=0)

  return moe_ops.apply_experts(x_MxD, mm, bias, activation, swiglu_limit, swiglu_alpha)


def _gather_weights(params: Params, specs: Mapping[str, P]) -> dict[str, Array]:
  """All-gather each local expert weight over the mesh axes splitting its non-expert dims."""
  out = {}
  for name, w in params.items():
    for dim, axes in enumerate(tuple(specs[name])[1:], start=1):
      if axes:
        w = jax.lax.all_gather(w, axes, axis=dim, tiled=True)
    out[name] = w
  return out


def _plan(e_N: Array, num_experts: int, p: int, rows: int, axis: str):
  """The exchange plan, identical on every device of the expert group, from the all-gathered counts.

  Returns (order_N, counts, me): counts holds (P, P) source x destination matrices 'send' (wanted),
  'allowed' (fitting in R, sources in order, each chunk's tail dropped first), 'in_off' (a chunk's
  start in its source's sorted rows), 'out_off' (its start in the destination's buffer), and
  'allowed_SxJxL' per local expert."""
  e_l = num_experts // p
  order_N = jnp.argsort(e_N, stable=True)
  counts_E = jnp.zeros((num_experts + 1,), jnp.int32).at[e_N].add(1)[:num_experts]
  c_SxJxL = jax.lax.all_gather(counts_E, axis).reshape(p, p, e_l)
  send_SxJ = jnp.sum(c_SxJxL, axis=-1)
  allowed_SxJ = jnp.clip(rows - _excl_cumsum(send_SxJ, 0), 0, send_SxJ)
  allowed_SxJxL = jnp.clip(allowed_SxJ[..., None] - _excl_cumsum(c_SxJxL, 2), 0, c_SxJxL)
  plan = dict(send=send_SxJ, allowed=allowed_SxJ, allowed_SxJxL=allowed_SxJxL,
              in_off=_excl_cumsum(send_SxJ, 1), out_off=_excl_cumsum(allowed_SxJ, 0))
  return order_N, plan, jax.lax.axis_index(axis)


def _local_ffn(x_TxD: Array, w_TxK: Array, e_TxK: Array, keep_TxK: Array, params: Params, *,
               specs: Mapping[str, P], activation: str, num_experts: int, p: int, rows: int,
               axis: str, exchange: str, gmm: str, interpret: bool, token_axes: Sequence[str],
               swiglu_limit: float = 0.0, swiglu_alpha: float = 1.702):
  """One device's part: see the module docstring. Returns (y_TxD, dropped rows of the whole mesh)."""
  t, k = e_TxK.shape
  n, e_l = t * k, num_experts // p
  params = _gather_weights(params, specs)
  e_N = jnp.where(keep_TxK.reshape(-1), e_TxK.reshape(-1), num_experts)   # removed -> sorted last
  order_N, pl, me = _plan(e_N, num_experts, p, rows, axis)
  xs_NxD = jnp.take(x_TxD, order_N // k, axis=0)
  chunk = min(rows, n, t * e_l)
  go = (pl["in_off"][me], pl["allowed"][me], pl["out_off"][me], pl["allowed"][:, me])
  # buffers made like a device-varying array: a fresh jnp.zeros is mesh-invariant, and its implicit
  # cast to varying transposes into an all-reduce of the whole buffer in the backward pass
  recv_RxD = _exchange(exchange, chunk, axis, xs_NxD, jnp.zeros_like(xs_NxD, shape=(rows, x_TxD.shape[-1])),
                       *go)
  # local expert of each received row: sources in order, each source's rows by local expert
  a_SxL = pl["allowed_SxJxL"][:, me]
  ends = jnp.cumsum(a_SxL.reshape(-1))                          # (source, expert) segments
  r_R = jnp.arange(rows)
  seg_R = jnp.sum(r_R[:, None] >= ends[None], axis=-1)           # = P * E_l past the end
  valid_R = seg_R < p * e_l
  l_R = jnp.where(valid_R, seg_R % e_l, e_l)
  order_R = jnp.argsort(l_R, stable=True)
  sizes_L = jnp.sum(a_SxL, axis=0)
  valid_sorted_R = jnp.arange(rows) < jnp.sum(sizes_L)
  y_sorted_RxD = _experts(jnp.take(recv_RxD, order_R, axis=0), params, sizes_L, valid_sorted_R,
                          jnp.take(l_R, order_R), activation, gmm, interpret, swiglu_limit, swiglu_alpha)
  y_RxD = jnp.zeros_like(y_sorted_RxD).at[order_R].set(y_sorted_RxD, unique_indices=True)
  back = (pl["out_off"][:, me], pl["allowed"][:, me], pl["in_off"][:, me], pl["allowed"][me])
  ys_NxD = _exchange(exchange, chunk, axis, y_RxD, jnp.zeros_like(xs_NxD), *back)
  y_NxD = jnp.zeros_like(ys_NxD).at[order_N].set(ys_NxD, unique_indices=True)
  w_TxK = jnp.where(keep_TxK, w_TxK, 0.0).astype(y_NxD.dtype)
  y_TxD = jnp.einsum("tk,tkd->td", w_TxK, y_NxD.reshape(t, k, -1))
  dropped = jnp.sum(pl["send"][:, me] - pl["allowed"][:, me]).astype(jnp.float32)   # as receiver
  return y_TxD, jax.lax.psum(dropped, tuple(token_axes))


def moe_ffn_expert_parallel(x_TxD: Array, params: Params, weights_TxK: Array, experts_TxK: Array, *,
                            activation: str, mesh, expert_axis: str = "expert",
                            token_axes: Sequence[str] = (), param_specs: Mapping[str, P] | None = None,
                            keep_TxK: Array | None = None, capacity: int | None = None,
                            buffer_factor: float = 0.0, exchange: str = "all_to_all",
                            gmm: str = "ragged_dot", interpret: bool = False, swiglu_limit: float = 0.0,
                            swiglu_alpha: float = 1.702) -> tuple[Array, Array]:
  """The MoE FFN of the global (T, D) tokens, expert parallel over `mesh` (a Mesh or AbstractMesh).

  token_axes: mesh axes splitting T (the expert axis is added last when absent); param_specs: each
  expert weight's PartitionSpec (dim 0 must be `expert_axis`; default: experts split, the rest
  whole). keep_TxK + capacity: capacity dispatch (the kept assignments, the slots per expert). Expert
  biases (b_gate, ..., present in params) are split like their weights; swiglu_limit: see `ops.moe.glu`.
  Returns (y_TxD, dropped_fraction of the T*K assignments lost to the receive buffer)."""
  if exchange not in EXCHANGES:
    raise ValueError(f"unknown exchange {exchange!r}; expected one of {EXCHANGES}")
  names = moe_ops.expert_param_names(activation)
  num_experts = params[names[0]].shape[0]
  names = names + tuple(moe_ops.bias_name(n) for n in names if moe_ops.bias_name(n) in params)
  t, k = experts_TxK.shape
  p = mesh.shape[expert_axis]
  token_axes = tuple(a for a in token_axes if a != expert_axis) + (expert_axis,)
  shards = math.prod(mesh.shape[a] for a in token_axes)
  if num_experts % p or t % shards:
    raise ValueError(f"expert parallelism: {num_experts} experts over {p} devices and {t} tokens over "
                     f"{shards} shards must divide evenly")
  specs = {n: (param_specs or {}).get(n, P(expert_axis)) for n in names}
  specs = {n: P(*(tuple(s) + (None,) * 3)[:params[n].ndim]) for n, s in specs.items()}
  if any(s[0] != expert_axis for s in specs.values()):
    raise ValueError(f"expert weights must be split over {expert_axis!r} along dim 0, got {specs}")
  rows = receive_rows(t, num_experts, k, p, shards, capacity=capacity, buffer_factor=buffer_factor)
  if keep_TxK is None:
    keep_TxK = jnp.ones(experts_TxK.shape, bool)
  tok = P(token_axes)

  def local(x, w, e, keep, prm):
    return _local_ffn(x, w, e, keep, prm, specs=specs, activation=activation, num_experts=num_experts,
                      p=p, rows=rows, axis=expert_axis, exchange=exchange, gmm=gmm,
                      interpret=interpret, token_axes=token_axes, swiglu_limit=swiglu_limit,
                      swiglu_alpha=swiglu_alpha)

  # the Pallas kernel's outputs carry no varying-axes annotation, so megablox runs unchecked
  fn = jax.shard_map(local, mesh=mesh, in_specs=(tok, tok, tok, tok, {n: specs[n] for n in names}),
                     out_specs=(tok, P()), check_vma=gmm != "megablox")
  y_TxD, dropped = fn(x_TxD, weights_TxK, experts_TxK, keep_TxK, {n: params[n] for n in names})
  return y_TxD, dropped / (t * k)
