"""The prefill of an unrolled stack run one layer at a time from the host.

Compiling the unrolled prefill as one program compiles num_layers copies of the same block; here one
compiled block serves every layer (called with that layer's params, it fills that layer's cache), so
the prefill compiles about as fast as a scanned one, without a scan's weight slicing. A prefill runs
once per request, so its num_layers + 2 dispatches cost nothing measurable; the step loop stays one
compiled program.

Three pieces, each compiled once per shapes (`compiled`):
- `embed`: the model without blocks, final norm or head: positions, the cache's 'index' and
  'kv_valid' (the slots this call fills), the input embeddings;
- `block`: one `nn.Block` on a layer's params, filling that layer's fresh cache;
- `head`: the final norm, the last position's logits and the `DecodeState` the step loop starts from.
`supported(cfg)` says when it applies: unrolled layers, positions other than T5's relative bias (a
bias computed once for all layers); otherwise the whole-model prefill runs.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tformer_jax.decode.cache import _cache_shapes
from tformer_jax.decode.compiled import Lowered, _aot, _model_key, lower
from tformer_jax.decode.request import DecodeState
from tformer_jax.nn.block import Block
from tformer_jax.nn.common import Norm, dtypes
from tformer_jax.ops import sampling

_LAYER = "layers_"


def supported(cfg: Any) -> bool:
  return not cfg.scan_layers and cfg.position != "t5"


def _split(tree: dict) -> tuple[dict, list]:
  """(the top-level entries, [layer 0's, layer 1's, ...]) of an unrolled params or cache tree."""
  top = {k: v for k, v in tree.items() if not k.startswith(_LAYER)}
  return top, [tree[f"{_LAYER}{i}"] for i in range(len(tree) - len(top))]


def _zeros(shapes: Any) -> Any:
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def _embed_fn(model: nn.Module, slots: int) -> Callable:
  cfg = model.cfg
  bare = model.clone(cfg=dataclasses.replace(cfg, num_layers=0, final_norm=False, lm_head=False))
  dt = dtypes(cfg)[0]

  def embed(top_params, tokens_BxP, mask_BxP, positions_BxP):
    top_cache = _zeros(_split(_cache_shapes(model, tokens_BxP.shape[0], slots))[0])   # fresh per request
    # without a head the model returns its last hidden states in float32: here the embeddings (exact)
    x_BxPxD, upd = bare.apply({"params": top_params, "cache": top_cache}, tokens_BxP,
                              positions_BxL=positions_BxP, attention_mask_BxL=mask_BxP, decode=True,
                              mutable=["cache"])
    return x_BxPxD.astype(dt), upd["cache"]
  return embed


def _block_fn(model: nn.Module, slots: int, use_moe: bool) -> Callable:
  block = Block(model.cfg, True, True, use_moe, model.cache_dtype)
  layer = next(i for i in range(model.cfg.num_layers) if model.cfg.is_moe_layer(i) == use_moe)

  def run(layer_params, x_BxPxD, positions_BxP, kv_valid_BxS):
    cache = _zeros(_split(_cache_shapes(model, x_BxPxD.shape[0], slots))[1][layer])
    q_offset = jnp.zeros((), jnp.int32)   # a prefill fills the cache from slot 0
    (x_BxPxD, _), upd = block.apply({"params": layer_params, "cache": cache}, x_BxPxD, positions_BxP,
                                    kv_valid_BxS, q_offset, None, mutable=["cache"])
    return x_BxPxD, upd["cache"]
  return run


def _head_fn(model: nn.Module) -> Callable:
  cfg = model.cfg
  dt = dtypes(cfg)[0]

  def head(top_params, x_BxPxD, tokens_BxP, mask_BxP, lengths_B, rng):
    h_BxD = x_BxPxD[:, -1]   # only the last position's logits are needed
    if cfg.final_norm:
      h_BxD = Norm(cfg).apply({"params": top_params["final_norm"]}, h_BxD)
    # the unembedding as nn.Transformer computes it: the head, or the embedding transposed when tied
    unembed_DxV = (top_params["embed"].astype(dt).T if cfg.tie_embeddings else top_params["head"].astype(dt))
    logits_BxV = jnp.einsum("bd,dv->bv", h_BxD, unembed_DxV).astype(jnp.float32)
    b = tokens_BxP.shape[0]
    return DecodeState(cache=None, logits_BxV=logits_BxV,
                       seen_BxV=sampling.seen_mask(jnp.where(mask_BxP, tokens_BxP, -1), cfg.vocab_size),
                       pos_B=lengths_B, done_B=jnp.zeros((b,), bool), lengths_B=jnp.zeros((b,), jnp.int32),
                       step=jnp.zeros((), jnp.int32), rng=rng)
  return head


class LayerPrefill:
  """One request's prefill (its batch and cache slots) in pieces: lowered for compiling, or run."""

  def __init__(self, model: nn.Module, slots: int, tokens_BxP: Any, mask_BxP: Any, lengths_B: Any, rng: Any):
    self.model, self.slots = model, slots
    self.tokens, self.mask, self.lengths, self.rng = tokens_BxP, mask_BxP, lengths_B, rng
    self.positions = np.maximum(np.cumsum(mask_BxP, axis=1) - 1, 0).astype(np.int32)
    self.key = (_model_key(model), tokens_BxP.shape[0], slots)

  def _kinds(self) -> list[bool]:
    cfg = self.model.cfg
    return sorted({cfg.is_moe_layer(i) for i in range(cfg.num_layers)})

  def _embed(self, top_params: Any) -> tuple[str, Any, Callable, tuple[Any, ...]]:
    args = (top_params, self.tokens, self.mask, self.positions)
    return "prefill_embed", self.key, _embed_fn(self.model, self.slots), args

  def _block(self, use_moe: bool, layer_params: Any, x: Any, kv_valid: Any) -> tuple[str, Any, Callable, tuple]:
    args = (layer_params, x, self.positions, kv_valid)
    return "prefill_block", (*self.key, use_moe), _block_fn(self.model, self.slots, use_moe), args

  def _head(self, top_params: Any, x: Any) -> tuple[str, Any, Callable, tuple[Any, ...]]:
    args = (top_params, x, self.tokens, self.mask, self.lengths, self.rng)
    return "prefill_head", self.key, _head_fn(self.model), args

  def lower(self, params: Any) -> list[Lowered]:
    """The pieces not compiled yet, lowered (from shapes: nothing runs)."""
    cfg = self.model.cfg
    top_params, layer_params = _split(params)
    embed = self._embed(top_params)
    x, top_cache = jax.eval_shape(embed[2], *embed[3])
    pieces = [embed, self._head(top_params, x)]
    for moe in self._kinds():
      i = next(i for i in range(cfg.num_layers) if cfg.is_moe_layer(i) == moe)
      pieces.append(self._block(moe, layer_params[i], x, top_cache["kv_valid"]))
    out = [lower(name, key, fn, *args) for name, key, fn, args in pieces]
    return [p for p in out if p is not None]

  def state_shapes(self, params: Any) -> DecodeState:
    """The DecodeState this prefill returns, as shapes (to lower the step loop before it runs)."""
    top_params, _ = _split(params)
    embed = self._embed(top_params)
    x, _ = jax.eval_shape(embed[2], *embed[3])
    _, _, fn, args = self._head(top_params, x)
    shapes = _cache_shapes(self.model, self.tokens.shape[0], self.slots)
    return jax.eval_shape(fn, *args)._replace(cache=shapes)

  def __call__(self, params: Any) -> DecodeState:
    cfg = self.model.cfg
    top_params, layer_params = _split(params)
    name, key, fn, args = self._embed(top_params)
    x, top_cache = _aot(name, key, fn, *args)(*args)
    caches = {}
    for i in range(cfg.num_layers):
      name, key, fn, args = self._block(cfg.is_moe_layer(i), layer_params[i], x, top_cache["kv_valid"])
      x, caches[f"{_LAYER}{i}"] = _aot(name, key, fn, *args)(*args)
    name, key, fn, args = self._head(top_params, x)
    return _aot(name, key, fn, *args)(*args)._replace(cache={**top_cache, **caches})
