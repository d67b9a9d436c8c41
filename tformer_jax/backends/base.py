"""The reference backend: plain `jnp` and ordinary autodiff (forward mode included), every platform.

A backend is the one door between the model and execution choices. `nn/` calls:
  dense(spec, x, w)                      a projection, `jnp.einsum(spec, x, w)`
  norm(x, scale, bias, eps, center)      LayerNorm (center) / RMSNorm, `ops.norms.normalize`
  attention(q, k, v, vis, ...)           softmax (or linear) attention under a `ops.masks.Visibility`
  residual(x)                            the residual stream entering a block (identity here)
  moe_ffn(x, params, weights, experts, ...)  the routed experts (global, or expert parallel)
and the train step's optimizer comes from wrap_optimizer(tx, spec) (it calls `tx.update`).
Subclasses (backends/cpu/xla_cpu.py) change how these run, never what they compute.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
from typing import Any, Callable, ClassVar

import jax
import jax.numpy as jnp
import optax
from flax.linen import partitioning as flax_partitioning

from tformer_jax import config as config_lib
from tformer_jax.backends import moe as moe_backend, splash as splash_lib
from tformer_jax.ops import attention as attn_ops, context_parallel as cp_ops, norms as norm_ops, positions as pos_ops
from tformer_jax.ops.blockwise import blockwise_attention
from tformer_jax.ops.chunked_attention import chunked_attention
from tformer_jax.ops.linear_attention import linear_attention, linear_attention_quadratic
from tformer_jax.ops.masks import Visibility

Array = jax.Array
PyTree = Any
log = logging.getLogger("tformer_jax")

# reference: one dense softmax; chunked / blockwise: tiled, exact (ops/chunked_attention.py,
# ops/blockwise.py); xla / cudnn: jax.nn.dot_product_attention; splash: jax's Pallas TPU kernel
# (backends/splash.py).
ATTENTION_IMPLS = tuple(config_lib.ATTENTION_LACKS)   # what each lacks: config.ATTENTION_LACKS
CONTEXT_STRATEGIES = ("all_gather", "ring")   # ops/context_parallel.py
MOE_EXCHANGES = ("global", "all_to_all", "ragged")
MOE_GMMS = ("ragged_dot", "megablox")


@dataclasses.dataclass(frozen=True)
class AdamWSpec:
  """What an optimizer implementation needs to know of `train.optim.make_optimizer`'s AdamW chain."""
  schedule: Callable[[Array], Array]
  b1: float
  b2: float
  eps: float
  weight_decay: float
  clip_norm: float
  decay_mask: Callable[[PyTree], PyTree]


