"""Scaled dot-product attention: softmax(Q K^T / sqrt(d) + bias, masked) V.

Pure jax.numpy; no Flax. Layout follows nanodo: q_BxLxHxD, k/v_BxSxKxD with K | H.
GQA/MQA group query heads over shared K/V heads by reshaping Q to (B, L, K, G, D); K/V are
never repeated in memory. The softmax always runs in float32.
"""
from __future__ import annotations

import math
from typing import Literal

import jax
import jax.numpy as jnp

from tformer_jax.ops.masks import causal_mask

Array = jnp.ndarray
Impl = Literal["reference", "xla", "cudnn"]

# A large negative number instead of -inf, so masked logits stay finite in float32.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def _check_shapes(q: Array, k: Array, v: Array) -> tuple[int, int]:
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(f"expected q (B,L,H,D), k/v (B,S,K,D); got {q.shape}, {k.shape}, {v.shape}")
  if k.shape != v.shape:
    raise ValueError(f"k and v shapes differ: {k.shape} vs {v.shape}")
  h, kh = q.shape[2], k.shape[2]
  if h % kh:
    raise ValueError(f"num query heads {h} is not divisible by num kv heads {kh}")
  if q.shape[-1] != k.shape[-1]:
    raise ValueError(f"head dims differ: q {q.shape[-1]} vs k {k.shape[-1]}")
  return h, kh


def soft_cap(x: Array, cap: float) -> Array:
  """cap * tanh(x / cap): logits bounded to (-cap, cap), near the identity for |x| << cap (Gemma 2's
  attention and final-logit soft-capping); cap <= 0 returns x."""
  return x if not cap else cap * jnp.tanh(x / cap)


def attention_weights(q_BxLxHxD: Array, k_BxSxKxD: Array, *, mask: Array | None = None,
                      bias: Array | None = None, scale: float | None = None, softcap: float = 0.0,
                      sinks_H: Array | None = None) -> Array:
  """Softmax attention weights (B, H, L, S) in float32. Fully masked rows are all zeros.

  softcap > 0: the scaled scores pass through `soft_cap` before the bias and the mask (Gemma 2).
  sinks_H: one learned logit per head that joins every row's softmax denominator and takes no value
  (GPT-OSS; StreamingLLM's attention sink): each row's weights then sum to less than 1."""
  b, l, h, d = q_BxLxHxD.shape
  kh = k_BxSxKxD.shape[2]
  g = h // kh
  s = k_BxSxKxD.shape[1]
  scale = 1.0 / math.sqrt(d) if scale is None else scale
  q_BxLxKxGxD = q_BxLxHxD.reshape(b, l, kh, g, d)
  logits_BxKxGxLxS = jnp.einsum("blkgd,bskd->bkgls", q_BxLxKxGxD, k_BxSxKxD,
                                preferred_element_type=jnp.float32) * scale
  logits_BxKxGxLxS = soft_cap(logits_BxKxGxLxS.astype(jnp.float32), softcap)
  if bias is not None:
    bias_BxHxLxS = jnp.broadcast_to(bias, (bias.shape[0], h, l, s)) if bias.shape[1] == 1 else bias
    logits_BxKxGxLxS = logits_BxKxGxLxS + bias_BxHxLxS.reshape(
        bias_BxHxLxS.shape[0], kh, g, l, s).astype(jnp.float32)
  if mask is not None:
    mask_BxHxLxS = jnp.broadcast_to(mask, (mask.shape[0], h, l, s)) if mask.shape[1] == 1 else mask
    mask_BxKxGxLxS = mask_BxHxLxS.reshape(mask_BxHxLxS.shape[0], kh, g, l, s)
    logits_BxKxGxLxS = jnp.where(mask_BxKxGxLxS, logits_BxKxGxLxS, MASK_VALUE)
  if sinks_H is None:
    weights = jax.nn.softmax(logits_BxKxGxLxS, axis=-1)
  else:   # the sink as one more column of the softmax, dropped after it
    sink = jnp.broadcast_to(sinks_H.astype(jnp.float32).reshape(1, kh, g, 1, 1), (*logits_BxKxGxLxS.shape[:-1], 1))
    weights = jax.nn.softmax(jnp.concatenate([logits_BxKxGxLxS, sink], axis=-1), axis=-1)[..., :-1]
  if mask is not None:  # a row with no visible key gets zero weight, not a uniform spread (and no NaN)
    weights = jnp.where(jnp.any(mask_BxKxGxLxS, axis=-1, keepdims=True), weights, 0.0)
  return weights.reshape(weights.shape[0], h, l, s)


