"""Shared pieces of the linen layer: dtypes, initialisers, norms, activations, the logical-axis
param helper and the projection (with its optional low-rank adapter)."""
from __future__ import annotations

import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp

from tformer_jax import backends
from tformer_jax.config import ModelConfig
from tformer_jax.ops import lora as lora_ops


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


LORA = "lora"   # the variable collection of unmerged low-rank adapters (ops/lora.py), when a step passes one


def project(module: nn.Module, name: str, spec: str, x: jax.Array, w: jax.Array, n_in: int) -> jax.Array:
  """The projection einsum `spec` ('X,W->Y') of x by the kernel `name` (w, already in x's dtype), plus
  its low-rank adapter when the 'lora' collection holds one for that kernel (LoRA, Hu et al. 2021:
  h = x W + (x A) B, W frozen; B arrives already scaled by alpha / rank, see train/step.py). The
  kernel's first n_in letters are its inputs: A (inputs..., r), B (r, outputs...). Without adapters
  (every call but a LoRA train step) this is the backend's dense alone; the adapter's two products are
  the backend's dense too."""
  dense = backends.current().dense   # backend hook: the einsum (xla_cpu: a hand-written VJP)
  y = dense(spec, x, w)
  if not module.has_variable(LORA, name):
    return y
  adapter = module.get_variable(LORA, name)
  x_spec, w_spec, y_spec = re.split(",|->", spec)
  w_in, w_out = w_spec[:n_in], w_spec[n_in:]
  keep = "".join(c for c in x_spec if c not in w_in)
  xa = dense(f"{x_spec},{w_in}r->{keep}r", x, adapter[lora_ops.A].astype(x.dtype))
  return y + dense(f"{keep}r,r{w_out}->{y_spec}", xa, adapter[lora_ops.B].astype(x.dtype))


class Norm(nn.Module):
  """LayerNorm or RMSNorm over the last axis, computed in float32, cast back to the input dtype. With
  cfg.norm_unit_offset the stored scale w starts at 0 and multiplies as (1 + w) (Gemma)."""
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.cfg
    _, pdt = dtypes(cfg)
    d = x.shape[-1]
    layernorm = cfg.norm == "layernorm"
    init = nn.initializers.zeros if cfg.norm_unit_offset else nn.initializers.ones
    scale = param(self, "scale", init, (d,), ("norm",), pdt).astype(jnp.float32)
    if cfg.norm_unit_offset:
      scale = 1.0 + scale
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
      "geglu_tanh": lambda x: jax.nn.gelu(x, approximate=True),   # Gemma's gelu_pytorch_tanh GLU
  }[name]
