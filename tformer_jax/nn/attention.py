"""Multi-head attention (MHA / GQA / MQA) with positions, masks and an optional KV cache.

Masks and relative biases are index-based: query i of this call sits at cache slot q_offset + i, key j
at slot j. For left-padded batches, padding slots are simply invalid keys (`kv_valid`), so index
distances equal position distances among real tokens. RoPE uses the explicit `positions`.
Which keys a query sees is one `ops.masks.Visibility`; the backend computes softmax(QK^T)V under it, or
with model.attention='linear' phi(Q)phi(K)^T V normalised (ops/linear_attention.py).
The cache stores K/V in `cache_dtype` ('' = the compute dtype, bfloat16, or int8 with one scale per
token and KV head, ops/kv_quant.py); attention always sees them dequantised to the compute dtype.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from tformer_jax import backends
from tformer_jax.config import ModelConfig
from tformer_jax.nn.common import dtypes, normal, param, residual_std
from tformer_jax.ops import kv_quant, positions as pos_ops
from tformer_jax.ops.masks import RandomBlocks, Visibility
from tformer_jax.ops.rope_scaling import rope_parameters


def rope_tables(cfg: ModelConfig, seq_len: int) -> tuple[jax.Array, float]:
  """(inv_freq, attention_scaling) for this model's RoPE, with its scaling rule applied."""
  rot = pos_ops.rotary_dim(cfg.hd, cfg.rotary_fraction)
  if cfg.rope_scaling.type == "none":
    return pos_ops.rope_inv_freq(rot, cfg.rope_theta), 1.0
  return rope_parameters(rot, cfg.rope_theta, cfg.rope_scaling, max_len=cfg.max_len, seq_len=seq_len)


def visibility(cfg: ModelConfig, q_offset: int | jax.Array = 0,
               kv_valid_BxS: jax.Array | None = None, segment_ids_BxL: jax.Array | None = None) -> Visibility:
  """Which keys each query sees in this model (causality, window, global tokens, BigBird random blocks,
  padding, and with segment ids only the keys of the query's own segment: packed documents never see
  each other)."""
  random = (RandomBlocks(cfg.random_blocks, cfg.random_block_size, cfg.random_block_seed, cfg.max_len)
            if cfg.random_blocks else None)
  return Visibility(causal=cfg.causal, window=cfg.window, num_global=cfg.num_global_tokens, random=random,
                    q_offset=q_offset, kv_valid_BxS=kv_valid_BxS, q_segment_ids_BxL=segment_ids_BxL,
                    kv_segment_ids_BxS=segment_ids_BxL)


