"""Shared pieces of the linen layer: dtypes, initialisers, norms, activations and the logical-axis
param helper."""
from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from tformer_jax import backends
from tformer_jax.config import ModelConfig


def dtypes(cfg: ModelConfig) -> tuple[jnp.dtype, jnp.dtype]:
  """(compute dtype, param dtype)."""
  return jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)


def normal(std: float) -> nn.initializers.Initializer:
  return nn.initializers.normal(stddev=std)


def residual_std(cfg: ModelConfig) -> float:
  """Std of residual output projections: GPT-2's init_std / sqrt(2 * num_layers) when enabled."""
  return cfg.init_std / math.sqrt(2 * cfg.num_layers) if cfg.scale_residual_init else cfg.init_std


def param(module: nn.Module, name: str, init, shape: tuple[int, ...], axes: tuple[str | None, ...],
          dtype: jnp.dtype) -> jax.Array:
  """A parameter carrying logical axis names only (mesh rules live in configs)."""
  return module.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)


class Norm(nn.Module):
  """LayerNorm or RMSNorm over the last axis, computed in float32, cast back to the input dtype."""
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.cfg
    _, pdt = dtypes(cfg)
    d = x.shape[-1]
    layernorm = cfg.norm == "layernorm"
    scale = param(self, "scale", nn.initializers.ones, (d,), ("norm",), pdt).astype(jnp.float32)
    bias = None
    if layernorm and cfg.norm_bias:
      bias = param(self, "bias", nn.initializers.zeros, (d,), ("norm",), pdt).astype(jnp.float32)
    # backend hook: the normalisation (the xla_cpu backend gives it a closed-form VJP)
    y = backends.current().norm(x.astype(jnp.float32), scale, bias, eps=cfg.norm_eps, center=layernorm)
    return y.astype(x.dtype)


def activation_fn(name: str):
  return {
      "gelu": lambda x: jax.nn.gelu(x, approximate=False),
      "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
      "relu": jax.nn.relu,
      "silu": jax.nn.silu,
      "swiglu": jax.nn.silu,
      "geglu": lambda x: jax.nn.gelu(x, approximate=False),
  }[name]
