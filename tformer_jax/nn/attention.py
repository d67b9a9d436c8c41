"""Multi-head attention (MHA / GQA / MQA) with positions, masks and an optional KV cache.

Masks and relative biases are index-based: query i of this call sits at cache slot q_offset + i, key j
at slot j. For left-padded batches, padding slots are simply invalid keys (`kv_valid`), so index
distances equal position distances among real tokens. RoPE uses the explicit `positions`.
Which keys a query sees is one `ops.masks.Visibility`; the backend computes softmax(QK^T)V under it, or
with model.attention='linear' phi(Q)phi(K)^T V normalised (ops/linear_attention.py).
The cache stores K/V in `cache_dtype` ('' = the compute dtype, bfloat16, or int8 with one scale per
token and KV head, ops/kv_quant.py); attention always sees them dequantised to the compute dtype.

Per-layer types (model.layer_pattern): a local layer attends within `window` keys (with its own RoPE
base when model.local_rope_theta > 0), a global layer sees every earlier key. A local layer's decode
cache is a ring of `window` slots (slot = cache index mod window, each slot's cache index kept beside
it): attention sees the ring as it was plus this call's keys, and the newest `window` of those are
written back, so its cache does not grow with the context.
QK-norm (model.qk_norm) normalises q and k before RoPE, per head ('head': Qwen3, Gemma 3) or over the
whole projection ('proj': OLMo 2); model.attn_softcap caps the scores; model.attention_sinks adds a
learned logit per head to every softmax denominator (GPT-OSS).
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from tformer_jax import backends
from tformer_jax.config import ModelConfig
from tformer_jax.nn.common import Norm, dtypes, normal, param, project, residual_std
from tformer_jax.ops import kv_quant, positions as pos_ops
from tformer_jax.ops.masks import RandomBlocks, Visibility
from tformer_jax.ops.rope_scaling import rope_parameters


def rope_tables(cfg: ModelConfig, seq_len: int, local: bool = False, rot_dim: int = 0) -> tuple[jax.Array, float]:
  """(inv_freq, attention_scaling) for this model's RoPE, with its scaling rule applied; a local layer
  of a model with local_rope_theta > 0 uses that base, unscaled. rot_dim: the rotated dims (0 = the
  model's head_dim x rotary_fraction; MLA: mla.qk_rope_head_dim)."""
  rot = rot_dim or pos_ops.rotary_dim(cfg.hd, cfg.rotary_fraction)
  if local and cfg.local_rope_theta > 0:
    return pos_ops.rope_inv_freq(rot, cfg.local_rope_theta), 1.0
  if cfg.rope_scaling.type == "none":
    return pos_ops.rope_inv_freq(rot, cfg.rope_theta), 1.0
  return rope_parameters(rot, cfg.rope_theta, cfg.rope_scaling, max_len=cfg.max_len, seq_len=seq_len)


def visibility(cfg: ModelConfig, q_offset: int | jax.Array = 0,
               kv_valid_BxS: jax.Array | None = None, segment_ids_BxL: jax.Array | None = None, *,
               local: bool | None = None, kv_positions_BxS: jax.Array | None = None) -> Visibility:
  """Which keys each query sees in this model (causality, window, global tokens, BigBird random blocks,
  padding, and with segment ids only the keys of the query's own segment: packed documents never see
  each other). local: this layer's type (None: every layer alike); a global layer of a layer_pattern
  model has no window. kv_positions_BxS: the cache index of each key (a local layer's ring)."""
  random = (RandomBlocks(cfg.random_blocks, cfg.random_block_size, cfg.random_block_seed, cfg.max_len)
            if cfg.random_blocks else None)
  window = cfg.window if local is None or local else 0
  return Visibility(causal=cfg.causal, window=window, num_global=cfg.num_global_tokens, random=random,
                    q_offset=q_offset, kv_valid_BxS=kv_valid_BxS, q_segment_ids_BxL=segment_ids_BxL,
                    kv_segment_ids_BxS=segment_ids_BxL, kv_positions_BxS=kv_positions_BxS)


class Attention(nn.Module):
  """Einsum letters: b batch, l length, d d_model, h heads, k KV heads, e head_dim (Dh)."""
  cfg: ModelConfig
  decode: bool = False
  cache_dtype: str = ""   # KV cache storage: '' (compute dtype) | float32 | bfloat16 | int8
  local: bool | None = None   # this layer's type in a layer_pattern model (None: every layer alike)

  @property
  def ring(self) -> int:
    """Slots of this layer's ring cache: the window of a local layer decoding, else 0 (a cache of
    every slot)."""
    cfg = self.cfg
    local = cfg.window > 0 and (self.local is None or self.local)
    widened = cfg.num_global_tokens or cfg.random_blocks   # keys outside the window stay visible: no ring
    return cfg.window if self.decode and local and not widened else 0

  @nn.compact
  def __call__(self, x_BxLxD: jax.Array, positions_BxL: jax.Array, kv_valid_BxS: jax.Array | None,
               q_offset: jax.Array | int = 0, bias_BxHxLxS: jax.Array | None = None,
               segment_ids_BxL: jax.Array | None = None, *, deterministic: bool = True) -> jax.Array:
    """kv_valid_BxS: validity of every key this call attends to: (B, L) without a cache, the whole
    cache's (B, S) when decoding; None = every key is valid (no padding: lets fused kernels use
    their causal mode). q_offset: cache slot of this call's first token (decode only).
    segment_ids_BxL: documents packed into one row (1, 2, ...; 0 = padding): a query sees only keys
    of its own segment. Training and scoring only (not with a KV cache).
    deterministic=False applies cfg.attn_dropout to the attention weights (needs the 'dropout' rng)."""
    cfg = self.cfg
    if segment_ids_BxL is not None and self.decode:
      raise ValueError("segment_ids_BxL (packed documents) is for training and scoring; decoding into a "
                       "KV cache takes one document per row")
    backend = backends.current()
    dt, pdt = dtypes(cfg)
    d = x_BxLxD.shape[-1]
    h, k, dh = cfg.num_heads, cfg.kv_heads, cfg.hd
    x = x_BxLxD.astype(dt)
    init = normal(cfg.init_std)
    wq = param(self, "wq", init, (d, h, dh), ("embed", "heads", "kv"), pdt)
    wk = param(self, "wk", init, (d, k, dh), ("embed", "kv_heads", "kv"), pdt)
    wv = param(self, "wv", init, (d, k, dh), ("embed", "kv_heads", "kv"), pdt)
    # the projection einsums (nn.common.project: the backend's dense, plus a LoRA step's adapters)
    q_BxLxHxDh = project(self, "wq", "bld,dhe->blhe", x, wq.astype(dt), 1)
    k_BxLxKxDh = project(self, "wk", "bld,dke->blke", x, wk.astype(dt), 1)
    v_BxLxKxDh = project(self, "wv", "bld,dke->blke", x, wv.astype(dt), 1)
    # names a remat policy can keep (config.REMAT_POLICIES); no effect otherwise
    q_BxLxHxDh = checkpoint_name(q_BxLxHxDh, "query_proj")
    k_BxLxKxDh = checkpoint_name(k_BxLxKxDh, "key_proj")
    v_BxLxKxDh = checkpoint_name(v_BxLxKxDh, "value_proj")
    if cfg.qkv_bias:
      zeros = nn.initializers.zeros
      q_BxLxHxDh += param(self, "bq", zeros, (h, dh), ("heads", "kv"), pdt).astype(dt)
      k_BxLxKxDh += param(self, "bk", zeros, (k, dh), ("kv_heads", "kv"), pdt).astype(dt)
      v_BxLxKxDh += param(self, "bv", zeros, (k, dh), ("kv_heads", "kv"), pdt).astype(dt)
    if cfg.qk_norm != "none":
      q_BxLxHxDh, k_BxLxKxDh = self._qk_norm(q_BxLxHxDh), self._qk_norm(k_BxLxKxDh, "k_norm")

    if self.decode:
      filled = self.has_variable("cache", "k")   # False on the init call, which only sizes the cache
      cache = self._cache_variables(x_BxLxD.shape[:2])
      kv_len = cache["k"].value.shape[1]
    else:
      filled, kv_len = False, x_BxLxD.shape[1]
    if cfg.position == "rope":
      inv_freq, rope_scale = rope_tables(cfg, kv_len, bool(self.local))
      q_BxLxHxDh = pos_ops.apply_rope(q_BxLxHxDh, positions_BxL, inv_freq, layout=cfg.rope_layout,
                                      attention_scaling=rope_scale)
      k_BxLxKxDh = pos_ops.apply_rope(k_BxLxKxDh, positions_BxL, inv_freq, layout=cfg.rope_layout,
                                      attention_scaling=rope_scale)
    kv_positions_BxS = None
    if filled and self.ring:
      k_BxSxKxDh, v_BxSxKxDh, kv_positions_BxS, kv_valid_BxS = self._ring_append(
          cache, k_BxLxKxDh, v_BxLxKxDh, q_offset, kv_valid_BxS, dt)
    elif filled:
      k_BxSxKxDh, v_BxSxKxDh = self._append_to_cache(cache, k_BxLxKxDh, v_BxLxKxDh, q_offset, dt)
    else:
      k_BxSxKxDh, v_BxSxKxDh, q_offset = k_BxLxKxDh, v_BxLxKxDh, 0

    vis = visibility(cfg, q_offset, kv_valid_BxS, segment_ids_BxL, local=self.local,
                     kv_positions_BxS=kv_positions_BxS)
    sinks_H = (param(self, "sinks", nn.initializers.zeros, (h,), ("heads",), pdt).astype(jnp.float32)
               if cfg.attention_sinks else None)
    dropout_rate = 0.0 if deterministic else cfg.attn_dropout
    # backend hook: softmax(QK^T)V under `vis` with the kernel the runtime chose (runtime.attention)
    out_BxLxHxDh, weights_BxHxLxS = backend.attention(
        q_BxLxHxDh, k_BxSxKxDh, v_BxSxKxDh, vis, bias_BxHxLxS=bias_BxHxLxS,
        alibi_slopes_H=pos_ops.alibi_slopes(h) if cfg.position == "alibi" else None,
        scale=cfg.attention_scale or None, dropout_rate=dropout_rate,
        dropout_rng=self.make_rng("dropout") if dropout_rate > 0.0 else None,
        want_weights=self.is_mutable_collection("intermediates"), linear=cfg.attention == "linear",
        softcap=cfg.attn_softcap, sinks_H=sinks_H)
    if weights_BxHxLxS is not None:
      self.sow("intermediates", "attention_weights", weights_BxHxLxS)

    out_BxLxHxDh = nn.with_logical_constraint(out_BxLxHxDh, ("batch", "length", "heads", "kv"))
    wo = param(self, "wo", normal(residual_std(cfg)), (h, dh, d), ("heads", "kv", "embed"), pdt)
    y_BxLxD = checkpoint_name(project(self, "wo", "blhe,hed->bld", out_BxLxHxDh.astype(dt), wo.astype(dt), 2),
                              "out_proj")
    if cfg.out_bias:
      y_BxLxD += param(self, "bo", nn.initializers.zeros, (d,), ("embed",), pdt).astype(dt)
    return y_BxLxD

  def _qk_norm(self, x_BxLxNxDh: jax.Array, name: str = "q_norm") -> jax.Array:
    """QK-norm of q or k before RoPE: the model's norm over each head's Dh ('head'), or over the whole
    projection N * Dh ('proj')."""
    if self.cfg.qk_norm == "head":
      return Norm(self.cfg, name=name)(x_BxLxNxDh)
    b, l, n, dh = x_BxLxNxDh.shape
    return Norm(self.cfg, name=name)(x_BxLxNxDh.reshape(b, l, n * dh)).reshape(b, l, n, dh)

  def _cache_variables(self, batch_and_len: tuple[int, int]) -> dict:
    """The 'cache' variables, sized (B, S) by the init call's input: 'k', 'v' (B, S, K, Dh), and for
    an int8 cache their scales 'k_scale', 'v_scale' (B, S, K). A local layer's ring has min(window, S)
    slots instead of S, with each slot's cache index 'pos' and validity 'valid' (B, W) (a fresh cache is
    all zeros: no slot valid)."""
    cfg = self.cfg
    store = kv_quant.storage_dtype(self.cache_dtype, dtypes(cfg)[0])
    b, s = batch_and_len
    if self.ring:
      s = min(self.ring, s)
    shape = (b, s, cfg.kv_heads, cfg.hd)
    cache = {n: self.variable("cache", n, jnp.zeros, shape, store) for n in ("k", "v")}
    if self.cache_dtype == "int8":
      for n in ("k_scale", "v_scale"):
        cache[n] = self.variable("cache", n, jnp.zeros, shape[:3], kv_quant.SCALE_DTYPE)
    if self.ring:
      cache["pos"] = self.variable("cache", "pos", jnp.zeros, (b, s), jnp.int32)
      cache["valid"] = self.variable("cache", "valid", jnp.zeros, (b, s), jnp.bool_)
    return cache

  def _ring_append(self, cache: dict, k_BxLxKxDh: jax.Array, v_BxLxKxDh: jax.Array, q_offset: jax.Array,
                   kv_valid_BxS: jax.Array, dt: jnp.dtype) -> tuple[jax.Array, ...]:
    """A local layer's ring: returns the keys and values this call attends to, the ring as it was
    followed by this call's (B, W + L, K, Dh), their cache indices (B, W + L) and validity (B, W + L)
    (kv_valid_BxS: the whole context's slots, this call's included). Then each ring slot s takes, per
    row, this call's key at the newest index t <= the row's last valid one with t = s mod W, if the
    call holds it: the W newest keys, never a right-padding key past the last real one (a Session's
    padded chunk, written again by the next call)."""
    w, l = cache["k"].value.shape[1], k_BxLxKxDh.shape[1]
    new_pos = q_offset + jnp.arange(l, dtype=jnp.int32)
    new_ok = jax.lax.dynamic_slice_in_dim(kv_valid_BxS, q_offset, l, axis=1)
    if self.cache_dtype == "int8":
      (k_q, k_s), (v_q, v_s) = kv_quant.quantize(k_BxLxKxDh), kv_quant.quantize(v_BxLxKxDh)
      old_k = kv_quant.dequantize(cache["k"].value, cache["k_scale"].value, dt)
      old_v = kv_quant.dequantize(cache["v"].value, cache["v_scale"].value, dt)
      k_new, v_new = kv_quant.dequantize(k_q, k_s, dt), kv_quant.dequantize(v_q, v_s, dt)
      stored = {"k": k_q, "v": v_q, "k_scale": k_s, "v_scale": v_s}
    else:
      store = cache["k"].value.dtype
      stored = {"k": k_BxLxKxDh.astype(store), "v": v_BxLxKxDh.astype(store)}
      old_k, old_v = cache["k"].value.astype(dt), cache["v"].value.astype(dt)
      k_new, v_new = stored["k"].astype(dt), stored["v"].astype(dt)
    keys = jnp.concatenate([old_k, k_new], axis=1)
    values = jnp.concatenate([old_v, v_new], axis=1)
    b = new_ok.shape[0]
    positions = jnp.concatenate([cache["pos"].value, jnp.broadcast_to(new_pos, (b, l))], axis=1)
    valid = jnp.concatenate([cache["valid"].value, new_ok], axis=1)
    # per row and slot: the newest index t <= last with t = s (mod W); taken from this call if t >= q_offset
    last_B = jnp.max(jnp.where(new_ok, new_pos, -1), axis=1)
    t_BxW = last_B[:, None] - (last_B[:, None] - jnp.arange(w)) % w
    take_BxW = t_BxW >= q_offset
    i_BxW = jnp.clip(t_BxW - q_offset, 0, l - 1)
    for name, new in stored.items():
      picked = jnp.take_along_axis(new, i_BxW.reshape(b, w, *([1] * (new.ndim - 2))), axis=1)
      keep = take_BxW.reshape(b, w, *([1] * (new.ndim - 2)))
      cache[name].value = jnp.where(keep, picked, cache[name].value)
    cache["pos"].value = jnp.where(take_BxW, t_BxW, cache["pos"].value)
    cache["valid"].value = jnp.where(take_BxW, jnp.take_along_axis(new_ok, i_BxW, axis=1), cache["valid"].value)
    return keys, values, positions, valid

  def _append_to_cache(self, cache: dict, k_BxLxKxDh: jax.Array, v_BxLxKxDh: jax.Array,
                       q_offset: jax.Array | int, dt: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """Writes this call's keys and values at slot q_offset; returns the whole cache's (B, S, K, Dh)
    keys and values in the compute dtype."""
    start = (0, q_offset, 0, 0)
    put = jax.lax.dynamic_update_slice
    if self.cache_dtype == "int8":
      (k_q, k_s), (v_q, v_s) = kv_quant.quantize(k_BxLxKxDh), kv_quant.quantize(v_BxLxKxDh)
      for n, new, at in (("k", k_q, start), ("v", v_q, start), ("k_scale", k_s, start[:3]),
                         ("v_scale", v_s, start[:3])):
        cache[n].value = put(cache[n].value, new, at)
      return (kv_quant.dequantize(cache["k"].value, cache["k_scale"].value, dt),
              kv_quant.dequantize(cache["v"].value, cache["v_scale"].value, dt))
    for n, new in (("k", k_BxLxKxDh), ("v", v_BxLxKxDh)):
      cache[n].value = put(cache[n].value, new.astype(cache[n].value.dtype), start)
    return cache["k"].value.astype(dt), cache["v"].value.astype(dt)
