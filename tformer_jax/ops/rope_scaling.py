"""RoPE frequency scalings for longer contexts: linear (position interpolation), NTK-aware, dynamic NTK,
YaRN and Llama 3.

`rope_parameters` returns (inv_freq of shape (rot_dim/2,), attention_scaling); pass both to
`positions.apply_rope`. The arithmetic follows transformers' `ROPE_INIT_FUNCTIONS` step by step in float32
(inputs rounded to float32 as torch does, each operation rounded back to float32), so the frequencies
agree with transformers to a few ulps. All inputs are static Python numbers: this runs in numpy.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from tformer_jax.ops.positions import rope_inv_freq

Array = jnp.ndarray
SCALING_TYPES = ("none", "linear", "ntk", "dynamic", "yarn", "llama3")
_DEFAULTS = {"type": "none", "factor": 1.0, "original_max_len": 0, "low_freq_factor": 1.0,
             "high_freq_factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": 0.0, "truncate": True}
_f32 = np.float32


def _field(scaling: Any, name: str) -> Any:
  if isinstance(scaling, Mapping):
    value = scaling.get(name, scaling.get("rope_type") if name == "type" else None)
  else:
    value = getattr(scaling, name, None)
  return _DEFAULTS[name] if value is None else value


def _base_inv_freq(rot_dim: int, theta: float) -> np.ndarray:
  """float32 1 / theta^(2i/d), with the exponent rounded to float32 like `arange(...).float() / dim`."""
  exps = np.arange(0, rot_dim, 2, dtype=np.int64).astype(_f32) / _f32(rot_dim)
  pos = (np.float64(_f32(theta)) ** exps.astype(np.float64)).astype(_f32)
  return (_f32(1.0) / pos).astype(_f32)


def ntk_theta(theta: float, factor: float, rot_dim: int) -> float:
  """NTK-aware base: theta * factor^(d / (d - 2)), which stretches the lowest frequency by `factor`."""
  return theta * factor ** (rot_dim / (rot_dim - 2))


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
  """YaRN attention temperature 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
  return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(rot_dim: int, theta: float, factor: float, orig: int, beta_fast: float, beta_slow: float,
          attention_factor: float, truncate: bool = True) -> tuple[np.ndarray, float]:
  att = attention_factor if attention_factor else yarn_mscale(factor)

  def correction_dim(num_rotations: float) -> float:
    return (rot_dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

  low, high = correction_dim(beta_fast), correction_dim(beta_slow)
  if truncate:  # transformers' default; gpt-oss keeps the fractional range (truncate=False)
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, rot_dim - 1)
  if low == high:
    high += 0.001  # as transformers: avoid a zero-width ramp
  exps = np.arange(0, rot_dim, 2, dtype=np.int64).astype(_f32) / _f32(rot_dim)
  pos_freqs = (np.float64(_f32(theta)) ** exps.astype(np.float64)).astype(_f32)
  extrapolation = _f32(1.0) / pos_freqs
  interpolation = _f32(1.0) / (_f32(factor) * pos_freqs)
  ramp = np.clip((np.arange(rot_dim // 2, dtype=_f32) - low) / _f32(high - low), 0, 1).astype(_f32)
  extra_w = _f32(1.0) - ramp
  inv = interpolation * (_f32(1.0) - extra_w) + extrapolation * extra_w
  return inv.astype(_f32), float(att)


def _llama3(rot_dim: int, theta: float, factor: float, orig: int, low_ff: float,
            high_ff: float) -> np.ndarray:
  inv = _base_inv_freq(rot_dim, theta)
  low_wavelen, high_wavelen = orig / low_ff, orig / high_ff
  wavelen = (_f32(2 * math.pi) / inv).astype(_f32)
  inv_l = np.where(wavelen > low_wavelen, inv / _f32(factor), inv).astype(_f32)
  smooth = ((_f32(orig) / wavelen - _f32(low_ff)) / _f32(high_ff - low_ff)).astype(_f32)
  smoothed = (_f32(1.0) - smooth) * inv_l / _f32(factor) + smooth * inv_l
  medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
  return np.where(medium, smoothed, inv_l).astype(_f32)


def rope_parameters(rot_dim: int, theta: float, scaling: Any = None, *, max_len: int,
                    seq_len: int | None = None) -> tuple[Array, float]:
  """(inv_freq (rot_dim/2,), attention_scaling) for RoPE with an optional context-extension rule.

  scaling: None, or an object / mapping with the fields of `config.RopeScaling` (type, factor,
  original_max_len (0 = max_len), low/high_freq_factor, beta_fast/slow, attention_factor (0 = default),
  truncate (yarn: round the correction range outwards to whole dimensions; False keeps it fractional)).
    linear   inv_freq / factor (position interpolation)
    ntk      static NTK-aware base theta * factor^(d/(d-2))
    dynamic  transformers' dynamic NTK: base grows with seq_len beyond original_max_len (plain below)
    yarn     NTK-by-parts ramp between interpolation and extrapolation, temperature 0.1 ln(s) + 1
    llama3   Llama 3.1 wavelength-banded interpolation
  """
  if rot_dim <= 0 or rot_dim % 2:
    raise ValueError(f"rot_dim must be a positive even number, got {rot_dim}")
  kind = "none" if scaling is None else str(_field(scaling, "type"))
  if kind == "default":
    kind = "none"
  if kind not in SCALING_TYPES:
    raise ValueError(f"unknown rope scaling type {kind!r}; expected one of {SCALING_TYPES}")
  if kind == "none":
    return rope_inv_freq(rot_dim, theta), 1.0
  factor = float(_field(scaling, "factor"))
  if factor <= 0:
    raise ValueError(f"rope scaling factor must be > 0, got {factor}")
  orig = int(_field(scaling, "original_max_len")) or int(max_len)
  att = 1.0
  if kind == "linear":
    inv = (_base_inv_freq(rot_dim, theta) / _f32(factor)).astype(_f32)
  elif kind == "ntk":
    inv = _base_inv_freq(rot_dim, ntk_theta(theta, factor, rot_dim))
  elif kind == "dynamic":
    seq = orig if seq_len is None else max(int(seq_len), orig)
    base = theta * ((factor * seq / orig) - (factor - 1)) ** (rot_dim / (rot_dim - 2))
    inv = _base_inv_freq(rot_dim, base)
  elif kind == "yarn":
    inv, att = _yarn(rot_dim, theta, factor, orig, float(_field(scaling, "beta_fast")),
                     float(_field(scaling, "beta_slow")), float(_field(scaling, "attention_factor")),
                     bool(_field(scaling, "truncate")))
  else:  # llama3
    low_ff, high_ff = float(_field(scaling, "low_freq_factor")), float(_field(scaling, "high_freq_factor"))
    if high_ff <= low_ff:
      raise ValueError(f"llama3 rope needs high_freq_factor > low_freq_factor, got {high_ff}, {low_ff}")
    inv = _llama3(rot_dim, theta, factor, orig, low_ff, high_ff)
  return jnp.asarray(inv, jnp.float32), float(att)
