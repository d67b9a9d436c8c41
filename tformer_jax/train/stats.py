"""Training-time statistics, cheap enough to leave on (cfg.train.stats_every > 0).

`make_stats_fn(model, tx)` returns a pure, jit-able `fn(state_or_params, batch, grads=None,
prev_params=None) -> {name: float32 scalar}` with
  act_mean|act_std|act_rms/layer_<i>   of each block's output (the residual stream, 'block_out')
  attn_entropy/layer_<i>               mean attention entropy over heads and queries (nats), and
  attn_entropy_ratio/layer_<i>         the same over log(#visible keys): 1 = uniform ("blurred")
  attn_max_weight/layer_<i>            mean row max (-> 1 = collapsed onto one key)
  grad_norm/<module>                   gradient norm per module (embed, pos_embed, layers_<i>/attn,
                                       layers_<i>/mlp, layers_<i>/ln1, final_norm, ...)
  update_ratio/<module>                ||update|| / ||param||: the optimizer update `tx` would apply
                                       now (or params - prev_params, over ||prev_params||, when given)
  grad_norm, update_ratio, loss        whole-model values
  lora/grad_norm                       a LoRA run: the adapters' gradient norm (every other value is
                                       the merged model's, W + (alpha / rank) A @ B: `lora_stats`)
  pos_embed_grad_norm, pos_embed_grad_ratio   the learned position table's gradient norm and its ratio
                                       to the token embedding's (the second article's check that
                                       positions are used: a ratio stuck near 0 means they are not)
One forward+backward on the given batch (no dropout), under the reference backend so the attention
weights can be read: every `stats_every` steps this costs about one step.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from tformer_jax import backends
from tformer_jax.nn.attention import visibility
from tformer_jax.nn.stacking import cycle_of, dense_of
from tformer_jax.nn.transformer import sown_per_layer
from tformer_jax.ops import lora as lora_ops
from tformer_jax.ops.attention import head_statistics


def module_name(path: tuple) -> tuple[str, bool]:
  """(module name, scanned) for a parameter path. Scanned stacks (scan_layers, leading
  (num_layers,) axis) give a template 'layers_{}/<sub>' filled in per layer."""
  keys = [str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)]
  if not keys:
    return "params", False
  if keys[0] == "layers" and len(keys) > 2 and keys[1].startswith("block_"):   # a layer_pattern's cycle
    return "layers_{}/" + keys[2], True
  if keys[0] in ("layers", "dense_layers") and len(keys) > 1:   # (an MoE model's dense first layers)
    return "layers_{}/" + keys[1], True
  if keys[0].startswith("layers_") and len(keys) > 1:
    return f"{keys[0]}/{keys[1]}", False
  return keys[0], False


def group_sq_norms(tree: Any) -> dict[str, jax.Array]:
  """Squared L2 norm per module (see `module_name`), float32; scanned stacks split per layer."""
  out: dict[str, jax.Array] = {}
  tree = nn.unbox(tree)
  cycle, dense = cycle_of(tree), dense_of(tree)
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    x = jnp.asarray(x, jnp.float32)
    name, scanned = module_name(path)
    if not scanned:
      out[name] = out.get(name, 0.0) + jnp.sum(x * x)
      continue
    block = next((int(str(k.key)[6:]) for k in path if str(getattr(k, "key", "")).startswith("block_")), 0)
    per_layer = jnp.sum(x * x, axis=tuple(range(1, x.ndim)))
    offset = dense if str(path[0].key) == "layers" else 0   # the MoE stack starts after the dense layers
    for i in range(x.shape[0]):   # repeat i of a cycle's block j is layer i * cycle + j
      layer = offset + (i * cycle + block if cycle > 1 else i)
      out[name.format(layer)] = out.get(name.format(layer), 0.0) + per_layer[i]
  return out


def _norms(tree: Any) -> tuple[dict[str, jax.Array], jax.Array]:
  sq = group_sq_norms(tree)
  total = jnp.sqrt(sum(sq.values(), jnp.zeros((), jnp.float32)))
  return {k: jnp.sqrt(v) for k, v in sq.items()}, total


def _lm_loss(logits_BxLxV: jax.Array, batch: dict) -> jax.Array:
  logp = jax.nn.log_softmax(logits_BxLxV.astype(jnp.float32), axis=-1)
  nll_BxL = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
  mask = batch.get("loss_mask")
  mask = jnp.ones_like(nll_BxL) if mask is None else mask.astype(jnp.float32)
  return jnp.sum(nll_BxL * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def make_stats_fn(model: nn.Module, tx: optax.GradientTransformation | None = None, *,
                  attention: bool = True, lora_scale: float | None = None) -> Callable[..., dict[str, jax.Array]]:
  """The statistics function (see the module docstring). `tx` gives the update ratio from the
  optimizer state when a TrainState is passed; `attention=False` skips the entropy statistics and
  keeps the run's backend (no attention weights unless it is the reference one). lora_scale (alpha /
  rank): a LoRA TrainState (state.frozen set, state.params the adapters) is measured on the merged model
  W + scale A @ B (`lora_stats`)."""
  cfg = model.cfg

  def forward(params: Any, batch: dict, grads: Any) -> tuple[dict[str, jax.Array], Any]:
    """(loss, activation, attention and gradient statistics of `params` on `batch`, the gradients)."""
    def loss_fn(p):
      with backends.use(backends.Backend()) if attention else contextlib.nullcontext():
        logits, mut = model.apply({"params": p}, batch["inputs"], deterministic=True,
                                  mutable=["intermediates"])
      return _lm_loss(logits, batch), mut.get("intermediates", {})

    if grads is None:
      (loss, inter), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    else:
      loss, inter = loss_fn(params)
    out: dict[str, jax.Array] = {"loss": loss}
    for i, x in enumerate(sown_per_layer(inter, "block_out")):
      x = x.astype(jnp.float32)
      out[f"act_mean/layer_{i}"] = jnp.mean(x)
      out[f"act_std/layer_{i}"] = jnp.std(x)
      out[f"act_rms/layer_{i}"] = jnp.sqrt(jnp.mean(x * x))
    out.update(_attention_stats(cfg, batch, sown_per_layer(inter, "attention_weights")))
    g_norms, g_total = _norms(grads)
    out["grad_norm"] = g_total
    out.update({f"grad_norm/{k}": v for k, v in g_norms.items()})
    if "pos_embed" in g_norms:
      out["pos_embed_grad_norm"] = g_norms["pos_embed"]
      out["pos_embed_grad_ratio"] = g_norms["pos_embed"] / jnp.maximum(g_norms.get("embed", 1.0), 1e-30)
    return out, grads

  def stats(state_or_params: Any, batch: dict, grads: Any = None, prev_params: Any = None
            ) -> dict[str, jax.Array]:
    params = getattr(state_or_params, "params", state_or_params)
    opt_state = getattr(state_or_params, "opt_state", None)
    frozen = getattr(state_or_params, "frozen", None)
    if frozen is not None and lora_scale is not None:
      return lora_stats(forward, tx, state_or_params, batch, lora_scale)
    out, grads = forward(params, batch, grads)
    updates, reference = None, params
    if prev_params is not None:   # the update that produced `params`, relative to what it was applied to
      updates, reference = _difference(params, prev_params), prev_params
    elif tx is not None and opt_state is not None:
      updates, _ = tx.update(grads, opt_state, params)
    if updates is not None:
      out.update(_update_ratios(updates, reference))
    return {k: jnp.asarray(v, jnp.float32) for k, v in out.items()}

  return stats


def lora_stats(forward: Callable, tx: optax.GradientTransformation | None, state: Any, batch: dict,
               scale: float) -> dict[str, jax.Array]:
  """A LoRA state's statistics, all on the merged model W + scale A @ B: its loss, activations, attention
  and gradients (those of the merged kernels, so frozen modules show theirs too); update_ratio/<module>
  is the merged weights' change under the adapters' update `tx` would apply now (0 for modules without
  adapters); lora/grad_norm is the adapters' own gradient norm (what the optimizer sees)."""
  merged, merged_vjp = jax.vjp(lambda ad: lora_ops.merge(state.frozen, ad, scale), state.params)
  out, grads = forward(merged, batch, None)
  (ad_grads,) = merged_vjp(grads)
  out["lora/grad_norm"] = _norms(ad_grads)[1]
  if tx is not None and state.opt_state is not None:
    ad_updates, _ = tx.update(ad_grads, state.opt_state, state.params)
    after = lora_ops.merge(state.frozen, optax.apply_updates(state.params, ad_updates), scale)
    out.update(_update_ratios(_difference(after, merged), merged))
  return {k: jnp.asarray(v, jnp.float32) for k, v in out.items()}


