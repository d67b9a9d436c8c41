"""The one model: embeddings, positions, a stack of blocks (unrolled or scanned, optionally remat'd),
final norm and LM head. Every variant in the articles is a field of `ModelConfig`, not a subclass.

A layer_pattern model (local/global layers, e.g. Gemma 3's 'LLLLLG') scans one repeat of the pattern
(`Cycle`: params 'layers/block_<j>' with a leading (num_layers // cycle,) axis), and the layers left
over when num_layers is not a multiple of the cycle run after it as 'layers_<i>' (fewer than one
cycle), so compile time and memory are one cycle's. An MoE model's dense first layers (moe.first_k_dense)
are a scanned stack of their own, 'dense_layers', before the MoE layers' 'layers'. Unrolled, every layer
is 'layers_<i>' (`nn.stacking` converts between the two layouts)."""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from tformer_jax.config import REMAT_POLICIES, ModelConfig
from tformer_jax.nn.block import Block
from tformer_jax.nn.common import Norm, dtypes, normal, param
from tformer_jax.nn.mtp import MTPModule
from tformer_jax.ops import mtp as mtp_ops, positions as pos_ops
from tformer_jax.ops.attention import soft_cap
from tformer_jax.ops.relative_bias import t5_bias

# Collections that get a leading 'layers' axis under scan_layers ('lora': a LoRA step's unmerged
# adapters, nn.common.project).
SCANNED_COLLECTIONS = ("params", "lora", "cache", "intermediates", "aux_loss", "moe_metrics")


def block_class(cfg: ModelConfig):
  """Block, or Block under jax.checkpoint with cfg.remat's policy (config.REMAT_POLICIES)."""
  if cfg.remat == "none":
    return Block
  saved = REMAT_POLICIES[cfg.remat]
  if isinstance(saved, tuple):   # activations tagged by name (attention.py, mlp.py: checkpoint_name)
    policy = jax.checkpoint_policies.save_only_these_names(*saved)
  else:
    policy = getattr(jax.checkpoint_policies, saved) if saved else None
  return nn.remat(Block, policy=policy, prevent_cse=not cfg.scan_layers)


class Cycle(nn.Module):
  """One repeat of model.layer_pattern: its blocks in order ('block_<j>', each of its layer type),
  the body `scan_layers` scans. Returns (x, None) like a Block."""
  cfg: ModelConfig
  deterministic: bool = True
  decode: bool = False
  use_moe: bool = False
  cache_dtype: str = ""

  @nn.compact
  def __call__(self, x_BxLxD: jax.Array, *args):
    cls = block_class(self.cfg)
    for j in range(self.cfg.cycle):
      x_BxLxD, _ = cls(self.cfg, self.deterministic, self.decode, self.use_moe, self.cache_dtype,
                       self.cfg.is_local_layer(j), name=f"block_{j}")(x_BxLxD, *args)
    return x_BxLxD, None


