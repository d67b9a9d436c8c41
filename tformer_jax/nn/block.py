"""One transformer block: Pre-LN, Post-LN or parallel residual, around attention and an FFN (or MoE)."""
from __future__ import annotations

import flax.linen as nn
import jax

from tformer_jax import backends
from tformer_jax.config import ModelConfig
from tformer_jax.nn.attention import Attention
from tformer_jax.nn.common import Norm
from tformer_jax.nn.mlp import MLP
from tformer_jax.nn.moe import MoEFFN


class Block(nn.Module):
  """Returns (x, None) so the same class serves the unrolled loop and `nn.scan`."""
  cfg: ModelConfig
  deterministic: bool = True
  decode: bool = False
  use_moe: bool = False
  cache_dtype: str = ""   # KV cache storage (nn/attention.py)

  @nn.compact
  def __call__(self, x_BxLxD: jax.Array, positions_BxL: jax.Array, kv_valid_BxS: jax.Array | None,
               q_offset: jax.Array, bias_BxHxLxS: jax.Array | None, segment_ids_BxL: jax.Array | None = None):
    cfg = self.cfg
    x_BxLxD = backends.current().residual(x_BxLxD)   # the residual stream entering the block
    attn = Attention(cfg, self.deterministic, self.decode, self.cache_dtype, name="attn")
    if self.use_moe:
      moe = MoEFFN(cfg, name="moe")
      ffn = lambda y: moe(y, deterministic=self.deterministic)  # noqa: E731
    else:
      ffn = MLP(cfg, name="mlp")
    drop = lambda y: nn.Dropout(cfg.resid_dropout)(y, deterministic=self.deterministic)  # noqa: E731
    ln1, ln2 = Norm(cfg, name="ln1"), Norm(cfg, name="ln2")
    mix = lambda y: attn(y, positions_BxL, kv_valid_BxS, q_offset, bias_BxHxLxS, segment_ids_BxL)  # noqa: E731

    if cfg.parallel_residual:
      x_BxLxD = x_BxLxD + drop(mix(ln1(x_BxLxD))) + drop(ffn(ln2(x_BxLxD)))
    elif cfg.norm_position == "pre":
      x_BxLxD = x_BxLxD + drop(mix(ln1(x_BxLxD)))
      x_BxLxD = x_BxLxD + drop(ffn(ln2(x_BxLxD)))
    else:  # post: the original Transformer / BERT
      x_BxLxD = ln1(x_BxLxD + drop(mix(x_BxLxD)))
      x_BxLxD = ln2(x_BxLxD + drop(ffn(x_BxLxD)))
    x_BxLxD = nn.with_logical_constraint(x_BxLxD, ("batch", "length", "embed"))
    if self.is_mutable_collection("intermediates"):
      self.sow("intermediates", "block_out", x_BxLxD)
    return x_BxLxD, None