def _attention_stats(cfg: Any, batch: dict, weights: list) -> dict[str, jax.Array]:
  """Mean entropy, entropy ratio and max weight of each layer's sown attention weights."""
  out: dict[str, jax.Array] = {}
  if not weights:
    return out
  b, l = batch["inputs"].shape

  def visible(i: int) -> jax.Array:   # layer i's keys: its window when it is a local layer
    structural = visibility(cfg, local=cfg.is_local_layer(i)).structural(l, l)
    return jnp.ones((b, l, l), bool) if structural is None else jnp.broadcast_to(structural[None], (b, l, l))

  for i, w in enumerate(weights):
    st = head_statistics(w, visible(i))
    out[f"attn_entropy/layer_{i}"] = jnp.mean(st["entropy"])
    out[f"attn_entropy_ratio/layer_{i}"] = jnp.mean(st["entropy_ratio"])
    out[f"attn_max_weight/layer_{i}"] = jnp.mean(st["max_weight"])
  return out


def _difference(a: Any, b: Any) -> Any:
  return jax.tree.map(lambda x, y: jnp.asarray(x, jnp.float32) - jnp.asarray(y, jnp.float32),
                      nn.unbox(a), nn.unbox(b))


def _update_ratios(updates: Any, reference: Any) -> dict[str, jax.Array]:
  """update_ratio (whole model) and update_ratio/<module>: ||update|| / ||reference||."""
  u_norms, u_total = _norms(updates)
  p_norms, p_total = _norms(reference)
  out = {"update_ratio": u_total / jnp.maximum(p_total, 1e-30)}
  out.update({f"update_ratio/{k}": v / jnp.maximum(p_norms[k], 1e-30) for k, v in u_norms.items()})
  return out