class Transformer(nn.Module):
  cfg: ModelConfig
  cache_dtype: str = ""   # KV cache storage when decoding: '' (compute dtype) | float32 | bfloat16 | int8

  @nn.compact
  def __call__(self, tokens_BxL: jax.Array, *, positions_BxL: jax.Array | None = None,
               attention_mask_BxL: jax.Array | None = None, segment_ids_BxL: jax.Array | None = None,
               token_types_BxL: jax.Array | None = None,
               inputs_embeds_BxLxD: jax.Array | None = None, deterministic: bool = True,
               decode: bool = False, return_hidden: bool = False,
               mtp_tokens_BxL: jax.Array | None = None) -> jax.Array | tuple[jax.Array, ...]:
    """Logits (B, L, vocab) in float32, or final hidden states (B, L, d_model) if not cfg.lm_head.

    return_hidden=True (needs cfg.lm_head): `(h_BxLxD, unembed_DxV)` instead of the logits: the
    final-normed hidden states and the unembedding matrix (the head, or embed.T when tied), both in
    the compute dtype, so logits = soft_cap((h_BxLxD @ unembed_DxV).astype(float32),
    cfg.final_logit_softcap). For a caller that needs only some positions' logits, or the loss
    without the full logits (ops.losses).

    attention_mask_BxL: 1 = real token, 0 = padding (never attended to). positions_BxL default to
    0..L-1 counting real tokens only (so left padding is handled). segment_ids_BxL: documents packed in
    a row (1, 2, ...; 0 = padding): a token attends only within its own (training and scoring, not
    decode; give positions restarting per document too, as the data pipeline's batches do).
    decode=True reads and appends to
    the 'cache' collection (create it by calling init with decode=True on a (B, max_len) input).
    inputs_embeds_BxLxD replaces the token lookup (soft prompts, gradient checks).
    mtp_tokens_BxL (a model with mtp_depth D > 0; the train step passes its targets): runs the D
    multi-token prediction modules too (nn/mtp.py) and returns `(h_BxLxD, unembed_DxV, [h_1 .. h_D])` as
    return_hidden does, h_k the final-normed hidden states of depth k (predicting token t+1+k at
    position t). Without it the modules never run (inference, decoding, export).
    """
    cfg = self.cfg
    valid_BxL = (jnp.ones(tokens_BxL.shape, jnp.bool_) if attention_mask_BxL is None
                 else attention_mask_BxL.astype(jnp.bool_))
    positions_BxL, kv_valid_BxS, q_offset = self._positions(valid_BxL, positions_BxL, decode)
    x_BxLxD, embed_VxD = self._embed(tokens_BxL, positions_BxL, token_types_BxL, inputs_embeds_BxLxD,
                                     deterministic)
    bias_BxHxLxS = self._relative_bias(tokens_BxL.shape[1], kv_valid_BxS.shape[1], q_offset)
    # Without padding or a cache the layers get kv_valid=None ("all valid"), so fused kernels can use
    # their causal mode.
    no_padding = attention_mask_BxL is None and not decode
    x_BxLxD = self._blocks(x_BxLxD, positions_BxL, None if no_padding else kv_valid_BxS, q_offset,
                           bias_BxHxLxS, segment_ids_BxL, deterministic=deterministic, decode=decode)
    mtp_h = None   # the MTP modules' parameters are made by init (not a decoding cache's)
    if cfg.mtp_depth and (mtp_tokens_BxL is not None or (self.is_initializing() and not decode)):
      mtp_h = self._mtp(x_BxLxD, tokens_BxL if mtp_tokens_BxL is None else mtp_tokens_BxL, embed_VxD,
                        positions_BxL, None if no_padding else kv_valid_BxS, bias_BxHxLxS, segment_ids_BxL,
                        deterministic=deterministic)
    if cfg.final_norm:
      x_BxLxD = Norm(cfg, name="final_norm")(x_BxLxD)
    if not cfg.lm_head:
      if return_hidden:
        raise ValueError("return_hidden=True needs model.lm_head (there is no unembedding matrix)")
      return x_BxLxD.astype(jnp.float32)
    unembed_DxV = self._unembedding(embed_VxD)
    if mtp_tokens_BxL is not None:
      if mtp_h is None:
        raise ValueError("mtp_tokens_BxL needs a model with model.mtp_depth > 0")
      return x_BxLxD, unembed_DxV, mtp_h
    if return_hidden:
      return x_BxLxD, unembed_DxV
    logits = jnp.einsum("bld,dv->blv", x_BxLxD, unembed_DxV).astype(jnp.float32)
    return soft_cap(logits, cfg.final_logit_softcap)

  def _positions(self, valid_BxL: jax.Array, positions_BxL: jax.Array | None,
                 decode: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(positions_BxL, kv_valid_BxS, q_offset). Decoding keeps two 'cache' variables: 'index' (the
    next free slot, this call's q_offset) and 'kv_valid' (B, S), which slots hold real tokens."""
    cfg = self.cfg
    b, l = valid_BxL.shape
    q_offset = jnp.zeros((), jnp.int32)
    pos_offset_Bx1 = jnp.zeros((b, 1), jnp.int32)   # real tokens before this call (default positions)
    kv_valid_BxS = valid_BxL
    if decode:
      filled = self.has_variable("cache", "index")   # False on the init call, which only sizes the cache
      index = self.variable("cache", "index", lambda: jnp.zeros((), jnp.int32))
      cache_valid = self.variable("cache", "kv_valid", jnp.zeros, (b, l), jnp.bool_)
      if filled:
        q_offset = index.value
        pos_offset_Bx1 = jnp.sum(cache_valid.value, axis=1, dtype=jnp.int32)[:, None]   # not slots: padding
        cache_valid.value = jax.lax.dynamic_update_slice(cache_valid.value, valid_BxL, (0, q_offset))
        index.value = index.value + l
        kv_valid_BxS = cache_valid.value
    if positions_BxL is None:
      positions_BxL = jnp.maximum(jnp.cumsum(valid_BxL, axis=1) - 1, 0) + pos_offset_Bx1
    elif cfg.position == "learned" and not isinstance(positions_BxL, jax.core.Tracer):
      if int(jnp.max(positions_BxL)) >= cfg.max_len:
        raise ValueError(f"position {int(jnp.max(positions_BxL))} is beyond model.max_len={cfg.max_len} "
                         "(learned positions cannot extrapolate)")
    if cfg.position == "learned" and not decode and l > cfg.max_len:
      raise ValueError(f"sequence length {l} exceeds model.max_len={cfg.max_len}; learned positions "
                       "cannot extrapolate (use rope/alibi/t5, or raise max_len)")
    return positions_BxL, kv_valid_BxS, q_offset

  def _embed(self, tokens_BxL: jax.Array, positions_BxL: jax.Array, token_types_BxL: jax.Array | None,
             inputs_embeds_BxLxD: jax.Array | None, deterministic: bool) -> tuple[jax.Array, jax.Array]:
    """(x_BxLxD entering the first block, the token embedding (V, D))."""
    cfg = self.cfg
    dt, pdt = dtypes(cfg)
    embed_VxD = param(self, "embed", normal(cfg.init_std), (cfg.vocab_size, cfg.d_model), ("vocab", "embed"),
                      pdt)
    if inputs_embeds_BxLxD is None:
      x_BxLxD = jnp.take(embed_VxD, tokens_BxL, axis=0).astype(dt)
    else:
      x_BxLxD = inputs_embeds_BxLxD.astype(dt)
    if cfg.embed_scale:
      x_BxLxD = x_BxLxD * jnp.asarray(cfg.d_model ** 0.5, dt)
    if cfg.position == "learned":
      pos_emb = param(self, "pos_embed", normal(cfg.init_std), (cfg.max_len, cfg.d_model),
                      ("position", "embed"), pdt)
      x_BxLxD = x_BxLxD + jnp.take(pos_emb, positions_BxL, axis=0).astype(dt)
    elif cfg.position == "sinusoidal":
      x_BxLxD = x_BxLxD + pos_ops.sinusoidal_at(positions_BxL, cfg.d_model).astype(dt)
    if cfg.type_vocab_size:
      types = jnp.zeros_like(tokens_BxL) if token_types_BxL is None else token_types_BxL
      type_emb = param(self, "type_embed", normal(cfg.init_std), (cfg.type_vocab_size, cfg.d_model),
                       (None, "embed"), pdt)
      x_BxLxD = x_BxLxD + jnp.take(type_emb, types, axis=0).astype(dt)
    if cfg.embed_norm:
      x_BxLxD = Norm(cfg, name="embed_norm")(x_BxLxD)
    x_BxLxD = nn.Dropout(cfg.embed_dropout)(x_BxLxD, deterministic=deterministic)
    return nn.with_logical_constraint(x_BxLxD, ("batch", "length", "embed")), embed_VxD

  def _relative_bias(self, l: int, s: int, q_offset: jax.Array) -> jax.Array | None:
    """T5's bucketed relative bias (B=1, H, L, S) shared by every layer; None for other positions."""
    cfg = self.cfg
    if cfg.position != "t5":
      return None
    table = param(self, "rel_bias", normal(cfg.init_std), (cfg.t5_num_buckets, cfg.num_heads),
                  (None, "heads"), dtypes(cfg)[1])
    return t5_bias(table.astype(jnp.float32), (q_offset + jnp.arange(l))[None], jnp.arange(s)[None],
                   bidirectional=not cfg.causal, num_buckets=cfg.t5_num_buckets,
                   max_distance=cfg.t5_max_distance)

  def _blocks(self, x_BxLxD: jax.Array, *args, deterministic: bool, decode: bool) -> jax.Array:
    """The stack of blocks, scanned (one 'layers' module: a Block, or a Cycle of the layer pattern,
    then the layers past the last whole cycle as 'layers_<i>'; moe.first_k_dense dense layers first as
    'dense_layers', a multiple of the cycle) or unrolled ('layers_<i>')."""
    cfg = self.cfg
    cls = block_class(cfg)
    first = 0   # the first layer not in the scan
    if cfg.scan_layers:
      body = cls if cfg.cycle == 1 else Cycle
      local = (cfg.is_local_layer(0),) if cfg.cycle == 1 else ()
      dense = cfg.moe.first_k_dense if cfg.moe.num_experts else 0
      repeats = (cfg.num_layers - dense) // cfg.cycle
      for name, length, moe in (("dense_layers", dense // cfg.cycle, False),
                                ("layers", repeats, cfg.moe.num_experts > 0)):
        if length:
          scanned = nn.scan(body, variable_axes={c: 0 for c in SCANNED_COLLECTIONS},
                            split_rngs={"params": True, "dropout": True}, in_axes=(nn.broadcast,) * len(args),
                            length=length, metadata_params={nn.PARTITION_NAME: "layers"})
          x_BxLxD, _ = scanned(cfg, deterministic, decode, moe, self.cache_dtype, *local,
                               name=name)(x_BxLxD, *args)
      first = dense + repeats * cfg.cycle
    for i in range(first, cfg.num_layers):
      x_BxLxD, _ = cls(cfg, deterministic, decode, cfg.is_moe_layer(i), self.cache_dtype, cfg.is_local_layer(i),
                       name=f"layers_{i}")(x_BxLxD, *args)
    return x_BxLxD

  def _mtp(self, h_BxLxD: jax.Array, next_BxL: jax.Array, embed_VxD: jax.Array, *args,
           deterministic: bool) -> list[jax.Array]:
    """The multi-token prediction modules 'mtp_<k-1>', k = 1..D in sequence: depth k at position i takes
    depth k-1's hidden state (the main stack's, before its final norm, for k = 1) and the embedding of
    token t_{i+k} (next_BxL: t_{i+1}, shifted); returns each depth's final-normed hidden states."""
    cfg = self.cfg
    dt = dtypes(cfg)[0]
    out = []
    for k in range(1, cfg.mtp_depth + 1):
      emb_BxLxD = jnp.take(embed_VxD, mtp_ops.depth_inputs(next_BxL, k), axis=0).astype(dt)
      if cfg.embed_scale:
        emb_BxLxD = emb_BxLxD * jnp.asarray(cfg.d_model ** 0.5, dt)
      h_BxLxD, normed_BxLxD = MTPModule(cfg, block_class(cfg), deterministic, cfg.is_moe_layer(cfg.num_layers + k - 1),
                                        name=f"mtp_{k - 1}")(h_BxLxD, emb_BxLxD, *args)
      out.append(normed_BxLxD)
    return out

  def _unembedding(self, embed_VxD: jax.Array) -> jax.Array:
    """The (D, V) unembedding in the compute dtype: the head, or embed.T when tied."""
    cfg = self.cfg
    dt, pdt = dtypes(cfg)
    if cfg.tie_embeddings:
      return embed_VxD.astype(dt).T
    head = param(self, "head", normal(cfg.init_std), (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), pdt)
    return head.astype(dt)


def sown_per_layer(tree: Any, name: str) -> list[jax.Array]:
  """Values sown as `name` (e.g. in the 'intermediates' collection), in layer order. Unrolled layers
  live under 'layers_<i>'; a scanned stack under 'layers' holds arrays with a leading axis, one entry
  per layer (or per cycle under 'layers/block_<j>': layer k * cycle + j), split here into one per layer;
  a model's scanned dense first layers ('dense_layers') come before them and the layers after the scanned
  cycles ('layers_<i>') after them."""
  found: list[tuple[tuple[int, ...], jax.Array]] = []
  for path, value in jax.tree_util.tree_flatten_with_path(tree)[0]:
    keys = [str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)]
    if name not in keys or any(k.startswith("mtp_") for k in keys):   # the main stack's layers only
      continue
    layer = next((int(k[7:]) for k in keys if k.startswith("layers_") and k[7:].isdigit()), None)
    block = next((int(k[6:]) for k in keys if k.startswith("block_") and k[6:].isdigit()), None)
    if layer is None and ("layers" in keys or "dense_layers" in keys):   # scanned: (repeat, block) orders them
      stack = 0 if "dense_layers" in keys else 1
      found.extend(((0, stack, i, block or 0, len(found)), value[i]) for i in range(value.shape[0]))
    elif layer is None:
      found.append(((-1, 0, 0, 0, len(found)), value))
    else:
      found.append(((1, 0, layer, 0, len(found)), value))
  found.sort(key=lambda t: t[0])
  return [v for _, v in found]