@dataclasses.dataclass(frozen=True)
class Backend:
  """attention_impl: one of ATTENTION_IMPLS; block_q / block_k: the blockwise tiles (block_q is also
  the chunked query chunk). Which model features each implementation lacks is config.ATTENTION_LACKS
  (config validation refuses such a model); decoding steps of the tiled paths run the dense path."""
  attention_impl: str = "reference"
  block_q: int = 128
  block_k: int = 128
  # MoE (backends/moe.py): the expert exchange (global: no expert parallelism; all_to_all: dense
  # all-to-all, every platform; ragged: ragged_all_to_all, TPU/GPU), the grouped matmul
  # (ragged_dot | megablox) and megablox's Pallas interpret mode (a target other than TPU).
  moe_exchange: str = "global"
  moe_gmm: str = "ragged_dot"
  moe_interpret: bool = False
  # splash (backends/splash.py): its query / key tiles (clipped to the sequence) and Pallas interpret
  # mode (a target other than TPU). context_strategy: how attention runs when the traced mesh shards
  # the logical 'length' axis (context parallelism, ops/context_parallel.py); context_load_balance:
  # the train/eval steps stripe a causal model's sequence over the context shards ('all_gather'
  # only; `stripe_shards`), and trace the model under this backend with context_stripes = the shard
  # count, which tells attention the token order is striped (0: contiguous).
  splash_block_q: int = 512
  splash_block_kv: int = 512
  splash_interpret: bool = True
  context_strategy: str = "all_gather"
  context_load_balance: bool = True
  context_stripes: int = 0
  # '' : a call cuDNN cannot serve is an error (the user asked for 'cudnn'); else the impl it runs
  # instead ('auto' on a GPU).
  cudnn_fallback: str = ""
  # decoding (decode.decode_layout): 'scanned' (one compiled layer body) | 'unrolled' (the layers one
  # by one: no per-step copy of each layer's weights out of the stack, faster per token on XLA:CPU)
  decode_layout: str = "scanned"
  name: ClassVar[str] = "reference"

  def __post_init__(self):
    if self.attention_impl not in ATTENTION_IMPLS:
      raise ValueError(f"attention: unknown implementation {self.attention_impl!r}; expected one of "
                       f"{ATTENTION_IMPLS}")
    if self.context_strategy not in CONTEXT_STRATEGIES:
      raise ValueError(f"context_strategy: unknown {self.context_strategy!r}; expected one of "
                       f"{CONTEXT_STRATEGIES}")
    if self.moe_exchange not in MOE_EXCHANGES or self.moe_gmm not in MOE_GMMS:
      raise ValueError(f"moe: unknown exchange {self.moe_exchange!r} or grouped matmul {self.moe_gmm!r}; "
                       f"expected one of {MOE_EXCHANGES} and {MOE_GMMS}")

  def describe(self) -> str:
    return f"{self.name} (attention {self.attention_impl})"

  def stripe_shards(self, length: int) -> int:
    """The context shards a causal model's sequence of `length` tokens is striped over in the step
    being traced (ops.context_parallel.stripe_batch), 1 for none: load balancing on, strategy
    'all_gather', a context axis > 1 in the traced mesh and length a multiple of 2 x its size."""
    layout = attention_layout()
    n = 1 if layout is None else layout.fit(1, length, 1, 1).context_size
    on = self.context_load_balance and self.context_strategy == "all_gather"
    return n if on and n > 1 and length % (2 * n) == 0 else 1

  def dense(self, spec: str, x: Array, w: Array) -> Array:
    return jnp.einsum(spec, x, w)

  def glu(self, activation: str, act: Callable[[Array], Array], gate: Array, up: Array) -> Array:
    """The GLU FFN's gated activation, act(gate) * up; activation: its name (model.activation, e.g. 'swiglu')."""
    return act(gate) * up

  def loss_matmul(self) -> Callable[[Array, Array, bool, bool], Array] | None:
    """The 2-D matmul the fused cross-entropy's products run on (ops.losses.nll_sum's `matmul`); None:
    XLA's dot."""
    return None

  def norm(self, x: Array, scale: Array, bias: Array | None, *, eps: float, center: bool) -> Array:
    return norm_ops.normalize(x, scale, bias, eps, center)

  def residual(self, x_BxLxD: Array) -> Array:
    return x_BxLxD

  def moe_ffn(self, x_TxD: Array, params: dict[str, Array], weights_TxK: Array, experts_TxK: Array, *,
              activation: str, dispatch: str, capacity: int, buffer_factor: float = 0.0,
              capacity_impl: str = "einsum", param_axes: dict[str, tuple[str, ...]],
              swiglu_limit: float = 0.0, swiglu_alpha: float = 1.702) -> tuple[Array, Array]:
    """The routed experts' FFN of the (T, D) tokens: (y_TxD, dropped_fraction of the T*K assignments).

    Expert parallel (a shard_map exchanging rows over the mesh's expert axis) when moe_exchange is not
    'global' and the traced mesh has an expert axis > 1, else `ops.moe`'s global dispatch
    (backends/moe.py). param_axes: each expert weight's (and bias's) logical axis names; swiglu_limit,
    swiglu_alpha: GPT-OSS's clamped SwiGLU (`ops.moe.glu`)."""
    return moe_backend.moe_ffn(self, x_TxD, params, weights_TxK, experts_TxK, activation=activation,
                               dispatch=dispatch, capacity=capacity, buffer_factor=buffer_factor,
                               capacity_impl=capacity_impl, param_axes=param_axes, swiglu_limit=swiglu_limit,
                               swiglu_alpha=swiglu_alpha)

  def wrap_optimizer(self, tx: optax.GradientTransformation, spec: AdamWSpec
                     ) -> optax.GradientTransformation:
    del spec
    return tx

  def attention(self, q_BxLxHxD: Array, k_BxSxKxD: Array, v_BxSxKxD: Array, vis: Visibility, *,
                bias_BxHxLxS: Array | None = None, alibi_slopes_H: Array | None = None,
                scale: float | None = None, dropout_rate: float = 0.0, dropout_rng: Array | None = None,
                want_weights: bool = False, linear: bool = False, softcap: float = 0.0,
                sinks_H: Array | None = None) -> tuple[Array, Array | None]:
    """(out_BxLxHxD, weights_BxHxLxS or None): weights come back only from the dense reference
    path, when `want_weights` (the other paths never materialise them).

    softcap > 0: scores become softcap * tanh(score / softcap); sinks_H: a learned logit per head in
    every row's softmax denominator (`ops.attention.attention_weights`). The paths without them
    (xla, cudnn: config.ATTENTION_LACKS) are not chosen for such calls.

    linear: phi(q) phi(k)^T in place of softmax (model.attention='linear', ops/linear_attention.py;
    no bias, ALiBi, scale or dropout): the O(L) form for a plain causal or bidirectional visibility,
    else the masked quadratic form (padding, packed documents, decoding into a KV cache)."""
    if linear:
      if bias_BxHxLxS is not None or alibi_slopes_H is not None or scale is not None or dropout_rate > 0.0:
        raise ValueError("linear attention takes no bias, ALiBi slopes, scale or dropout")
      return self.linear_attention(q_BxLxHxD, k_BxSxKxD, v_BxSxKxD, vis, want_weights=want_weights)
    impl = self.attention_impl
    layout = attention_layout()
    l, s = q_BxLxHxD.shape[1], k_BxSxKxD.shape[1]
    if layout is not None:
      layout = layout.fit(q_BxLxHxD.shape[0], l, q_BxLxHxD.shape[2], k_BxSxKxD.shape[2])
    why_not = splash_lib.unsupported(vis, l, s, bias=bias_BxHxLxS is not None,
                                     alibi=alibi_slopes_H is not None, dropout=dropout_rate > 0.0)
    if layout is not None and layout.context_size > 1 and vis.static_offset and vis.q_offset == 0 and l == s:
      if (bias_BxHxLxS is not None or dropout_rate > 0.0 or vis.num_global or vis.random is not None or softcap
          or sinks_H is not None):
        raise ValueError("context parallelism: attention with a dense bias, dropout, global tokens, random "
                         "blocks, a soft cap or sinks cannot split the sequence; use a mesh without a 'context' axis")
      return self.context_attention(q_BxLxHxD, k_BxSxKxD, v_BxSxKxD, vis, layout, alibi_slopes_H=alibi_slopes_H,
                                    scale=scale, splash_ok=why_not is None), None
    if self.context_stripes > 1:
      raise ValueError("context load balancing: a striped sequence reached attention that is not context-parallel "
                       "self-attention (a query offset, or no context axis in the traced mesh)")
    if impl == "splash" and why_not is None and l % splash_lib.LANES == 0 and s % splash_lib.LANES == 0:
      return self.splash_attention(q_BxLxHxD, k_BxSxKxD, v_BxSxKxD, vis, layout, scale=scale, softcap=softcap,
                                   sinks_H=sinks_H), None
    impl = _serving(impl, frozenset(name for name, on in (
        ("dropout", dropout_rate > 0.0), ("dense_bias", bias_BxHxLxS is not None),
        ("global_tokens", vis.num_global > 0), ("random_blocks", vis.random is not None),
        ("alibi", alibi_slopes_H is not None), ("softcap", softcap > 0), ("sinks", sinks_H is not None)) if on))
    if impl == "splash":
      impl = "blockwise"   # lengths off the 128 grid, or decoding
    if impl in ("chunked", "blockwise") and vis.static_offset and vis.kv_positions_BxS is None:
      kw = dict(causal=vis.causal, window=vis.window, q_offset=int(vis.q_offset),
                alibi_slopes_H=alibi_slopes_H, kv_valid_BxS=vis.kv_valid_BxS, scale=scale, softcap=softcap,
                sinks_H=sinks_H)
      if vis.q_segment_ids_BxL is not None:
        kw.update(q_segment_ids_BxL=vis.q_segment_ids_BxL, kv_segment_ids_BxS=vis.kv_segment_ids_BxS)
      if impl == "blockwise":
        return blockwise_attention(q_BxLxHxD, k_BxSxKxD, v_BxSxKxD, block_q=self.block_q,
                                   block_k=self.block_k, **kw), None
      return self.chunked_attention(q_BxLxHxD, k_BxSxKxD, v_BxSxKxD, chunk=self.block_q, **kw), None
    if impl == "cudnn":
      impl = self._cudnn_or_fallback(vis)
    if impl not in ("xla", "cudnn") or softcap or sinks_H is not None:
      impl = "reference"  # tiled impls decoding against a cache (one query step: dense is already O(S))
    return dense_attention(q_BxLxHxD, k_BxSxKxD, v_BxSxKxD, vis, impl=impl, bias_BxHxLxS=bias_BxHxLxS,
                           alibi_slopes_H=alibi_slopes_H, scale=scale, dropout_rate=dropout_rate,
                           dropout_rng=dropout_rng, want_weights=want_weights, softcap=softcap, sinks_H=sinks_H)

  def _cudnn_or_fallback(self, vis: Visibility) -> str:
    """'cudnn', or what runs a call cuDNN cannot serve: the fallback under 'auto', an error when the
    user asked for 'cudnn'. Decoding steps (a traced offset: one query, O(S)) run 'xla'."""
    if not vis.static_offset:
      return "xla"
    why = cudnn_unsupported(vis)
    if why is None:
      return "cudnn"
    if not self.cudnn_fallback:
      raise ValueError(f"runtime.attention: 'cudnn' cannot serve {why} (it takes causal and sliding-window "
                       "masks); use 'auto' (falls back to xla for these calls), 'xla' or 'blockwise'")
    return self.cudnn_fallback

  def splash_attention(self, q_BxLxHxD: Array, k_BxSxKxD: Array, v_BxSxKxD: Array, vis: Visibility,
                       layout: AttentionLayout | None, *, scale: float | None, softcap: float = 0.0,
                       sinks_H: Array | None = None) -> Array:
    """The splash kernel per batch/head shard (and query shard under context parallelism)."""
    kw = {} if layout is None else dict(mesh=layout.mesh, batch_axes=layout.batch, head_axes=layout.heads,
                                        context_axes=layout.context)
    if layout is not None and self.context_stripes > 1 and layout.context_size > 1:
      kw["stripes"] = self.context_stripes
    return splash_lib.splash_attention(q_BxLxHxD, k_BxSxKxD, v_BxSxKxD, vis, scale=scale, softcap=softcap,
                                       sinks_H=sinks_H,
                                       block_q=self.splash_block_q, block_kv=self.splash_block_kv,
                                       interpret=self.splash_interpret, **kw)

  def context_attention(self, q_BxLxHxD: Array, k_BxLxKxD: Array, v_BxLxKxD: Array, vis: Visibility,
                        layout: AttentionLayout, *, alibi_slopes_H: Array | None, scale: float | None,
                        splash_ok: bool) -> Array:
    """Self-attention with the sequence split over the mesh's context axis: splash with its query
    tiles sharded ('all_gather' under runtime.attention='splash', shards of whole 128-key tiles), else
    `ops.context_parallel` (blockwise tiles) with `context_strategy`. The sequence is in striped order
    when context_stripes says so (the step permuted the batch)."""
    c = q_BxLxHxD.shape[1] // layout.context_size
    striped = self.context_stripes > 1
    if striped and self.context_stripes != layout.context_size:
      raise ValueError(f"context load balancing: the batch was striped over {self.context_stripes} shards, "
                       f"attention's context axis has {layout.context_size}")
    if (self.attention_impl == "splash" and self.context_strategy == "all_gather" and splash_ok
        and c % splash_lib.LANES == 0):
      return self.splash_attention(q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, vis, layout, scale=scale)
    if not isinstance(layout.context, str):
      raise ValueError(f"context parallelism: the logical 'length' axis must map to one mesh axis, got "
                       f"{layout.context}")
    kw = dict(causal=vis.causal, window=vis.window, alibi_slopes_H=alibi_slopes_H, kv_valid_BxS=vis.kv_valid_BxS,
              q_segment_ids_BxL=vis.q_segment_ids_BxL, kv_segment_ids_BxS=vis.kv_segment_ids_BxS, scale=scale,
              block_q=self.block_q, block_k=self.block_k)
    return cp_ops.context_parallel_attention(q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, mesh=layout.mesh,
                                             axis=layout.context, strategy=self.context_strategy,
                                             batch_axes=layout.batch, head_axes=layout.heads,
                                             kv_head_axes=layout.kv_heads, striped=striped, **kw)

  def chunked_attention(self, q_BxLxHxD: Array, k_BxSxKxD: Array, v_BxSxKxD: Array, **kw) -> Array:
    return chunked_attention(q_BxLxHxD, k_BxSxKxD, v_BxSxKxD, **kw)

  def linear_attention(self, q_BxLxHxD: Array, k_BxSxKxD: Array, v_BxSxKxD: Array, vis: Visibility, *,
                       want_weights: bool = False) -> tuple[Array, Array | None]:
    """`attention(..., linear=True)`: the chunked O(L) form when only causality (or nothing) hides
    keys, else phi(q) phi(k)^T under the dense mask (weights, when asked, from that form)."""
    plain = (vis.static_offset and vis.q_offset == 0 and not vis.window and not vis.num_global
             and vis.random is None and vis.kv_valid_BxS is None and vis.q_segment_ids_BxL is None)
    if plain and not want_weights:
      return linear_attention(q_BxLxHxD, k_BxSxKxD, v_BxSxKxD, causal=vis.causal), None
    out = linear_attention_quadratic(q_BxLxHxD, k_BxSxKxD, v_BxSxKxD, causal=False,
                                     mask=vis.mask(q_BxLxHxD.shape[1], k_BxSxKxD.shape[1]),
                                     return_weights=want_weights)
    return out if want_weights else (out, None)


