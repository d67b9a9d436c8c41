"""One transformer block: Pre-LN, Post-LN, sandwich (Gemma 2/3), reordered (OLMo 2) or parallel residual,
around attention and an FFN (or MoE)."""
from __future__ import annotations

import flax.linen as nn
import jax

from tformer_jax import backends
from tformer_jax.config import ModelConfig
from tformer_jax.nn.attention import Attention
from tformer_jax.nn.common import Norm
from tformer_jax.nn.mla import MLAttention
from tformer_jax.nn.mlp import MLP
from tformer_jax.nn.moe import MoEFFN


class Block(nn.Module):
  """Returns (x, None) so the same class serves the unrolled loop and `nn.scan`."""
  cfg: ModelConfig
  deterministic: bool = True
  decode: bool = False
  use_moe: bool = False
  cache_dtype: str = ""   # KV cache storage (nn/attention.py)
  local: bool | None = None   # layer type of a layer_pattern model (nn/attention.py); None: all alike

  @nn.compact
  def __call__(self, x_BxLxD: jax.Array, positions_BxL: jax.Array, kv_valid_BxS: jax.Array | None,
               q_offset: jax.Array, bias_BxHxLxS: jax.Array | None, segment_ids_BxL: jax.Array | None = None):
    cfg, det = self.cfg, self.deterministic
    # backend hook on the residual stream entering the block: identity on the reference backend; the
    # xla_cpu backend materialises its gradient once per block (docs/runtime.md)
    x_BxLxD = backends.current().residual(x_BxLxD)
    attn = (MLAttention if cfg.use_mla else Attention)(cfg, self.decode, self.cache_dtype, self.local, name="attn")
    ffn = MoEFFN(cfg, name="moe") if self.use_moe else MLP(cfg, name="mlp")
    position = cfg.norm_position
    if position != "reordered":
      ln1, ln2 = Norm(cfg, name="ln1"), Norm(cfg, name="ln2")
    if position in ("sandwich", "reordered"):
      post_attn, post_ffn = Norm(cfg, name="post_attn_norm"), Norm(cfg, name="post_ffn_norm")
    drop_attn, drop_ffn = (nn.Dropout(cfg.resid_dropout, deterministic=det) for _ in range(2))
    ctx = (positions_BxL, kv_valid_BxS, q_offset, bias_BxHxLxS, segment_ids_BxL)   # what attention sees

    if cfg.parallel_residual:
      x_BxLxD = (x_BxLxD + drop_attn(attn(ln1(x_BxLxD), *ctx, deterministic=det))
                 + drop_ffn(ffn(ln2(x_BxLxD), deterministic=det)))
    elif position == "pre":
      x_BxLxD = x_BxLxD + drop_attn(attn(ln1(x_BxLxD), *ctx, deterministic=det))
      x_BxLxD = x_BxLxD + drop_ffn(ffn(ln2(x_BxLxD), deterministic=det))
    elif position == "sandwich":   # Gemma 2/3: a norm before and after each sublayer
      x_BxLxD = x_BxLxD + drop_attn(post_attn(attn(ln1(x_BxLxD), *ctx, deterministic=det)))
      x_BxLxD = x_BxLxD + drop_ffn(post_ffn(ffn(ln2(x_BxLxD), deterministic=det)))
    elif position == "reordered":   # OLMo 2: the norm on each sublayer's output, before the residual add
      x_BxLxD = x_BxLxD + drop_attn(post_attn(attn(x_BxLxD, *ctx, deterministic=det)))
      x_BxLxD = x_BxLxD + drop_ffn(post_ffn(ffn(x_BxLxD, deterministic=det)))
    else:  # post: the original Transformer / BERT
      x_BxLxD = ln1(x_BxLxD + drop_attn(attn(x_BxLxD, *ctx, deterministic=det)))
      x_BxLxD = ln2(x_BxLxD + drop_ffn(ffn(x_BxLxD, deterministic=det)))
    x_BxLxD = nn.with_logical_constraint(x_BxLxD, ("batch", "length", "embed"))
    if self.is_mutable_collection("intermediates"):
      self.sow("intermediates", "block_out", x_BxLxD)
    return x_BxLxD, None