def dot_product_attention(q_BxLxHxD: Array, k_BxSxKxD: Array, v_BxSxKxD: Array, *,
                          mask: Array | None = None, bias: Array | None = None,
                          scale: float | None = None, return_weights: bool = False,
                          impl: Impl = "reference", dropout_rate: float = 0.0,
                          dropout_rng: Array | None = None, is_causal: bool = False,
                          local_window_size: tuple[int, int] | None = None, softcap: float = 0.0,
                          sinks_H: Array | None = None):
  """Multi-head attention core. Returns (B, L, H, D) (and weights (B, H, L, S) if asked).

  mask: bool, broadcastable to (B, H|1, L, S), True = attend. bias: additive float, same shapes.
  is_causal: also apply the causal mask (query i sees keys j <= i); 'xla'/'cudnn' then use the
  kernel's causal mode (cuDNN skips the masked tiles) instead of a dense mask tensor.
  impl: 'reference' (this einsum path), or 'xla' / 'cudnn' through `jax.nn.dot_product_attention`
  (same semantics; weights are not available there; no attention dropout).
  local_window_size (left, right): query i sees only keys i - left <= j <= i + right (with
  is_causal, right is 0): a sliding window without a mask tensor, which cuDNN turns into skipped tiles.
  softcap, sinks_H: as `attention_weights` (the reference path only: jax.nn.dot_product_attention has
  neither).
  """
  h, kh = _check_shapes(q_BxLxHxD, k_BxSxKxD, v_BxSxKxD)
  if impl in ("xla", "cudnn"):
    if return_weights:
      raise ValueError(f"impl={impl!r} cannot return attention weights; use impl='reference'")
    if dropout_rate > 0.0 or softcap or sinks_H is not None:
      raise ValueError(f"impl={impl!r} has no attention dropout, soft cap or sinks; use impl='reference'")
    if impl == "cudnn" and jax.default_backend() != "gpu":
      raise ValueError(f"attention impl 'cudnn' needs a GPU; the default backend is "
                       f"{jax.default_backend()!r}. Use 'xla', 'blockwise' or 'reference' (runtime.attention).")
    d = q_BxLxHxD.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    return jax.nn.dot_product_attention(
        q_BxLxHxD, k_BxSxKxD, v_BxSxKxD,
        bias=None if bias is None else bias.astype(q_BxLxHxD.dtype),
        mask=mask, scale=scale, is_causal=is_causal, local_window_size=local_window_size,
        implementation=impl)
  if impl != "reference":
    raise ValueError(f"unknown attention impl {impl!r}; expected 'reference', 'xla' or 'cudnn'")

  b, l, _, d = q_BxLxHxD.shape
  g = h // kh
  if is_causal:
    causal = causal_mask(l, k_BxSxKxD.shape[1])
    mask = causal if mask is None else mask & causal
  if local_window_size is not None:
    left, right = local_window_size
    dist = jnp.arange(l)[:, None] - jnp.arange(k_BxSxKxD.shape[1])[None, :]
    band = ((dist <= left) & (-dist <= right))[None, None]
    mask = band if mask is None else mask & band
  weights_BxHxLxS = attention_weights(q_BxLxHxD, k_BxSxKxD, mask=mask, bias=bias, scale=scale, softcap=softcap,
                                      sinks_H=sinks_H)
  probs = weights_BxHxLxS
  if dropout_rate > 0.0 and dropout_rng is not None:
    keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, probs.shape)
    probs = jnp.where(keep, probs / (1.0 - dropout_rate), 0.0)
  probs_BxKxGxLxS = probs.reshape(b, kh, g, l, -1).astype(v_BxSxKxD.dtype)
  out_BxLxKxGxD = jnp.einsum("bkgls,bskd->blkgd", probs_BxKxGxLxS, v_BxSxKxD)
  out_BxLxHxD = out_BxLxKxGxD.reshape(b, l, h, d)
  if return_weights:
    return out_BxLxHxD, weights_BxHxLxS
  return out_BxLxHxD


def head_statistics(weights_BxHxLxS: jax.Array, visible_BxLxS: jax.Array) -> dict[str, jax.Array]:
  """Per-head (H,) statistics over the queries that see >= 2 keys: entropy (nats), the uniform
  entropy log(#visible) averaged the same way, their ratio, and the mean row max."""
  w = weights_BxHxLxS.astype(jnp.float32)
  n_vis_BxL = jnp.sum(visible_BxLxS, axis=-1).astype(jnp.float32)
  use_BxL = (n_vis_BxL >= 2).astype(jnp.float32)
  denom = jnp.maximum(jnp.sum(use_BxL), 1.0)
  ent_BxHxL = -jnp.sum(jnp.where(w > 0, w * jnp.log(jnp.where(w > 0, w, 1.0)), 0.0), axis=-1)
  uni_BxL = jnp.log(jnp.maximum(n_vis_BxL, 1.0))
  mx_BxHxL = jnp.max(w, axis=-1)
  ent_H = jnp.sum(ent_BxHxL * use_BxL[:, None], axis=(0, 2)) / denom
  uni = jnp.sum(uni_BxL * use_BxL) / denom
  ratio_H = jnp.sum(ent_BxHxL / jnp.maximum(uni_BxL, 1e-9)[:, None] * use_BxL[:, None], axis=(0, 2)) / denom
  max_H = jnp.sum(mx_BxHxL * use_BxL[:, None], axis=(0, 2)) / denom
  return {"entropy": ent_H, "uniform_entropy": jnp.broadcast_to(uni, ent_H.shape),
          "entropy_ratio": ratio_H, "max_weight": max_H}