class Attention(nn.Module):
  cfg: ModelConfig
  deterministic: bool = True
  decode: bool = False
  cache_dtype: str = ""   # KV cache storage: '' (compute dtype) | float32 | bfloat16 | int8

  @nn.compact
  def __call__(self, x_BxLxD: jax.Array, positions_BxL: jax.Array, kv_valid_BxS: jax.Array | None,
               q_offset: jax.Array | int = 0, bias_BxHxLxS: jax.Array | None = None,
               segment_ids_BxL: jax.Array | None = None) -> jax.Array:
    """kv_valid_BxS: validity of every key this call attends to: (B, L) without a cache, the whole
    cache's (B, S) when decoding; None = every key is valid (no padding: lets fused kernels use
    their causal mode). q_offset: cache slot of this call's first token (decode only).
    segment_ids_BxL: documents packed into one row (1, 2, ...; 0 = padding): a query sees only keys
    of its own segment. Training and scoring only (not with a KV cache)."""
    cfg = self.cfg
    if segment_ids_BxL is not None and self.decode:
      raise ValueError("segment_ids_BxL (packed documents) is for training and scoring; decoding into a "
                       "KV cache takes one document per row")
    backend = backends.current()
    dt, pdt = dtypes(cfg)
    b, l, d = x_BxLxD.shape
    h, kh, hd = cfg.num_heads, cfg.kv_heads, cfg.hd
    x = x_BxLxD.astype(dt)
    init = normal(cfg.init_std)
    wq = param(self, "wq", init, (d, h, hd), ("embed", "heads", "kv"), pdt)
    wk = param(self, "wk", init, (d, kh, hd), ("embed", "kv_heads", "kv"), pdt)
    wv = param(self, "wv", init, (d, kh, hd), ("embed", "kv_heads", "kv"), pdt)
    q_BxLxHxD = backend.dense("bld,dhk->blhk", x, wq.astype(dt))
    k_BxLxKxD = backend.dense("bld,dhk->blhk", x, wk.astype(dt))
    v_BxLxKxD = backend.dense("bld,dhk->blhk", x, wv.astype(dt))
    if cfg.qkv_bias:
      zeros = nn.initializers.zeros
      q_BxLxHxD += param(self, "bq", zeros, (h, hd), ("heads", "kv"), pdt).astype(dt)
      k_BxLxKxD += param(self, "bk", zeros, (kh, hd), ("kv_heads", "kv"), pdt).astype(dt)
      v_BxLxKxD += param(self, "bv", zeros, (kh, hd), ("kv_heads", "kv"), pdt).astype(dt)

    quantized = self.cache_dtype == "int8"
    if self.decode:
      is_init = not self.has_variable("cache", "k")
      store = kv_quant.storage_dtype(self.cache_dtype, dt)
      ck = self.variable("cache", "k", jnp.zeros, (b, l, kh, hd), store)
      cv = self.variable("cache", "v", jnp.zeros, (b, l, kh, hd), store)
      if quantized:
        ck_scale = self.variable("cache", "k_scale", jnp.zeros, (b, l, kh), kv_quant.SCALE_DTYPE)
        cv_scale = self.variable("cache", "v_scale", jnp.zeros, (b, l, kh), kv_quant.SCALE_DTYPE)
    s_total = ck.value.shape[1] if self.decode else l

    if cfg.position == "rope":
      inv_freq, rope_scale = rope_tables(cfg, s_total)
      q_BxLxHxD = pos_ops.apply_rope(q_BxLxHxD, positions_BxL, inv_freq, layout=cfg.rope_layout,
                                     attention_scaling=rope_scale)
      k_BxLxKxD = pos_ops.apply_rope(k_BxLxKxD, positions_BxL, inv_freq, layout=cfg.rope_layout,
                                     attention_scaling=rope_scale)

    if self.decode and not is_init:
      start = (0, q_offset, 0, 0)
      if quantized:
        (k_q, k_s), (v_q, v_s) = kv_quant.quantize(k_BxLxKxD), kv_quant.quantize(v_BxLxKxD)
        ck.value = jax.lax.dynamic_update_slice(ck.value, k_q, start)
        cv.value = jax.lax.dynamic_update_slice(cv.value, v_q, start)
        ck_scale.value = jax.lax.dynamic_update_slice(ck_scale.value, k_s, start[:3])
        cv_scale.value = jax.lax.dynamic_update_slice(cv_scale.value, v_s, start[:3])
        k_BxLxKxD = kv_quant.dequantize(ck.value, ck_scale.value, dt)
        v_BxLxKxD = kv_quant.dequantize(cv.value, cv_scale.value, dt)
      else:
        ck.value = jax.lax.dynamic_update_slice(ck.value, k_BxLxKxD.astype(store), start)
        cv.value = jax.lax.dynamic_update_slice(cv.value, v_BxLxKxD.astype(store), start)
        k_BxLxKxD, v_BxLxKxD = ck.value.astype(dt), cv.value.astype(dt)
    else:
      q_offset = 0

    vis = visibility(cfg, q_offset, kv_valid_BxS, segment_ids_BxL)
    dropout_rate = 0.0 if self.deterministic else cfg.attn_dropout
    out_BxLxHxD, weights_BxHxLxS = backend.attention(
        q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, vis, bias_BxHxLxS=bias_BxHxLxS,
        alibi_slopes_H=pos_ops.alibi_slopes(h) if cfg.position == "alibi" else None,
        scale=cfg.attention_scale or None, dropout_rate=dropout_rate,
        dropout_rng=self.make_rng("dropout") if dropout_rate > 0.0 else None,
        want_weights=self.is_mutable_collection("intermediates"), linear=cfg.attention == "linear")
    if weights_BxHxLxS is not None:
      self.sow("intermediates", "attention_weights", weights_BxHxLxS)

    out_BxLxHxD = nn.with_logical_constraint(out_BxLxHxD, ("batch", "length", "heads", "kv"))
    wo = param(self, "wo", normal(residual_std(cfg)), (h, hd, d), ("heads", "kv", "embed"), pdt)
    y_BxLxD = backend.dense("blhk,hkd->bld", out_BxLxHxD.astype(dt), wo.astype(dt))
    if cfg.out_bias:
      y_BxLxD += param(self, "bo", nn.initializers.zeros, (d,), ("embed",), pdt).astype(dt)
    return y_BxLxD
