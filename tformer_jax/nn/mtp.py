"""DeepSeek-V3's multi-token prediction module (section 2.2): one per depth k, after the main stack.

h'_i = eh_proj([enorm(Emb(t_{i+k})) ; hnorm(h_i^{k-1})]), h^k = Block(h'), logits = head(final_norm(h^k)),
with the main model's token embedding and LM head shared, h^0 the main stack's output before its final
norm. Parameters per module 'mtp_<k-1>' (DeepSeek-V3's checkpoint layer num_layers + k - 1 in brackets):
enorm [enorm], hnorm [hnorm], eh_proj (2 d, d) [eh_proj: input dims [embedding ; hidden]], block (one
transformer block) and final_norm [shared_head.norm]. They run only when the train step's loss asks
(`Transformer(..., mtp_tokens_BxL=...)`): inference, decoding and export never see them.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from tformer_jax.config import ModelConfig
from tformer_jax.nn.common import Norm, dtypes, normal, param, project


class MTPModule(nn.Module):
  """Returns (h^k before its norm: the next depth's input, final_norm(h^k): this depth's head input)."""
  cfg: ModelConfig
  block: type   # the main stack's block class (nn.transformer.block_class: remat included)
  deterministic: bool = True
  use_moe: bool = False

  @nn.compact
  def __call__(self, h_BxLxD: jax.Array, emb_BxLxD: jax.Array, positions_BxL: jax.Array,
               kv_valid_BxS: jax.Array | None, bias_BxHxLxS: jax.Array | None,
               segment_ids_BxL: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    cfg = self.cfg
    dt, pdt = dtypes(cfg)
    d = cfg.d_model
    x_BxLx2D = jnp.concatenate([Norm(cfg, name="enorm")(emb_BxLxD.astype(dt)),
                                Norm(cfg, name="hnorm")(h_BxLxD.astype(dt))], axis=-1)
    w = param(self, "eh_proj", normal(cfg.init_std), (2 * d, d), ("embed_concat", "embed"), pdt)
    x_BxLxD = project(self, "eh_proj", "blc,cd->bld", x_BxLx2D, w.astype(dt), 1)
    x_BxLxD, _ = self.block(cfg, self.deterministic, False, self.use_moe, "", None, name="block")(
        x_BxLxD, positions_BxL, kv_valid_BxS, jnp.zeros((), jnp.int32), bias_BxHxLxS, segment_ids_BxL)
    return x_BxLxD, Norm(cfg, name="final_norm")(x_BxLxD)
