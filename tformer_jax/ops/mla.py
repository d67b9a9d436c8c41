"""Multi-head Latent Attention (DeepSeek-V2, section 2.1): pure functions, no Flax.

Per token, one joint latent c (kv_lora_rank R, after its norm) and one RoPE key k_r (qk_rope_head_dim Dr,
shared by every head) stand for all heads' keys and values. The up-projection wkv_b (R, H, N + V) gives
each head its no-RoPE key k_n = c W_UK (N = qk_nope_head_dim) and its value v = c W_UV (V = v_head_dim);
head h's key is [k_n ; k_r] and its score q_n . k_n + q_r . k_r.

Two equal ways to compute it:
- materialised (training, prefill of long prompts): `expand_kv` forms every head's K (N + Dr) and V;
  `attention_materialised` runs ordinary multi-head attention on them;
- absorbed (decoding: section 2.1.3): W_UK moves into the query, q_n . (c W_UK) = (W_UK q_n) . c, so the
  scores need only the cached latents; W_UV moves after the weighted sum, sum_s w_s (c_s W_UV) =
  (sum_s w_s c_s) W_UV. That is multi-query attention with one K/V head of width R + Dr: `absorb_query`
  gives the (B, L, H, R + Dr) queries, `latent_kv` the one-head keys [c ; k_r] and values (c, zero-padded
  to the key width), `latent_output` applies W_UV to the first R dims of the output.

The attention kernels take one head dim for q, k and v: `pad_last` zero-pads the narrower side (zero dims
add nothing to a score, and the output's padded dims are sliced off), so the softmax scale is always
given explicitly (`softmax_scale`: 1/sqrt(N + Dr), times DeepSeek's YaRN mscale squared).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from tformer_jax.ops import attention as attn_ops

Array = jax.Array


def softmax_scale(qk_head_dim: int, attention_scale: float = 0.0, rope_scaling_type: str = "none",
                  factor: float = 1.0, mscale_all_dim: float = 0.0) -> float:
  """The scores' scale: attention_scale (0 = 1/sqrt(qk_head_dim), qk_head_dim = N + Dr), times
  (0.1 mscale_all_dim ln(factor) + 1)^2 under a RoPE scaling with factor > 1 and mscale_all_dim > 0
  (DeepSeek's YaRN attention scale, transformers' `yarn_apply_mscale`)."""
  scale = attention_scale or qk_head_dim ** -0.5
  if rope_scaling_type not in ("none", "default") and mscale_all_dim and factor > 1:
    m = 0.1 * mscale_all_dim * math.log(factor) + 1.0
    scale *= m * m
  return float(scale)


def pad_last(x: Array, d: int) -> Array:
  """x zero-padded on its last axis to d (x itself when already d wide)."""
  extra = d - x.shape[-1]
  if extra < 0:
    raise ValueError(f"cannot pad a last axis of {x.shape[-1]} to {d}")
  return x if extra == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])


def split_kv_b(wkv_b_RxHxNV: Array, nope: int) -> tuple[Array, Array]:
  """(W_UK (R, H, N), W_UV (R, H, V)): each head's [N key dims ; V value dims] of the up-projection."""
  return wkv_b_RxHxNV[..., :nope], wkv_b_RxHxNV[..., nope:]


def expand_kv(c_BxSxR: Array, k_rope_BxSxDr: Array, wkv_b_RxHxNV: Array, nope: int) -> tuple[Array, Array]:
  """Every head's keys (B, S, H, N + Dr): [c W_UK ; k_r], and values (B, S, H, V): c W_UV."""
  kv_BxSxHxNV = jnp.einsum("bsr,rhe->bshe", c_BxSxR, wkv_b_RxHxNV.astype(c_BxSxR.dtype))
  k_nope, v = kv_BxSxHxNV[..., :nope], kv_BxSxHxNV[..., nope:]
  h = wkv_b_RxHxNV.shape[1]
  k_rope = jnp.broadcast_to(k_rope_BxSxDr[:, :, None, :], (*k_rope_BxSxDr.shape[:2], h, k_rope_BxSxDr.shape[-1]))
  return jnp.concatenate([k_nope, k_rope.astype(k_nope.dtype)], axis=-1), v


