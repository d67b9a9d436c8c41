"""Mixture-of-experts FFN layer (linen) over the pure ops in `tformer_jax.ops.moe`.

`MoEFFN(cfg)(x_BxLxD, deterministic=...)` -> y_BxLxD, a drop-in for the dense FFN of a block.
Side outputs go through `sow` (reduce = append to a tuple, one entry per call):
  'aux_loss':    'moe_load_balance' (aux_loss_coef * Switch loss), 'moe_z_loss' (z_loss_coef * z)
  'moe_metrics': 'load' (E,), 'dropped_fraction', 'router_entropy'
The sigmoid router's 'correction_bias' (E,) is a float32 param with no gradient (it steers the choice
only): the train step moves it from the sown 'load' (`bias_updates`, DeepSeek-V3's auxiliary-loss-free
balancing), outside the optimizer.
A training step applies the model with mutable=['aux_loss', 'moe_metrics'] (plus 'intermediates'
etc. if it wants them) and adds `collect_aux_loss(mutables)` to the loss.
"""
from __future__ import annotations

from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

from tformer_jax import backends
from tformer_jax.config import ModelConfig
from tformer_jax.nn.common import dtypes, normal, param, residual_std
from tformer_jax.ops import moe as moe_ops

Array = jnp.ndarray

# Logical axis names of each weight; map 'expert' to a mesh axis for expert parallelism.
LOGICAL_AXES = {
    "router": ("embed", "expert"),
    "w_gate": ("expert", "embed", "mlp"),
    "w_up": ("expert", "embed", "mlp"),
    "w_in": ("expert", "embed", "mlp"),
    "w_down": ("expert", "mlp", "embed"),
    "w_out": ("expert", "mlp", "embed"),
    "b_gate": ("expert", "mlp"),
    "b_up": ("expert", "mlp"),
    "b_in": ("expert", "mlp"),
    "b_down": ("expert", "embed"),
    "b_out": ("expert", "embed"),
}
CORRECTION_BIAS = "correction_bias"   # the sigmoid router's per-expert selection bias (params, no gradient)


def expert_hidden(cfg: ModelConfig) -> int:
  """Hidden size F of each routed expert."""
  return cfg.moe.d_ff or cfg.ff


def shared_hidden(cfg: ModelConfig) -> int:
  """Hidden size of the shared experts together (one MLP: num_shared x shared_d_ff), 0 without."""
  return cfg.moe.shared_count * (cfg.moe.shared_d_ff or expert_hidden(cfg))


