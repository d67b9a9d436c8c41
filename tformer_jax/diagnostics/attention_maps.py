"""Attention maps: per-layer weights (B, H, L, S), per-head entropy, and collapse/blur flags.

The weights come from the model's own Attention modules: the model is applied under the reference
backend (`backends.Backend()`: the dense attention, the only path that materialises weights) with
the 'intermediates' collection mutable, so each Attention sows 'attention_weights'. Training code
is untouched: without a mutable 'intermediates' collection nothing is sown.

Flags follow the articles' troubleshooting tables:
  collapse  the weight piles onto one key: mean over queries of the row max > 0.9 (scale missing or
            init too large, softmax saturated).
  blur      the weights are nearly uniform: entropy >= 0.95 x the entropy of a uniform spread over
            the keys each query can see (softmax not separating: scale/temperature, or untrained).
Queries that can see a single key (the first token of a causal model) carry no information and are
left out of both statistics.
"""
from __future__ import annotations

import contextlib
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tformer_jax import backends
from tformer_jax.nn.attention import visibility
from tformer_jax.nn.transformer import sown_per_layer
from tformer_jax.ops.attention import head_statistics

COLLAPSE_MAX_WEIGHT = 0.9
BLUR_ENTROPY_RATIO = 0.95


def weights_backend() -> contextlib.AbstractContextManager:
  """Trace the model inside this block to read attention weights: the reference backend."""
  return backends.use(backends.Backend())


def sown(model: nn.Module, params: Any, tokens_BxL: jax.Array, name: str, **apply_kwargs: Any
         ) -> tuple[jax.Array, list[jax.Array]]:
  """(model output, the per-layer values sown under `name` in 'intermediates')."""
  out, mut = model.apply({"params": params}, tokens_BxL, mutable=["intermediates"], **apply_kwargs)
  return out, sown_per_layer(mut.get("intermediates", {}), name)


def attention_weights(model: nn.Module, params: Any, tokens_BxL: jax.Array, **apply_kwargs: Any
                      ) -> list[jax.Array]:
  """Attention weights of every layer: a list of (B, H, L, S) float32 arrays (pure; jit-able).

  apply_kwargs go to `Transformer.__call__` (attention_mask_BxL, positions_BxL, ...). The model is
  run under the reference backend; its parameters are the same whatever the backend.
  """
  with weights_backend():
    _, weights = sown(model, nn.unbox(params), tokens_BxL, "attention_weights", **apply_kwargs)
  if not weights:
    raise ValueError("no attention weights were sown: is this a tformer_jax Transformer?")
  return weights


def visible_keys(cfg: Any, attention_mask_BxL: jax.Array | None, b: int, l: int) -> jax.Array:
  """(B, L, L) bool: which keys each query may attend to (causality, window, padding)."""
  valid_BxL = jnp.ones((b, l), bool) if attention_mask_BxL is None else attention_mask_BxL.astype(bool)
  vis = jnp.broadcast_to(valid_BxL[:, None, :], (b, l, l))
  structural = visibility(cfg).structural(l, l)
  if structural is not None:
    vis = vis & structural[None]
  return vis & valid_BxL[:, :, None]   # padding queries are not analysed


def summarize(weights: list[jax.Array], visible_BxLxS: jax.Array) -> list[dict[str, Any]]:
  """One row per (layer, head): entropy, uniform entropy, ratio, mean max weight, collapse, blur."""
  rows = []
  for layer, w in enumerate(weights):
    st = {k: np.asarray(v) for k, v in head_statistics(w, visible_BxLxS).items()}
    for h in range(w.shape[1]):
      ratio, mx = float(st["entropy_ratio"][h]), float(st["max_weight"][h])
      rows.append({"layer": layer, "head": h, "entropy": float(st["entropy"][h]),
                   "uniform_entropy": float(st["uniform_entropy"][h]), "entropy_ratio": ratio,
                   "max_weight": mx, "collapse": mx > COLLAPSE_MAX_WEIGHT,
                   "blur": ratio >= BLUR_ENTROPY_RATIO})
  return rows


def analyze(model: nn.Module, params: Any, tokens_BxL: Any, attention_mask_BxL: Any = None
            ) -> tuple[list[np.ndarray], list[dict[str, Any]]]:
  """(per-layer weights as numpy (B, H, L, S), per-head summary rows) for one batch of tokens."""
  tokens_BxL = jnp.asarray(tokens_BxL, jnp.int32)
  kw = {} if attention_mask_BxL is None else {"attention_mask_BxL": jnp.asarray(attention_mask_BxL)}
  weights = jax.jit(lambda p, t, k: attention_weights(model, p, t, **k))(nn.unbox(params), tokens_BxL, kw)
  b, l = tokens_BxL.shape
  vis = visible_keys(model.cfg, kw.get("attention_mask_BxL"), b, l)
  return [np.asarray(w) for w in weights], summarize(weights, vis)


def format_table(rows: list[dict[str, Any]]) -> str:
  """A fixed-width text table of `summarize` rows."""
  head = f"{'layer':>5} {'head':>4} {'entropy':>8} {'uniform':>8} {'ratio':>6} {'max_w':>6}  flags"
  lines = [head, "-" * len(head)]
  for r in rows:
    flags = ",".join(f for f in ("collapse", "blur") if r[f]) or "-"
    lines.append(f"{r['layer']:>5} {r['head']:>4} {r['entropy']:>8.3f} {r['uniform_entropy']:>8.3f} "
                 f"{r['entropy_ratio']:>6.3f} {r['max_weight']:>6.3f}  {flags}")
  return "\n".join(lines)
