"""The reference backend: plain `jnp` and ordinary autodiff (forward mode included), every platform.

A backend is the one door between the model and execution choices. `nn/` calls:
  dense(spec, x, w)                      a projection, `jnp.einsum(spec, x, w)`
  norm(x, scale, bias, eps, center)      LayerNorm (center) / RMSNorm, `ops.norms.normalize`
  attention(q, k, v, vis, ...)           softmax (or linear) attention under a `ops.masks.Visibility`
  residual(x)                            the residual stream entering a block (identity here)
  moe_ffn(x, params, weights, experts, ...)  the routed experts (global, or expert parallel)
and the train step's optimizer comes from wrap_optimizer(tx, spec) (it calls `tx.update`).
Subclasses (backends/xla_cpu.py) change how these run, never what they compute.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar

import jax
import jax.numpy as jnp
import optax

from tformer_jax.backends import moe as moe_backend
from tformer_jax.ops import attention as attn_ops, norms as norm_ops, positions as pos_ops
from tformer_jax.ops.blockwise import blockwise_attention
from tformer_jax.ops.chunked_attention import chunked_attention
from tformer_jax.ops.linear_attention import linear_attention, linear_attention_quadratic
from tformer_jax.ops.masks import Visibility

Array = jax.Array
PyTree = Any

# reference: one dense softmax; chunked / blockwise: tiled, exact (ops/chunked_attention.py,
# ops/blockwise.py); xla / cudnn: jax.nn.dot_product_attention.
ATTENTION_IMPLS = ("reference", "chunked", "blockwise", "xla", "cudnn")
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
  the chunked query chunk). The tiled and fused paths serve what they support (a static offset, no
  dense bias, no dropout, no global tokens or random blocks); anything else runs the dense path, which
  supports all."""
  attention_impl: str = "reference"
  block_q: int = 128
  block_k: int = 128
  # MoE (backends/moe.py): the expert exchange (global: no expert parallelism; all_to_all: dense
  # all-to-all, every platform; ragged: ragged_all_to_all, TPU/GPU), the grouped matmul
  # (ragged_dot | megablox) and megablox's Pallas interpret mode (a target other than TPU).
  moe_exchange: str = "global"
  moe_gmm: str = "ragged_dot"
  moe_interpret: bool = False
  name: ClassVar[str] = "reference"

  def __post_init__(self):
    if self.attention_impl not in ATTENTION_IMPLS:
      raise ValueError(f"attention: unknown implementation {self.attention_impl!r}; expected one of "
                       f"{ATTENTION_IMPLS}")
    if self.moe_exchange not in MOE_EXCHANGES or self.moe_gmm not in MOE_GMMS:
      raise ValueError(f"moe: unknown exchange {self.moe_exchange!r} or grouped matmul {self.moe_gmm!r}; "
                       f"expected one of {MOE_EXCHANGES} and {MOE_GMMS}")

  def describe(self) -> str:
    return f"{self.name} (attention {self.attention_impl})"

  def dense(self, spec: str, x: Array, w: Array) -> Array:
    return jnp.einsum(spec, x, w)

  def norm(self, x: Array, scale: Array, bias: Array | None, *, eps: float, center: bool) -> Array:
    return norm_ops.normalize(x, scale, bias, eps, center)

  def residual(self, x_BxLxD: Array) -> Array:
    return x_BxLxD

  def moe_ffn(self, x_TxD: Array, params: dict[str, Array], weights_TxK: Array, experts_TxK: Array, *,
              activation: str, dispatch: str, capacity: int, buffer_factor: float = 0.0,
              capacity_impl: str = "einsum", param_axes: dict[str, tuple[str, ...]]
              ) -> tuple[Array, Array]:
    """The routed experts' FFN of the (T, D) tokens: (y_TxD, dropped_fraction of the T*K assignments).

    Expert parallel (a shard_map exchanging rows over the mesh's expert axis) when moe_exchange is not
    'global' and the traced mesh has an expert axis > 1, else `ops.moe`'s global dispatch
    (backends/moe.py). param_axes: each expert weight's logical axis names."""
    return moe_backend.moe_ffn(self, x_TxD, params, weights_TxK, experts_TxK, activation=activation,
                               dispatch=dispatch, capacity=capacity, buffer_factor=buffer_factor,
                               capacity_impl=capacity_impl, param_axes=param_axes)

  def wrap_optimizer(self, tx: optax.GradientTransformation, spec: AdamWSpec
                     ) -> optax.GradientTransformation:
    del spec
    return tx

  def attention(self, q_BxLxHxD: Array, k_BxSxKxD: Array, v_BxSxKxD: Array, vis: Visibility, *,
                bias_BxHxLxS: Array | None = None, alibi_slopes_H: Array | None = None,
                scale: float | None = None, dropout_rate: float = 0.0, dropout_rng: Array | None = None,
                want_weights: bool = False, linear: bool = False) -> tuple[Array, Array | None]:
    """(out_BxLxHxD, weights_BxHxLxS or None): weights come back only from the dense reference
    path, when `want_weights` (the other paths never materialise them).

    linear: phi(q) phi(k)^T in place of softmax (model.attention='linear', ops/linear_attention.py;
    no bias, ALiBi, scale or dropout): the O(L) form for a plain causal or bidirectional visibility,
    else the masked quadratic form (padding, packed documents, decoding into a KV cache)."""
    if linear:
      if bias_BxHxLxS is not None or alibi_slopes_H is not None or scale is not None or dropout_rate > 0.0:
        raise ValueError("linear attention takes no bias, ALiBi slopes, scale or dropout")
      return self.linear_attention(q_BxLxHxD, k_BxSxKxD, v_BxSxKxD, vis, want_weights=want_weights)
    impl = self.attention_impl
    tiled = (vis.static_offset and bias_BxHxLxS is None and not vis.num_global and vis.random is None
             and dropout_rate == 0.0)
    if impl in ("chunked", "blockwise") and tiled:
      kw = dict(causal=vis.causal, window=vis.window, q_offset=int(vis.q_offset),
                alibi_slopes_H=alibi_slopes_H, kv_valid_BxS=vis.kv_valid_BxS, scale=scale)
      if vis.q_segment_ids_BxL is not None:
        kw.update(q_segment_ids_BxL=vis.q_segment_ids_BxL, kv_segment_ids_BxS=vis.kv_segment_ids_BxS)
      if impl == "blockwise":
        return blockwise_attention(q_BxLxHxD, k_BxSxKxD, v_BxSxKxD, block_q=self.block_q,
                                   block_k=self.block_k, **kw), None
      return self.chunked_attention(q_BxLxHxD, k_BxSxKxD, v_BxSxKxD, chunk=self.block_q, **kw), None
    if impl not in ("xla", "cudnn") or dropout_rate > 0.0:
      impl = "reference"  # decoding against a cache (one query step: dense is already O(S)), etc.
    return dense_attention(q_BxLxHxD, k_BxSxKxD, v_BxSxKxD, vis, impl=impl, bias_BxHxLxS=bias_BxHxLxS,
                           alibi_slopes_H=alibi_slopes_H, scale=scale, dropout_rate=dropout_rate,
                           dropout_rng=dropout_rng, want_weights=want_weights)

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