@dataclasses.dataclass(frozen=True)
class AttentionLayout:
  """Where the traced mesh puts attention's logical axes (mesh axis names or None)."""
  mesh: Any
  batch: Any
  context: Any
  heads: Any
  kv_heads: Any

  def ways(self, axes: Any) -> int:
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    return math.prod(dict(self.mesh.shape)[a] for a in axes)

  @property
  def context_size(self) -> int:
    return self.ways(self.context)

  def fit(self, b: int, l: int, h: int, kh: int) -> AttentionLayout:
    """This layout with every axis that does not split its dimension evenly left unsharded (a batch
    of one traced at initialisation, fewer KV heads than the tensor axis)."""
    keep = lambda axes, n: axes if n % self.ways(axes) == 0 else None  # noqa: E731
    # query and KV heads split together (a K/V head's query group stays on its device), or neither
    split = self.heads is not None and self.heads == self.kv_heads and keep(self.heads, h) is not None \
        and keep(self.kv_heads, kh) is not None
    heads = self.heads if split else None
    return AttentionLayout(self.mesh, keep(self.batch, b), keep(self.context, l), heads, heads)


def attention_layout() -> AttentionLayout | None:
  """The mesh being traced under (parallel/mesh.py `traced_under`) and the mesh axes of the logical
  ('batch', 'length', 'heads') and 'kv_heads' axes under its rules; None without a mesh."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty:
    return None
  q = tuple(flax_partitioning.logical_to_mesh_axes(("batch", "length", "heads")))
  q = q + (None,) * (3 - len(q))
  # asked alone: within one spec flax gives a mesh axis to one dimension only ('heads' and 'kv_heads'
  # both map to 'tensor')
  kv = tuple(flax_partitioning.logical_to_mesh_axes(("kv_heads",))) or (None,)
  return AttentionLayout(mesh, q[0], q[1], q[2], kv[0])


def _serving(impl: str, features: frozenset[str]) -> str:
  """`impl`, or 'reference' for a call with a feature `impl` lacks (config.ATTENTION_LACKS, the table
  config validation refuses such a model with): a backend built directly, without a validated config,
  runs that call on the dense path and says so once."""
  why = config_lib.attention_unsupported(impl, features)
  if why is None:
    return impl
  _warn_once(f"runtime.attention: {why}; this call runs 'reference'")
  return "reference"


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
  log.warning(message)


def cudnn_unsupported(vis: Visibility) -> str | None:
  """What of `vis` the cuDNN path cannot express (None when it can: causality and a sliding window
  become is_causal / local_window_size, no mask tensor)."""
  if vis.q_segment_ids_BxL is not None:
    return "packed documents (segment ids)"
  if vis.kv_valid_BxS is not None:
    return "padding masks"
  if vis.num_global or vis.random is not None:
    return "global tokens or random blocks"
  if vis.kv_positions_BxS is not None:
    return "a ring cache's key positions"
  return None


def fused_mask_args(vis: Visibility, impl: str) -> tuple[bool, tuple[int, int] | None]:
  """(is_causal, local_window_size) for jax.nn.dot_product_attention when causality and a window are
  all that hide keys (offset 0), else (False, None): the visibility goes as a dense mask."""
  structural = (impl in ("xla", "cudnn") and vis.static_offset and vis.q_offset == 0
                and cudnn_unsupported(vis) is None)
  if not structural or not (vis.causal or vis.window):
    return False, None
  if not vis.window:
    return True, None
  return vis.causal, (vis.window - 1, 0 if vis.causal else vis.window - 1)


def dense_attention(q_BxLxHxD: Array, k_BxSxKxD: Array, v_BxSxKxD: Array, vis: Visibility, *,
                    impl: str = "reference", bias_BxHxLxS: Array | None = None,
                    alibi_slopes_H: Array | None = None, scale: float | None = None,
                    dropout_rate: float = 0.0, dropout_rng: Array | None = None,
                    want_weights: bool = False, softcap: float = 0.0,
                    sinks_H: Array | None = None) -> tuple[Array, Array | None]:
  """`ops.attention.dot_product_attention` with the visibility as a dense mask and ALiBi as a dense
  bias. Causality and a sliding window reach 'xla'/'cudnn' as is_causal / local_window_size
  (`fused_mask_args`: cuDNN skips the masked tiles), the rest as a mask ('cudnn' refuses those)."""
  l, s = q_BxLxHxD.shape[1], k_BxSxKxD.shape[1]
  is_causal, window = fused_mask_args(vis, impl)
  mask = None if (is_causal or window) else vis.mask(l, s)
  bias = bias_BxHxLxS
  if alibi_slopes_H is not None:
    q_idx = vis.q_offset + jnp.arange(l)
    k_idx = jnp.arange(s)[None] if vis.kv_positions_BxS is None else vis.kv_positions_BxS
    alibi = pos_ops.alibi_bias(alibi_slopes_H, q_idx[None], k_idx, causal=vis.causal)
    bias = alibi if bias is None else bias + alibi
  kw = dict(mask=mask, bias=bias, scale=scale, dropout_rate=dropout_rate, dropout_rng=dropout_rng)
  if softcap or sinks_H is not None:   # the reference path only (ATTENTION_LACKS)
    kw.update(softcap=softcap, sinks_H=sinks_H)
  if want_weights and impl == "reference":
    return attn_ops.dot_product_attention(q_BxLxHxD, k_BxSxKxD, v_BxSxKxD, return_weights=True, **kw)
  out = attn_ops.dot_product_attention(q_BxLxHxD, k_BxSxKxD, v_BxSxKxD, impl=impl, is_causal=is_causal,
                                       local_window_size=window, **kw)
  return out, None
