"""LayerNorm and RMSNorm over the last axis: plain (`layer_norm`, `rms_norm`, ordinary autodiff) and
with hand-written backward passes (`norm_closed_form_vjp`, used by the xla_cpu backend).

The hand-written backward passes are the closed forms, from the saved normalised input xhat and 1/std:

  LayerNorm  dx = rstd * (g - mean(g) - xhat * mean(g * xhat)),   g = dy * scale
  RMSNorm    dx = rstd * (g - xhat * mean(g * xhat))
  dscale = sum(dy * xhat), dbias = sum(dy) (over every axis but the last)

instead of autodiff through mean and variance, which re-derives the centred input and walks the
variance's chain: more passes over the activations (LayerNorm: 1.1-1.4% of the gpt2_cpu train step
on CPU, docs/benchmarks.md). Compute in float32 (the caller casts); forward-mode AD (jax.jvp) is not
defined for custom VJPs, so the plain forms are the default.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

Array = jnp.ndarray


def _normalize(x: Array, eps: float, center: bool) -> tuple[Array, Array]:
  if center:
    x = x - jnp.mean(x, axis=-1, keepdims=True)
  rstd = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
  return x * rstd, rstd


def normalize(x: Array, scale: Array, bias: Array | None, eps: float, center: bool) -> Array:
  """LayerNorm (center=True) or RMSNorm (center=False, bias None) over the last axis."""
  xhat, _ = _normalize(x, eps, center)
  return xhat * scale if bias is None else xhat * scale + bias


def norm_closed_form_vjp(x: Array, scale: Array, bias: Array | None, eps: float, center: bool
                         ) -> Array:
  """`normalize` with the closed-form backward of the module docstring (same values and gradients)."""
  return _norm(x, scale, bias, float(eps), bool(center))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _norm(x: Array, scale: Array, bias: Array | None, eps: float, center: bool) -> Array:
  return normalize(x, scale, bias, eps, center)


def _norm_fwd(x, scale, bias, eps, center):
  xhat, rstd = _normalize(x, eps, center)
  y = xhat * scale if bias is None else xhat * scale + bias
  return y, (xhat, rstd, scale, bias is None)


def _norm_bwd(eps, center, res, dy):
  xhat, rstd, scale, no_bias = res
  g = dy * scale
  inner = g - xhat * jnp.mean(g * xhat, axis=-1, keepdims=True)
  if center:
    inner = inner - jnp.mean(g, axis=-1, keepdims=True)
  axes = tuple(range(dy.ndim - 1))
  dscale = jnp.sum(dy * xhat, axis=axes)
  return rstd * inner, dscale, None if no_bias else jnp.sum(dy, axis=axes)


_norm.defvjp(_norm_fwd, _norm_bwd)


def layer_norm(x_BxLxD: Array, scale_D: Array, bias_D: Array | None = None,
               eps: float = 1e-5) -> Array:
  """(x - mean) / sqrt(var + eps) * scale (+ bias), over the last axis."""
  return normalize(x_BxLxD, scale_D, bias_D, eps, True)


def rms_norm(x_BxLxD: Array, scale_D: Array, eps: float = 1e-6) -> Array:
  """x / sqrt(mean(x^2) + eps) * scale, over the last axis."""
  return normalize(x_BxLxD, scale_D, None, eps, False)