def dense_attention(q_BxLxHxD: Array, k_BxSxKxD: Array, v_BxSxKxD: Array, vis: Visibility, *,
                    impl: str = "reference", bias_BxHxLxS: Array | None = None,
                    alibi_slopes_H: Array | None = None, scale: float | None = None,
                    dropout_rate: float = 0.0, dropout_rng: Array | None = None,
                    want_weights: bool = False) -> tuple[Array, Array | None]:
  """`ops.attention.dot_product_attention` with the visibility as a dense mask and ALiBi as a dense
  bias. A plain causal visibility reaches 'xla'/'cudnn' as is_causal (cuDNN skips masked tiles)."""
  l, s = q_BxLxHxD.shape[1], k_BxSxKxD.shape[1]
  is_causal = impl in ("xla", "cudnn") and vis.is_plain_causal
  mask = None if is_causal else vis.mask(l, s)
  bias = bias_BxHxLxS
  if alibi_slopes_H is not None:
    q_idx = vis.q_offset + jnp.arange(l)
    alibi = pos_ops.alibi_bias(alibi_slopes_H, q_idx[None], jnp.arange(s)[None], causal=vis.causal)
    bias = alibi if bias is None else bias + alibi
  kw = dict(mask=mask, bias=bias, scale=scale, dropout_rate=dropout_rate, dropout_rng=dropout_rng)
  if want_weights and impl == "reference":
    return attn_ops.dot_product_attention(q_BxLxHxD, k_BxSxKxD, v_BxSxKxD, return_weights=True, **kw)
  out = attn_ops.dot_product_attention(q_BxLxHxD, k_BxSxKxD, v_BxSxKxD, impl=impl, is_causal=is_causal,
                                       **kw)
  return out, None