def absorb_query(q_nope_BxLxHxN: Array, q_rope_BxLxHxDr: Array, wkv_b_RxHxNV: Array) -> Array:
  """The latent-space queries (B, L, H, R + Dr): [W_UK q_n ; q_r], so q . [c ; k_r] is head h's score."""
  w_uk, _ = split_kv_b(wkv_b_RxHxNV, q_nope_BxLxHxN.shape[-1])
  q_lat = jnp.einsum("blhn,rhn->blhr", q_nope_BxLxHxN, w_uk.astype(q_nope_BxLxHxN.dtype))
  return jnp.concatenate([q_lat, q_rope_BxLxHxDr.astype(q_lat.dtype)], axis=-1)


def latent_kv(c_BxSxR: Array, k_rope_BxSxDr: Array) -> tuple[Array, Array]:
  """One shared K/V head for the absorbed form: keys (B, S, 1, R + Dr) = [c ; k_r], values (B, S, 1,
  R + Dr) = c zero-padded (the kernels take one head dim; `latent_output` reads the first R dims)."""
  k = jnp.concatenate([c_BxSxR, k_rope_BxSxDr.astype(c_BxSxR.dtype)], axis=-1)[:, :, None, :]
  return k, pad_last(c_BxSxR, k.shape[-1])[:, :, None, :]


def latent_output(o_BxLxHxW: Array, wkv_b_RxHxNV: Array, nope: int) -> Array:
  """Each head's output (B, L, H, V) from its attention-weighted latent (the first R of W dims): o W_UV."""
  _, w_uv = split_kv_b(wkv_b_RxHxNV, nope)
  r = w_uv.shape[0]
  return jnp.einsum("blhr,rhv->blhv", o_BxLxHxW[..., :r], w_uv.astype(o_BxLxHxW.dtype))


def attention_materialised(q_nope: Array, q_rope: Array, c: Array, k_rope: Array, wkv_b: Array, *,
                           mask: Array | None, scale: float) -> Array:
  """MLA the direct way: every head's K and V formed, then softmax attention. Returns (B, L, H, V)."""
  k, v = expand_kv(c, k_rope, wkv_b, q_nope.shape[-1])
  q = jnp.concatenate([q_nope, q_rope], axis=-1)
  width = max(q.shape[-1], v.shape[-1])
  out = attn_ops.dot_product_attention(pad_last(q, width), pad_last(k, width), pad_last(v, width), mask=mask,
                                       scale=scale)
  return out[..., :v.shape[-1]]


def attention_absorbed(q_nope: Array, q_rope: Array, c: Array, k_rope: Array, wkv_b: Array, *,
                       mask: Array | None, scale: float) -> Array:
  """MLA in the latent space (section 2.1.3): W_UK absorbed into the queries, one shared K/V head of the
  cached latents, W_UV after the weighted sum. Equal to `attention_materialised`. Returns (B, L, H, V)."""
  k, v = latent_kv(c, k_rope)
  out = attn_ops.dot_product_attention(absorb_query(q_nope, q_rope, wkv_b), k, v, mask=mask, scale=scale)
  return latent_output(out, wkv_b, q_nope.shape[-1])


def cache_bytes_per_token(num_layers: int, kv_lora_rank: int, qk_rope_head_dim: int, itemsize: int,
                          int8_scale_bytes: int = 0) -> int:
  """Bytes the latent cache adds per token over all layers: (R + Dr) values a layer (an int8 cache adds
  one scale for the latent and one for the RoPE key), without the model's per-slot validity byte."""
  return int(num_layers * ((kv_lora_rank + qk_rope_head_dim) * itemsize + 2 * int8_scale_bytes))


def gqa_equal_cache_heads(kv_lora_rank: int, qk_rope_head_dim: int, head_dim: int) -> float:
  """KV heads of a GQA layer with head_dim whose cache equals one MLA layer's: (R + Dr) / (2 head_dim)."""
  return float(np.float64(kv_lora_rank + qk_rope_head_dim) / (2 * head_dim))
