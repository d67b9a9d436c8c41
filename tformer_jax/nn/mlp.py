"""The position-wise FFN: W_out act(W_in x), or the GLU form W_out (act(W_gate x) * W_up x)."""
from __future__ import annotations

import flax.linen as nn
import jax
from jax.ad_checkpoint import checkpoint_name

from tformer_jax import backends
from tformer_jax.config import GLU_ACTIVATIONS, ModelConfig
from tformer_jax.nn.common import activation_fn, dtypes, normal, param, project, residual_std


class MLP(nn.Module):
  """`deterministic` is taken like Attention's and MoEFFN's, so a block calls every sublayer one way;
  the dense FFN has no dropout of its own (the block's residual dropout follows it)."""
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BxLxD: jax.Array, *, deterministic: bool = True) -> jax.Array:
    del deterministic
    cfg = self.cfg
    dt, pdt = dtypes(cfg)
    d, f = x_BxLxD.shape[-1], cfg.ff
    x = x_BxLxD.astype(dt)
    w_in = param(self, "wi", normal(cfg.init_std), (d, f), ("embed", "mlp"), pdt)
    # the projection einsums: nn.common.project (checkpoint_name: names a remat policy can keep)
    h_BxLxF = checkpoint_name(project(self, "wi", "bld,df->blf", x, w_in.astype(dt), 1), "mlp_in")
    if cfg.mlp_bias:
      h_BxLxF += param(self, "bi", nn.initializers.zeros, (f,), ("mlp",), pdt).astype(dt)
    act = activation_fn(cfg.activation)
    if cfg.activation in GLU_ACTIVATIONS:
      w_gate = param(self, "wg", normal(cfg.init_std), (d, f), ("embed", "mlp"), pdt)
      g_BxLxF = checkpoint_name(project(self, "wg", "bld,df->blf", x, w_gate.astype(dt), 1), "mlp_gate")
      if cfg.mlp_bias:
        g_BxLxF += param(self, "bg", nn.initializers.zeros, (f,), ("mlp",), pdt).astype(dt)
      h_BxLxF = backends.current().glu(cfg.activation, act, g_BxLxF, h_BxLxF)   # act(g) * h
    else:
      h_BxLxF = act(h_BxLxF)
    h_BxLxF = nn.with_logical_constraint(h_BxLxF, ("batch", "length", "mlp"))
    w_out = param(self, "wo", normal(residual_std(cfg)), (f, d), ("mlp", "embed"), pdt)
    y_BxLxD = project(self, "wo", "blf,fd->bld", h_BxLxF, w_out.astype(dt), 1)
    if cfg.mlp_bias:
      y_BxLxD += param(self, "bo", nn.initializers.zeros, (d,), ("embed",), pdt).astype(dt)
    return y_BxLxD
