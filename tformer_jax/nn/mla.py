"""Multi-head Latent Attention (DeepSeek-V2/V3), the attention of a model with model.mla.kv_lora_rank > 0.

Parameters (transformers' deepseek_v3 names in brackets; kernels (in, out...) as everywhere in nn/):
  wq (d, H, N + Dr)                  [q_proj]            when mla.q_lora_rank == 0, else
  wq_a (d, Q), q_a_norm, wq_b (Q, H, N + Dr)  [q_a_proj, q_a_layernorm, q_b_proj]
  wkv_a (d, R + Dr)                  [kv_a_proj_with_mqa: the latent, then the shared RoPE key]
  kv_a_norm (R)                      [kv_a_layernorm]
  wkv_b (R, H, N + V)                [kv_b_proj: each head's no-RoPE key dims, then its value dims]
  wo (H, V, d)                       [o_proj]
  bq_a (Q), bkv_a (R + Dr), bo (d)   [the attention_bias biases: model.qkv_bias / out_bias]
with N = qk_nope_head_dim, Dr = qk_rope_head_dim, V = v_head_dim, R = kv_lora_rank, Q = q_lora_rank. Each
head's q is [N no-RoPE dims ; Dr RoPE dims]; RoPE (model.rope_layout; DeepSeek: 'interleaved') rotates the
Dr dims of q and of the shared key; the softmax scale is `ops.mla.softmax_scale` (YaRN's mscale_all_dim).

Training and scoring form every head's K and V and run the backend's attention (any path: V or q/k is
zero-padded to the wider head dim, `ops.mla.pad_last`, and the output sliced back). Decoding caches only the
normed latent 'c' (B, S, R) and the rotated RoPE key 'kr' (B, S, Dr) per layer (int8: with one scale per
token each) and attends in the latent space with W_UK absorbed into the query and W_UV applied after the
weighted sum (`ops.mla`), one shared K/V head of width R + Dr through the same backend door.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from tformer_jax import backends
from tformer_jax.config import ModelConfig
from tformer_jax.nn.attention import rope_tables, visibility
from tformer_jax.nn.common import Norm, dtypes, normal, param, project, residual_std
from tformer_jax.ops import kv_quant, mla as mla_ops, positions as pos_ops


class MLAttention(nn.Module):
  """Einsum letters: b batch, l length, s keys, d d_model, h heads, e a head's q/k or k/v dims, r a latent."""
  cfg: ModelConfig
  decode: bool = False
  cache_dtype: str = ""   # latent cache storage: '' (compute dtype) | float32 | bfloat16 | int8
  local: bool | None = None   # unused: MLA has no local layers (config validation)

  @nn.compact
  def __call__(self, x_BxLxD: jax.Array, positions_BxL: jax.Array, kv_valid_BxS: jax.Array | None,
               q_offset: jax.Array | int = 0, bias_BxHxLxS: jax.Array | None = None,
               segment_ids_BxL: jax.Array | None = None, *, deterministic: bool = True) -> jax.Array:
    """As nn.attention.Attention.__call__."""
    cfg, a = self.cfg, self.cfg.mla
    if segment_ids_BxL is not None and self.decode:
      raise ValueError("segment_ids_BxL (packed documents) is for training and scoring; decoding into a "
                       "KV cache takes one document per row")
    backend = backends.current()
    dt, pdt = dtypes(cfg)
    d, h = x_BxLxD.shape[-1], cfg.num_heads
    n, dr, dv, r = a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim, a.kv_lora_rank
    x = x_BxLxD.astype(dt)
    init, zeros = normal(cfg.init_std), nn.initializers.zeros
    if a.q_lora_rank:
      wq_a = param(self, "wq_a", init, (d, a.q_lora_rank), ("embed", "q_lora"), pdt)
      cq_BxLxQ = project(self, "wq_a", "bld,dr->blr", x, wq_a.astype(dt), 1)
      if cfg.qkv_bias:
        cq_BxLxQ += param(self, "bq_a", zeros, (a.q_lora_rank,), ("q_lora",), pdt).astype(dt)
      cq_BxLxQ = Norm(cfg, name="q_a_norm")(cq_BxLxQ)
      wq_b = param(self, "wq_b", init, (a.q_lora_rank, h, n + dr), ("q_lora", "heads", "kv"), pdt)
      q_BxLxHxE = project(self, "wq_b", "blr,rhe->blhe", cq_BxLxQ, wq_b.astype(dt), 1)
    else:
      wq = param(self, "wq", init, (d, h, n + dr), ("embed", "heads", "kv"), pdt)
      q_BxLxHxE = project(self, "wq", "bld,dhe->blhe", x, wq.astype(dt), 1)
    q_BxLxHxE = checkpoint_name(q_BxLxHxE, "query_proj")
    wkv_a = param(self, "wkv_a", init, (d, r + dr), ("embed", "kv_lora"), pdt)
    ckv_BxLxW = project(self, "wkv_a", "bld,dr->blr", x, wkv_a.astype(dt), 1)
    if cfg.qkv_bias:
      ckv_BxLxW += param(self, "bkv_a", zeros, (r + dr,), ("kv_lora",), pdt).astype(dt)
    ckv_BxLxW = checkpoint_name(ckv_BxLxW, "key_proj")
    c_BxLxR = Norm(cfg, name="kv_a_norm")(ckv_BxLxW[..., :r])
    wkv_b = param(self, "wkv_b", init, (r, h, n + dv), ("kv_lora", "heads", "kv"), pdt).astype(dt)

    if self.decode:
      filled = self.has_variable("cache", "c")   # False on the init call, which only sizes the cache
      cache = self._cache_variables(x_BxLxD.shape[:2])
      kv_len = cache["c"].value.shape[1]
    else:
      filled, kv_len = False, x_BxLxD.shape[1]
    inv_freq, rope_scale = rope_tables(cfg, kv_len, rot_dim=dr)
    rope = lambda t: pos_ops.apply_rope(t, positions_BxL, inv_freq, layout=cfg.rope_layout,  # noqa: E731
                                        attention_scaling=rope_scale)
    q_nope_BxLxHxN, q_rope_BxLxHxDr = q_BxLxHxE[..., :n], rope(q_BxLxHxE[..., n:])
    k_rope_BxLxDr = rope(ckv_BxLxW[:, :, None, r:])[:, :, 0]
    scale = mla_ops.softmax_scale(n + dr, cfg.attention_scale, cfg.rope_scaling.type, cfg.rope_scaling.factor,
                                  a.mscale_all_dim)
    if self.decode:   # the latent form (section 2.1.3): queries absorb W_UK, one shared K/V head of latents
      if filled:
        c_BxSxR, k_rope_BxSxDr = self._append_to_cache(cache, c_BxLxR, k_rope_BxLxDr, q_offset, dt)
      else:
        c_BxSxR, k_rope_BxSxDr, q_offset = c_BxLxR, k_rope_BxLxDr, 0
      q_BxLxHxW = mla_ops.absorb_query(q_nope_BxLxHxN, q_rope_BxLxHxDr, wkv_b)
      k_BxSx1xW, v_BxSx1xW = mla_ops.latent_kv(c_BxSxR, k_rope_BxSxDr)
      value_dim = None
    else:   # every head's K and V formed, padded to one head dim for the kernels
      q_offset = 0   # no cache: the keys are this call's tokens (a traced offset would read as decoding)
      k_BxSxHxE, v_BxSxHxV = mla_ops.expand_kv(c_BxLxR, k_rope_BxLxDr, wkv_b, n)
      q_BxLxHxE = jnp.concatenate([q_nope_BxLxHxN, q_rope_BxLxHxDr], axis=-1)
      width = max(n + dr, dv)
      q_BxLxHxW, k_BxSx1xW = mla_ops.pad_last(q_BxLxHxE, width), mla_ops.pad_last(k_BxSxHxE, width)
      v_BxSx1xW, value_dim = mla_ops.pad_last(checkpoint_name(v_BxSxHxV, "value_proj"), width), dv

    vis = visibility(cfg, q_offset, kv_valid_BxS, segment_ids_BxL)
    sinks_H = (param(self, "sinks", zeros, (h,), ("heads",), pdt).astype(jnp.float32)
               if cfg.attention_sinks else None)
    dropout_rate = 0.0 if deterministic else cfg.attn_dropout
    # backend hook: the one attention door (decoding: one shared latent head, the dense path)
    out_BxLxHxW, weights_BxHxLxS = backend.attention(
        q_BxLxHxW, k_BxSx1xW, v_BxSx1xW, vis, bias_BxHxLxS=bias_BxHxLxS, scale=scale, dropout_rate=dropout_rate,
        dropout_rng=self.make_rng("dropout") if dropout_rate > 0.0 else None,
        want_weights=self.is_mutable_collection("intermediates"), softcap=cfg.attn_softcap, sinks_H=sinks_H)
    if weights_BxHxLxS is not None:
      self.sow("intermediates", "attention_weights", weights_BxHxLxS)
    if value_dim is None:
      out_BxLxHxV = mla_ops.latent_output(out_BxLxHxW, wkv_b, n)
    else:
      out_BxLxHxV = out_BxLxHxW[..., :value_dim]

    out_BxLxHxV = nn.with_logical_constraint(out_BxLxHxV, ("batch", "length", "heads", "kv"))
    wo = param(self, "wo", normal(residual_std(cfg)), (h, dv, d), ("heads", "kv", "embed"), pdt)
    y_BxLxD = checkpoint_name(project(self, "wo", "blhe,hed->bld", out_BxLxHxV.astype(dt), wo.astype(dt), 2),
                              "out_proj")
    if cfg.out_bias:
      y_BxLxD += param(self, "bo", zeros, (d,), ("embed",), pdt).astype(dt)
    return y_BxLxD

  def _cache_variables(self, batch_and_len: tuple[int, int]) -> dict:
    """The 'cache' variables, sized (B, S) by the init call's input: the normed latent 'c' (B, S, R) and the
    rotated RoPE key 'kr' (B, S, Dr); an int8 cache adds their scales 'c_scale', 'kr_scale' (B, S)."""
    a = self.cfg.mla
    store = kv_quant.storage_dtype(self.cache_dtype, dtypes(self.cfg)[0])
    b, s = batch_and_len
    cache = {"c": self.variable("cache", "c", jnp.zeros, (b, s, a.kv_lora_rank), store),
             "kr": self.variable("cache", "kr", jnp.zeros, (b, s, a.qk_rope_head_dim), store)}
    if self.cache_dtype == "int8":
      for name in ("c_scale", "kr_scale"):
        cache[name] = self.variable("cache", name, jnp.zeros, (b, s), kv_quant.SCALE_DTYPE)
    return cache

  def _append_to_cache(self, cache: dict, c_BxLxR: jax.Array, k_rope_BxLxDr: jax.Array, q_offset: jax.Array | int,
                       dt: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """Writes this call's latents and RoPE keys at slot q_offset; returns the whole cache's (B, S, R) and
    (B, S, Dr) in the compute dtype."""
    put = jax.lax.dynamic_update_slice
    start = (0, q_offset, 0)
    if self.cache_dtype == "int8":
      (c_q, c_s), (k_q, k_s) = kv_quant.quantize(c_BxLxR), kv_quant.quantize(k_rope_BxLxDr)
      for name, new, at in (("c", c_q, start), ("kr", k_q, start), ("c_scale", c_s, start[:2]),
                            ("kr_scale", k_s, start[:2])):
        cache[name].value = put(cache[name].value, new, at)
      return (kv_quant.dequantize(cache["c"].value, cache["c_scale"].value, dt),
              kv_quant.dequantize(cache["kr"].value, cache["kr_scale"].value, dt))
    for name, new in (("c", c_BxLxR), ("kr", k_rope_BxLxDr)):
      cache[name].value = put(cache[name].value, new.astype(cache[name].value.dtype), start)
    return cache["c"].value.astype(dt), cache["kr"].value.astype(dt)