class MoEFFN(nn.Module):
  """Top-k routed FFN experts (+ optional shared experts). Router math in float32.

  Params: router (D, E), router_bias (E,) for router='softmax_topk', correction_bias (E,) float32 for
  router='sigmoid'; experts w_gate/w_up (E, D, F), w_down (E, F, D) for swiglu/geglu, or
  w_in (E, D, F), w_out (E, F, D) otherwise, with moe.expert_bias their biases b_gate/b_up (E, F),
  b_down (E, D) (b_in, b_out); the shared experts (if any) are one MLP of width num_shared x shared_d_ff
  with the same names, a 'shared_' prefix and no expert axis. Output projections follow
  cfg.scale_residual_init.
  Jitter (cfg.moe.jitter > 0) needs the 'dropout' rng when deterministic=False.
  capacity_impl: 'einsum' (GShard one-hot einsums) or 'scatter' (same result, O(T*K*D) dispatch).
  The experts run through the backend (`backends.current().moe_ffn`): expert parallel over the mesh's
  'expert' axis when the runtime asks for it, else the global dispatch.
  """
  cfg: ModelConfig
  capacity_impl: str = "einsum"

  @nn.compact
  def __call__(self, x_BxLxD: Array, *, deterministic: bool = True) -> Array:
    cfg, m = self.cfg, self.cfg.moe
    if m.num_experts <= 0:
      raise ValueError("MoEFFN needs cfg.moe.num_experts > 0")
    b, l, d = x_BxLxD.shape
    e, f = m.num_experts, expert_hidden(cfg)
    dtype, pdt = dtypes(cfg)
    std, out_std = cfg.init_std, residual_std(cfg)

    w_router_DxE = param(self, "router", normal(std), (d, e), LOGICAL_AXES["router"], pdt)
    names = moe_ops.expert_param_names(cfg.activation)
    is_out = {n: n in ("w_down", "w_out") for n in names}
    params = {}
    for n in names:
      shape = (e, f, d) if is_out[n] else (e, d, f)
      params[n] = param(self, n, normal(out_std if is_out[n] else std), shape, LOGICAL_AXES[n], pdt)
    if m.expert_bias:
      for n in names:
        bn = moe_ops.bias_name(n)
        params[bn] = param(self, bn, nn.initializers.zeros, (e, d if is_out[n] else f), LOGICAL_AXES[bn], pdt)

    x_TxD = x_BxLxD.reshape(b * l, d)
    router_in_TxD = x_TxD.astype(jnp.float32)
    if m.jitter > 0.0 and not deterministic:
      router_in_TxD = moe_ops.jitter(router_in_TxD, self.make_rng("dropout"), m.jitter)
    logits_TxE = router_in_TxD @ w_router_DxE.astype(jnp.float32)
    if m.router == "softmax_topk":
      logits_TxE = logits_TxE + param(self, "router_bias", nn.initializers.zeros, (e,), (None,),
                                      pdt).astype(jnp.float32)
    correction_E = None
    if m.router == "sigmoid":   # float32 whatever param_dtype: the balancing steps are small
      correction_E = param(self, CORRECTION_BIAS, nn.initializers.zeros, (e,), (None,), jnp.float32)
    weights_TxK, experts_TxK, probs_TxE = moe_ops.route_by(
        m.router, logits_TxE, top_k=m.top_k, renormalize=m.renormalize, correction_bias_E=correction_E,
        n_group=m.n_group, topk_group=m.topk_group, routed_scaling_factor=m.routed_scaling_factor)

    xc_TxD = x_TxD.astype(dtype)
    cparams = {n: p.astype(dtype) for n, p in params.items()}
    # backend hook: the experts, expert parallel over the mesh's 'expert' axis or the global dispatch
    y_TxD, dropped = backends.current().moe_ffn(
        xc_TxD, cparams, weights_TxK, experts_TxK, activation=cfg.activation, dispatch=m.dispatch,
        capacity=moe_ops.capacity(b * l, e, m.top_k, m.capacity_factor),
        buffer_factor=m.ep_buffer_factor, capacity_impl=self.capacity_impl, param_axes=LOGICAL_AXES,
        swiglu_limit=m.swiglu_limit, swiglu_alpha=m.swiglu_alpha)

    if m.shared_count:
      shared, fs = {}, shared_hidden(cfg)
      for n in names:
        shape, axes = ((fs, d), ("mlp", "embed")) if is_out[n] else ((d, fs), ("embed", "mlp"))
        shared[n] = param(self, "shared_" + n, normal(out_std if is_out[n] else std), shape, axes, pdt)
      y_TxD = y_TxD + moe_ops.dense_ffn(xc_TxD, {n: p.astype(dtype) for n, p in shared.items()},
                                        activation=cfg.activation)

    lb = moe_ops.load_balancing_loss(probs_TxE, experts_TxK, e)
    z = moe_ops.router_z_loss(logits_TxE)
    self.sow("aux_loss", "moe_load_balance", m.aux_loss_coef * lb)
    self.sow("aux_loss", "moe_z_loss", m.z_loss_coef * z)
    self.sow("moe_metrics", "load", moe_ops.expert_load(experts_TxK, e))
    self.sow("moe_metrics", "dropped_fraction", jax.lax.stop_gradient(dropped))
    self.sow("moe_metrics", "router_entropy", jax.lax.stop_gradient(moe_ops.router_entropy(probs_TxE)))
    return y_TxD.reshape(b, l, d).astype(dtype)


