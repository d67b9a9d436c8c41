"""Multi-head attention (MHA / GQA / MQA) with positions, masks and an optional KV cache.

Masks and relative biases are index-based: query i of this call sits at cache slot q_offset + i, key j
at slot j. For left-padded batches, padding slots are simply invalid keys (`kv_valid`), so index
distances equal position distances among real tokens. RoPE uses the explicit `positions`.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from tformer_jax.config import ModelConfig
from tformer_jax.nn.common import (cpu_kernels_apply, dtypes, normal, param, project,
                                   resolve_weight_grad_impl, residual_std)
from tformer_jax.ops import attention as attn_ops
from tformer_jax.ops import positions as pos_ops


def rope_tables(cfg: ModelConfig, seq_len: int) -> tuple[jax.Array, float]:
  """(inv_freq, attention_scaling) for this model's RoPE, with its scaling rule applied."""
  rot = pos_ops.rotary_dim(cfg.hd, cfg.rotary_fraction)
  if cfg.rope_scaling.type == "none":
    return pos_ops.rope_inv_freq(rot, cfg.rope_theta), 1.0
  from tformer_jax.ops.rope_scaling import rope_parameters
  return rope_parameters(rot, cfg.rope_theta, cfg.rope_scaling, max_len=cfg.max_len, seq_len=seq_len)


def index_mask(cfg: ModelConfig, q_idx_L: jax.Array, k_idx_S: jax.Array) -> jax.Array | None:
  """(L, S) structural mask from causality, window and global tokens; None if everything is visible."""
  q, k = q_idx_L[:, None], k_idx_S[None, :]
  mask = (k <= q) if cfg.causal else None
  if cfg.window:
    win = (k > q - cfg.window) if cfg.causal else (jnp.abs(q - k) < cfg.window)
    if cfg.num_global_tokens:
      win = win | (q < cfg.num_global_tokens) | (k < cfg.num_global_tokens)
    mask = win if mask is None else mask & win
  return mask


def resolve_attention_impl(cfg: ModelConfig, dropout: bool = False) -> str:
  """cfg.attention_impl, with 'auto' replaced by the fastest exact implementation that supports this
  config here: 'reference' when it needs attention dropout, a T5 bias or global tokens; on the CPU
  backend 'chunked_cpu' (nn.common.cpu_kernels_apply: float32 compute, no multi-device mesh, the
  C++ kernel builds) else 'chunked'; elsewhere 'xla' (jax.nn.dot_product_attention). All are exact, so 'auto' changes speed and memory, not the model."""
  if cfg.attention_impl != "auto":
    return cfg.attention_impl
  if dropout or cfg.position == "t5" or cfg.num_global_tokens:
    return "reference"
  if jax.default_backend() == "cpu":
    return "chunked_cpu" if cpu_kernels_apply(cfg) else "chunked"
  return "xla"


