"""Planted faults: the articles' classic bugs, as drop-in replacements for the pieces the doctor's
checks take as arguments. Used by the tests (each must be caught) and by `--plant` on the CLI.

  scale_1_over_d        config: model.attention_scale = 1/head_dim instead of 1/sqrt(head_dim)
  inverted_mask         attention fn that attends where the mask says not to
  zero_mask_value       attention fn that fills masked scores with 0 instead of a large negative
  softmax_over_queries  attention fn normalising over the query axis (rows do not sum to 1)
  zero_pos_embed        params with the learned position table zeroed (positions carry nothing)
  positions_not_added   apply fn that feeds position 0 everywhere (the table is never indexed)
  labels_not_shifted    batch fn with targets == inputs
  init_std_1            config: model.init_std = 1.0
  no_warmup_big_lr      config: optim.warmup_steps = 0, optim.peak_lr = 1e-2
"""
from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

from tformer_jax.doctor import checks
from tformer_jax.ops import attention as attn_ops, positions as pos_ops
from tformer_jax.ops.masks import Visibility

# The attention faults have the signature of `backends.Backend.attention` (the doctor's probes run
# them as the backend's attention): (q, k, v, vis, *, bias_BxHxLxS, alibi_slopes_H, scale,
# dropout_rate, dropout_rng, want_weights) -> (out_BxLxHxD, weights_BxHxLxS or None).


def _mask_and_bias(q_BxLxHxD, k_BxSxKxD, vis: Visibility, bias_BxHxLxS=None, alibi_slopes_H=None):
  """The visibility as a dense mask (B|1, 1, L, S) or None, and the additive bias with ALiBi."""
  l, s = q_BxLxHxD.shape[1], k_BxSxKxD.shape[1]
  bias = bias_BxHxLxS
  if alibi_slopes_H is not None:
    q_idx = vis.q_offset + jnp.arange(l)
    alibi = pos_ops.alibi_bias(alibi_slopes_H, q_idx[None], jnp.arange(s)[None], causal=vis.causal)
    bias = alibi if bias is None else bias + alibi
  return vis.mask(l, s), bias


def _dense_attention(q_BxLxHxD, k_BxSxKxD, v_BxSxKxD, vis: Visibility, *, mask_value: float,
                     softmax_axis: int = -1, bias_BxHxLxS=None, alibi_slopes_H=None, scale=None,
                     want_weights: bool = False, **_):
  """Plain softmax attention with a configurable fill value and softmax axis (for planting)."""
  mask, bias = _mask_and_bias(q_BxLxHxD, k_BxSxKxD, vis, bias_BxHxLxS, alibi_slopes_H)
  h, kh, d = q_BxLxHxD.shape[2], k_BxSxKxD.shape[2], q_BxLxHxD.shape[-1]
  k = jnp.repeat(k_BxSxKxD, h // kh, axis=2)
  v = jnp.repeat(v_BxSxKxD, h // kh, axis=2)
  scale = 1.0 / math.sqrt(d) if scale is None else scale
  logits = jnp.einsum("blhd,bshd->bhls", q_BxLxHxD, k).astype(jnp.float32) * scale
  if bias is not None:
    logits = logits + bias
  if mask is not None:
    logits = jnp.where(mask, logits, mask_value)
  w = jax.nn.softmax(logits, axis=softmax_axis)
  out = jnp.einsum("bhls,bshd->blhd", w.astype(v.dtype), v)
  return out, (w if want_weights else None)


def inverted_mask(q, k, v, vis: Visibility, *, bias_BxHxLxS=None, alibi_slopes_H=None, scale=None,
                  want_weights: bool = False, **_):
  """The mask's direction flipped: True (attend) and False (hide) swapped (the real softmax)."""
  mask, bias = _mask_and_bias(q, k, vis, bias_BxHxLxS, alibi_slopes_H)
  out, w = attn_ops.dot_product_attention(q, k, v, mask=None if mask is None else ~mask, bias=bias,
                                          scale=scale, return_weights=True)
  return out, (w if want_weights else None)


def zero_mask_value(q, k, v, vis: Visibility, **kw):
  """Masked scores set to 0 (not -1e9): padding and future keys keep exp(0) weight."""
  return _dense_attention(q, k, v, vis, mask_value=0.0, **kw)


def softmax_over_queries(q, k, v, vis: Visibility, **kw):
  """Softmax over the wrong axis (queries): weight rows do not sum to 1."""
  return _dense_attention(q, k, v, vis, mask_value=-1e9, softmax_axis=-2, **kw)


def zero_pos_embed(params: Any) -> Any:
  """The learned position table zeroed: the model sees no order at all."""
  params = dict(params)
  params["pos_embed"] = jnp.zeros_like(params["pos_embed"])
  return params


def positions_not_added(model, params, tokens, **kw):
  """An apply fn that always passes position 0: the table is never indexed past row 0."""
  kw.setdefault("positions_BxL", jnp.zeros(tokens.shape, jnp.int32))
  return model.apply({"params": params}, tokens, **kw)


def labels_not_shifted(batch_fn: Callable[[], dict]) -> Callable[[], dict]:
  """A batch fn whose targets are the inputs themselves (not shifted by one)."""
  def fn():
    b = dict(batch_fn())
    b["targets"] = b["inputs"].copy()
    return b
  return fn


ATTENTION_FAULTS = {"inverted_mask": inverted_mask, "zero_mask_value": zero_mask_value,
                    "softmax_over_queries": softmax_over_queries}
CONFIG_FAULTS = {
    "scale_1_over_d": lambda m: {"model.attention_scale": 1.0 / m.hd},
    "init_std_1": lambda m: {"model.init_std": 1.0},
    "no_warmup_big_lr": lambda m: {"optim.warmup_steps": 0, "optim.warmup_fraction": 0.0, "optim.peak_lr": 1e-2},
}
OTHER_FAULTS = ("zero_pos_embed", "positions_not_added", "labels_not_shifted")
ALL = tuple(ATTENTION_FAULTS) + tuple(CONFIG_FAULTS) + OTHER_FAULTS


def plant(fault: str, ctx: Any) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
  """(config overrides, per-check injected arguments) that plant `fault` into the checks of `ctx`
  (doctor/checks.py `make_context`)."""
  if fault in CONFIG_FAULTS:
    return CONFIG_FAULTS[fault](ctx.m), {}
  if fault in ATTENTION_FAULTS:
    fn = ATTENTION_FAULTS[fault]
    return {}, {k: {"attention_fn": fn} for k in ("scale", "padding", "causal", "rows")}
  if fault == "zero_pos_embed":
    return {}, {"order": {"params": zero_pos_embed(ctx.params)}}
  if fault == "positions_not_added":
    fn = positions_not_added
    return {}, {"order": {"apply_fn": fn}, "causal": {"apply_fn": fn}}
  if fault == "labels_not_shifted":
    bad = labels_not_shifted(checks.default_batch_fn(ctx.cfg))
    return {}, {"data": {"batch_fn": bad}, "overfit": {"batch_fn": bad}}
  raise ValueError(f"unknown fault {fault!r}; known: {', '.join(ALL)}")
