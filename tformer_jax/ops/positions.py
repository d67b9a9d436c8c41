"""Position schemes as pure functions: sinusoidal, RoPE, ALiBi. (Learned positions live in the model;
RoPE scalings in `rope_scaling.py`; T5 buckets in `relative_bias.py`.)"""
from __future__ import annotations

import math
from typing import Literal

import jax.numpy as jnp
import numpy as np

Array = jnp.ndarray
RopeLayout = Literal["half", "interleaved"]


def sinusoidal_table(max_len: int, d_model: int, *, base: float = 10000.0) -> Array:
  """(max_len, d_model): PE[p, 2i] = sin(p / base^(2i/d)), PE[p, 2i+1] = cos(same)."""
  if d_model % 2:
    raise ValueError(f"sinusoidal positions need an even d_model, got {d_model}")
  pos = np.arange(max_len, dtype=np.float64)[:, None]
  inv = base ** (-np.arange(0, d_model, 2, dtype=np.float64) / d_model)
  table = np.zeros((max_len, d_model), dtype=np.float32)
  table[:, 0::2] = np.sin(pos * inv)
  table[:, 1::2] = np.cos(pos * inv)
  return jnp.asarray(table)


def sinusoidal_at(positions_BxL: Array, d_model: int, *, base: float = 10000.0) -> Array:
  """(B, L, d_model) sinusoidal encodings computed at arbitrary (traced) positions."""
  inv = base ** (-jnp.arange(0, d_model, 2, dtype=jnp.float32) / d_model)
  ang = positions_BxL.astype(jnp.float32)[..., None] * inv
  return jnp.stack([jnp.sin(ang), jnp.cos(ang)], axis=-1).reshape(*positions_BxL.shape, d_model)


def rotary_dim(head_dim: int, rotary_fraction: float = 1.0) -> int:
  """Number of leading channels per head that RoPE rotates (even)."""
  rd = int(head_dim * rotary_fraction)
  return rd - (rd % 2)


def rope_inv_freq(rot_dim: int, theta: float = 10000.0) -> Array:
  """(rot_dim/2,) inverse frequencies theta^(-2i/rot_dim)."""
  return 1.0 / (theta ** (jnp.arange(0, rot_dim, 2, dtype=jnp.float32) / rot_dim))


def apply_rope(x_BxLxHxD: Array, positions_BxL: Array, inv_freq: Array, *, layout: RopeLayout = "half",
               attention_scaling: float = 1.0) -> Array:
  """Rotate the first 2*len(inv_freq) channels of each head by angle position * inv_freq.

  layout 'half' (Llama/NeoX): pairs (i, i + r/2). 'interleaved' (GPT-J, the article's code): pairs
  (2i, 2i+1). `attention_scaling` multiplies cos/sin (YaRN's temperature). Computed in float32.
  """
  rot = 2 * inv_freq.shape[0]
  dtype = x_BxLxHxD.dtype
  x = x_BxLxHxD.astype(jnp.float32)
  x_rot, x_pass = x[..., :rot], x[..., rot:]
  ang_BxLxR2 = positions_BxL.astype(jnp.float32)[..., None] * inv_freq.astype(jnp.float32)
  cos = (jnp.cos(ang_BxLxR2) * attention_scaling)[:, :, None, :]
  sin = (jnp.sin(ang_BxLxR2) * attention_scaling)[:, :, None, :]
  if layout == "half":
    x1, x2 = x_rot[..., : rot // 2], x_rot[..., rot // 2:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  elif layout == "interleaved":
    x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
    out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(x_rot.shape)
  else:
    raise ValueError(f"unknown rope layout {layout!r}; expected 'half' or 'interleaved'")
  return jnp.concatenate([out, x_pass], axis=-1).astype(dtype)


def alibi_slopes(num_heads: int) -> Array:
  """ALiBi head slopes (Press et al.): geometric 2^(-8/n * (i+1)) for a power of two n; otherwise the
  closest lower power of two, then every other slope of the doubled set (the paper's rule)."""
  def pow2(n: int) -> list[float]:
    start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
    return [start * start ** i for i in range(n)]

  if math.log2(num_heads).is_integer():
    slopes = pow2(num_heads)
  else:
    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = pow2(closest) + pow2(2 * closest)[0::2][: num_heads - closest]
  return jnp.asarray(slopes, dtype=jnp.float32)


def alibi_bias(slopes_H: Array, q_pos_BxL: Array, k_pos_BxS: Array, *, causal: bool = True) -> Array:
  """(B, H, L, S) additive bias -slope * distance. Causal: distance = q - k (masked keys irrelevant);
  bidirectional: |q - k|."""
  dist = q_pos_BxL[:, None, :, None] - k_pos_BxS[:, None, None, :]
  dist = dist if causal else jnp.abs(dist)
  return -slopes_H[None, :, None, None] * dist.astype(jnp.float32)