class Attention(nn.Module):
  cfg: ModelConfig
  deterministic: bool = True
  decode: bool = False

  @nn.compact
  def __call__(self, x_BxLxD: jax.Array, positions_BxL: jax.Array, kv_valid_BxS: jax.Array | None,
               q_offset: jax.Array | int = 0, bias_BxHxLxS: jax.Array | None = None) -> jax.Array:
    """kv_valid_BxS: validity of every key this call attends to: (B, L) without a cache, the whole
    cache's (B, S) when decoding; None = every key is valid (no padding: lets 'xla'/'cudnn' use
    their causal mode). q_offset: cache slot of this call's first token (decode only)."""
    cfg = self.cfg
    dt, pdt = dtypes(cfg)
    b, l, d = x_BxLxD.shape
    h, kh, hd = cfg.num_heads, cfg.kv_heads, cfg.hd
    x = x_BxLxD.astype(dt)
    init = normal(cfg.init_std)
    wg = resolve_weight_grad_impl(cfg)
    wq = param(self, "wq", init, (d, h, hd), ("embed", "heads", "kv"), pdt)
    wk = param(self, "wk", init, (d, kh, hd), ("embed", "kv_heads", "kv"), pdt)
    wv = param(self, "wv", init, (d, kh, hd), ("embed", "kv_heads", "kv"), pdt)
    q_BxLxHxD = project("bld,dhk->blhk", x, wq.astype(dt), wg)
    k_BxLxKxD = project("bld,dhk->blhk", x, wk.astype(dt), wg)
    v_BxLxKxD = project("bld,dhk->blhk", x, wv.astype(dt), wg)
    if cfg.qkv_bias:
      zeros = nn.initializers.zeros
      q_BxLxHxD += param(self, "bq", zeros, (h, hd), ("heads", "kv"), pdt).astype(dt)
      k_BxLxKxD += param(self, "bk", zeros, (kh, hd), ("kv_heads", "kv"), pdt).astype(dt)
      v_BxLxKxD += param(self, "bv", zeros, (kh, hd), ("kv_heads", "kv"), pdt).astype(dt)

    if self.decode:
      is_init = not self.has_variable("cache", "k")
      ck = self.variable("cache", "k", jnp.zeros, (b, l, kh, hd), dt)
      cv = self.variable("cache", "v", jnp.zeros, (b, l, kh, hd), dt)
    s_total = ck.value.shape[1] if self.decode else l

    if cfg.position == "rope":
      inv_freq, rope_scale = rope_tables(cfg, s_total)
      q_BxLxHxD = pos_ops.apply_rope(q_BxLxHxD, positions_BxL, inv_freq, layout=cfg.rope_layout,
                                     attention_scaling=rope_scale)
      k_BxLxKxD = pos_ops.apply_rope(k_BxLxKxD, positions_BxL, inv_freq, layout=cfg.rope_layout,
                                     attention_scaling=rope_scale)

    if self.decode and not is_init:
      start = (0, q_offset, 0, 0)
      ck.value = jax.lax.dynamic_update_slice(ck.value, k_BxLxKxD.astype(dt), start)
      cv.value = jax.lax.dynamic_update_slice(cv.value, v_BxLxKxD.astype(dt), start)
      k_BxLxKxD, v_BxLxKxD = ck.value, cv.value
    else:
      q_offset = 0

    scale = cfg.attention_scale or None
    s = k_BxLxKxD.shape[1]
    q_idx = q_offset + jnp.arange(l)
    k_idx = jnp.arange(s)
    slopes = pos_ops.alibi_slopes(h) if cfg.position == "alibi" else None
    dropout_rate = 0.0 if self.deterministic else cfg.attn_dropout
    impl = resolve_attention_impl(cfg, dropout=dropout_rate > 0.0)

    if impl == "blockwise" and not self.decode:
      from tformer_jax.ops.blockwise import blockwise_attention
      out_BxLxHxD = blockwise_attention(
          q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, causal=cfg.causal, window=cfg.window,
          alibi_slopes_H=slopes, kv_valid_BxS=kv_valid_BxS, scale=scale,
          block_q=cfg.attention_block_q, block_k=cfg.attention_block_k)
    elif impl in ("chunked", "chunked_cpu") and not self.decode:
      if impl == "chunked":
        from tformer_jax.ops.chunked_attention import chunked_attention as chunked_fn
      else:  # the same algorithm as a C++ CPU kernel
        from tformer_jax.ops.cpu_kernel import chunked_attention_cpu as chunked_fn
      out_BxLxHxD = chunked_fn(
          q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, causal=cfg.causal, window=cfg.window,
          alibi_slopes_H=slopes, kv_valid_BxS=kv_valid_BxS, scale=scale, chunk=cfg.attention_block_q)
    else:
      if impl in ("blockwise", "chunked", "chunked_cpu"):
        impl = "reference"  # one query step against the cache: the dense path is already O(S)
      # No padding and a plain causal mask: 'xla'/'cudnn' get is_causal (cuDNN's causal mode skips
      # the masked tiles) rather than a dense (1, 1, L, S) mask.
      is_causal = (kv_valid_BxS is None and cfg.causal and not cfg.window and not self.decode
                   and impl in ("xla", "cudnn"))
      mask = None if kv_valid_BxS is None else kv_valid_BxS[:, None, None, :]
      structural = None if is_causal else index_mask(cfg, q_idx, k_idx)
      if structural is not None:
        mask = structural[None, None] if mask is None else mask & structural[None, None]
      bias = bias_BxHxLxS
      if slopes is not None:
        alibi = pos_ops.alibi_bias(slopes, q_idx[None], k_idx[None], causal=cfg.causal)
        bias = alibi if bias is None else bias + alibi
      rng = self.make_rng("dropout") if dropout_rate > 0.0 else None
      if self.is_mutable_collection("intermediates") and impl == "reference":
        out_BxLxHxD, w_BxHxLxS = attn_ops.dot_product_attention(
            q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, mask=mask, bias=bias, scale=scale, return_weights=True,
            dropout_rate=dropout_rate, dropout_rng=rng)
        self.sow("intermediates", "attention_weights", w_BxHxLxS)
      else:
        out_BxLxHxD = attn_ops.dot_product_attention(
            q_BxLxHxD, k_BxLxKxD, v_BxLxKxD, mask=mask, bias=bias, scale=scale, impl=impl,
            dropout_rate=dropout_rate, dropout_rng=rng, is_causal=is_causal)

    out_BxLxHxD = nn.with_logical_constraint(out_BxLxHxD, ("batch", "length", "heads", "kv"))
    wo = param(self, "wo", normal(residual_std(cfg)), (h, hd, d), ("heads", "kv", "embed"), pdt)
    y_BxLxD = project("blhk,hkd->bld", out_BxLxHxD.astype(dt), wo.astype(dt), wg)
    if cfg.out_bias:
      y_BxLxD += param(self, "bo", nn.initializers.zeros, (d,), ("embed",), pdt).astype(dt)
    return y_BxLxD