def collect_aux_loss(mutables: Mapping[str, Any]) -> Array:
  """Sum of every leaf under 'aux_loss' (already coefficient-weighted); 0.0 if there is none."""
  leaves = jax.tree.leaves(mutables.get("aux_loss", {}))
  if not leaves:
    return jnp.zeros((), jnp.float32)
  return sum(jnp.sum(jnp.asarray(v, jnp.float32)) for v in leaves)


def _leaves_named(tree: Any, name: str) -> list[Array]:
  out = []
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    keys = [getattr(k, "key", None) for k in path]
    if name in keys:
      out.append(jnp.asarray(leaf, jnp.float32))
  return out


def collect_moe_metrics(mutables: Mapping[str, Any]) -> dict[str, Array]:
  """Averages over MoE layers (and scanned layers) of the sown metrics, plus the aux losses.

  Keys (present only if some layer sowed them): 'moe_load' (E,) mean load fraction,
  'moe_load_max' / 'moe_load_min' (the largest / smallest per-layer expert load fraction; 1/E is
  perfectly balanced), 'moe_load_ratio' (max/min load of the worst layer),
  'moe_dropped_fraction', 'moe_router_entropy', 'moe_load_balance', 'moe_z_loss' (summed).
  """
  metrics = mutables.get("moe_metrics", {})
  out: dict[str, Array] = {}
  loads = _leaves_named(metrics, "load")
  if loads:
    e = loads[0].shape[-1]
    load_LxE = jnp.concatenate([v.reshape(-1, e) for v in loads], axis=0)
    out["moe_load"] = jnp.mean(load_LxE, axis=0)
    out["moe_load_max"] = jnp.max(load_LxE)
    out["moe_load_min"] = jnp.min(load_LxE)
    # max/min load of the worst layer (1.0 = balanced); an expert with no tokens gives a large
    # finite ratio (floor 1e-6), not inf.
    out["moe_load_ratio"] = jnp.max(jnp.max(load_LxE, -1) / jnp.maximum(jnp.min(load_LxE, -1), 1e-6))
  for name in ("dropped_fraction", "router_entropy"):
    vals = _leaves_named(metrics, name)
    if vals:
      out["moe_" + name] = jnp.mean(jnp.concatenate([v.reshape(-1) for v in vals]))
  aux = mutables.get("aux_loss", {})
  for name in ("moe_load_balance", "moe_z_loss"):
    vals = _leaves_named(aux, name)
    if vals:
      out[name] = sum(jnp.sum(v) for v in vals)
  return out



def _module_path(path: tuple) -> str:
  return "/".join(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))


def correction_loads(mutables: Mapping[str, Any]) -> dict[str, Array]:
  """The sown per-expert 'load' of every MoE layer, keyed by its module path ('layers/moe',
  'layers_3/moe', 'layers/block_1/moe'; a scanned stack's load has its leading layer axis): what
  `update_correction_biases` matches with the 'correction_bias' params of the same module."""
  out = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(mutables.get("moe_metrics", {})):
    keys = [str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)]
    if keys and keys[-1] == "load":
      out["/".join(keys[:-1])] = jax.lax.stop_gradient(jnp.asarray(leaf, jnp.float32))
  return out


def update_correction_biases(new_params: Any, old_params: Any, loads: Mapping[str, Array], rate: float,
                             finite: Array) -> Any:
  """new_params with every 'correction_bias' set from old_params' own value moved by its layer's load
  (`ops.moe.bias_update`, DeepSeek-V3's auxiliary-loss-free balancing; rate 0 keeps it): whatever an
  optimizer did to it (weight decay) is undone, and a non-finite step keeps the old bias."""
  old = {_module_path(p): x for p, x in jax.tree_util.tree_leaves_with_path(old_params)}

  def one(path, x):
    keys = _module_path(path)
    if not keys.endswith("/" + CORRECTION_BIAS):
      return x
    prev = old[keys]
    load = loads.get(keys[: -len(CORRECTION_BIAS) - 1])
    if not rate or load is None:
      return prev
    return jnp.where(finite, moe_ops.bias_update(prev, load.reshape(prev.shape), rate), prev)

  return jax.tree_util.tree_map_with_path(one, new_params)
