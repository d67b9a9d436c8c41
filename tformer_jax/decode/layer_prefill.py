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

from tformer_jax.decode.cache import _cache_shapes, init_cache
from tformer_jax.decode.compiled import Lowered, _aot, _model_key, lower
from tformer_jax.decode.request import DecodeState, prompt_positions, start_state
from tformer_jax.nn.block import Block
from tformer_jax.nn.common import Norm, dtypes
from tformer_jax.ops.attention import soft_cap

_LAYER = "layers_"


def supported(cfg: Any) -> bool:
  """Unrolled layers of one kind (one compiled block serves them all), positions other than T5's."""
  return not cfg.scan_layers and cfg.position != "t5" and not cfg.layer_pattern


def _split(tree: dict) -> tuple[dict, list]:
  """(the top-level entries, [layer 0's, layer 1's, ...]) of an unrolled params or cache tree."""
  top = {k: v for k, v in tree.items() if not k.startswith(_LAYER)}
  return top, [tree[f"{_LAYER}{i}"] for i in range(len(tree) - len(top))]


def _embed_fn(model: nn.Module, slots: int) -> Callable:
  cfg = model.cfg
  bare = model.clone(cfg=dataclasses.replace(cfg, num_layers=0, final_norm=False, lm_head=False))
  dt = dtypes(cfg)[0]

  def embed(top_params, tokens_BxP, mask_BxP):
    top_cache = _split(init_cache(model, None, tokens_BxP.shape[0], slots))[0]   # fresh per request
    positions_BxP = prompt_positions(mask_BxP)
    # without a head the model returns its last hidden states in float32: here the embeddings (exact)
    x_BxPxD, upd = bare.apply({"params": top_params, "cache": top_cache}, tokens_BxP,
                              positions_BxL=positions_BxP, attention_mask_BxL=mask_BxP, decode=True,
                              mutable=["cache"])
    return x_BxPxD.astype(dt), upd["cache"], positions_BxP
  return embed


def _block_fn(model: nn.Module, slots: int, layer: int) -> Callable:
  block = Block(model.cfg, True, True, model.cfg.is_moe_layer(layer), model.cache_dtype)

  def run(layer_params, x_BxPxD, positions_BxP, kv_valid_BxS):
    cache = _split(init_cache(model, None, x_BxPxD.shape[0], slots))[1][layer]
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
    logits_BxV = soft_cap(jnp.einsum("bd,dv->bv", h_BxD, unembed_DxV).astype(jnp.float32), cfg.final_logit_softcap)
    return start_state(None, logits_BxV, tokens_BxP, mask_BxP, lengths_B, rng, cfg.vocab_size)
  return head


class LayerPrefill:
  """One request's prefill (its batch and cache slots) in pieces: lowered for compiling, or run."""

  def __init__(self, model: nn.Module, slots: int, tokens_BxP: Any, mask_BxP: Any, lengths_B: Any, rng: Any):
    self.model, self.slots = model, slots
    self.tokens, self.mask, self.lengths, self.rng = tokens_BxP, mask_BxP, lengths_B, rng
    self.key = (_model_key(model), tokens_BxP.shape[0], slots)

  def _embed(self, top_params: Any) -> tuple[str, Any, Callable, tuple[Any, ...]]:
    args = (top_params, self.tokens, self.mask)
    return "prefill_embed", self.key, _embed_fn(self.model, self.slots), args

  def _block(self, layer: int, layer_params: Any, x: Any, positions: Any, kv_valid: Any
             ) -> tuple[str, Any, Callable, tuple[Any, ...]]:
    """Layer `layer`'s call: one executable per kind of layer (dense, MoE), keyed by the kind."""
    args = (layer_params, x, positions, kv_valid)
    key = (*self.key, self.model.cfg.is_moe_layer(layer))
    return "prefill_block", key, _block_fn(self.model, self.slots, layer), args

  def _head(self, top_params: Any, x: Any) -> tuple[str, Any, Callable, tuple[Any, ...]]:
    args = (top_params, x, self.tokens, self.mask, self.lengths, self.rng)
    return "prefill_head", self.key, _head_fn(self.model), args

  def lower(self, params: Any) -> tuple[list[Lowered], DecodeState]:
    """(the pieces not compiled yet, lowered; the DecodeState this prefill returns, as shapes, to
    lower the step loop before anything runs). From shapes: nothing runs."""
    cfg = self.model.cfg
    top_params, layer_params = _split(params)
    embed = self._embed(top_params)
    x, top_cache, positions = jax.eval_shape(embed[2], *embed[3])
    head = self._head(top_params, x)
    first = {cfg.is_moe_layer(i): i for i in reversed(range(cfg.num_layers))}   # kind -> its first layer
    blocks = [self._block(i, layer_params[i], x, positions, top_cache["kv_valid"]) for i in first.values()]
    out = [lower(name, key, fn, *args) for name, key, fn, args in (embed, head, *blocks)]
    state = jax.eval_shape(head[2], *head[3])._replace(
        cache=_cache_shapes(self.model, self.tokens.shape[0], self.slots))
    return [p for p in out if p is not None], state

  def __call__(self, params: Any) -> DecodeState:
    top_params, layer_params = _split(params)
    name, key, fn, args = self._embed(top_params)
    x, top_cache, positions = _aot(name, key, fn, *args)(*args)
    caches = {}
    for i, one_layer in enumerate(layer_params):
      name, key, fn, args = self._block(i, one_layer, x, positions, top_cache["kv_valid"])
      x, caches[f"{_LAYER}{i}"] = _aot(name, key, fn, *args)(*args)
    name, key, fn, args = self._head(top_params, x)
    return _aot(name, key, fn, *args)(*args)._replace(cache={**top_cache, **caches})
