"""The routed expert FFN as a backend runs it (`Backend.moe_ffn`): global or expert parallel.

Expert parallel (`ops.moe_parallel`) when the backend's exchange is not 'global' and the mesh being
traced under (`jax.sharding.get_abstract_mesh()`, set by `parallel.mesh.traced_under`) maps the logical
'expert' axis, through the current flax logical axis rules, onto one mesh axis of size > 1 that the
tokens and experts divide evenly; else the global dispatch of `ops.moe` (what GSPMD partitions by
itself: every device then runs the experts on all tokens).
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from tformer_jax.ops import moe as moe_ops, moe_parallel

Array = jax.Array


def _axes(entry: Any) -> tuple[str, ...]:
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def expert_parallel_layout(num_tokens: int, num_experts: int,
                           param_axes: Mapping[str, tuple[str, ...]]) -> dict[str, Any] | None:
  """(mesh, expert_axis, token_axes, param_specs) from the trace context, or None (global)."""
  mesh = jax.sharding.get_abstract_mesh()
  rules = nn.get_logical_axis_rules()
  if mesh is None or mesh.empty or not rules:
    return None
  to_mesh = lambda names: tuple(nn.logical_to_mesh_axes(names, rules))  # noqa: E731
  expert = _axes(to_mesh(("expert",))[0])
  if len(expert) != 1 or expert[0] not in mesh.axis_names or mesh.shape[expert[0]] <= 1:
    return None
  axis = expert[0]
  token_axes = tuple(a for e in to_mesh(("batch", "length")) for a in _axes(e) if a in mesh.axis_names)
  token_axes = tuple(a for a in token_axes if a != axis) + (axis,)
  if num_experts % mesh.shape[axis] or num_tokens % math.prod(mesh.shape[a] for a in token_axes):
    return None
  specs = {}
  for name, logical in param_axes.items():
    dims = [tuple(a for a in _axes(e) if a in mesh.axis_names and a != axis) for e in to_mesh(logical)]
    specs[name] = P(axis, *[d or None for d in dims[1:]])
  return dict(mesh=mesh, expert_axis=axis, token_axes=token_axes, param_specs=specs)


def moe_ffn(backend: Any, x_TxD: Array, params: Mapping[str, Array], weights_TxK: Array,
            experts_TxK: Array, *, activation: str, dispatch: str, capacity: int,
            buffer_factor: float, capacity_impl: str,
            param_axes: Mapping[str, tuple[str, ...]], swiglu_limit: float = 0.0,
            swiglu_alpha: float = 1.702) -> tuple[Array, Array]:
  """(y_TxD, dropped_fraction): see `Backend.moe_ffn`."""
  if dispatch not in ("dropless", "capacity"):
    raise ValueError(f"unknown moe.dispatch {dispatch!r}; expected 'dropless' or 'capacity'")
  names = moe_ops.expert_param_names(activation)
  num_experts = params[names[0]].shape[0]
  names = names + tuple(moe_ops.bias_name(n) for n in names if moe_ops.bias_name(n) in params)
  ffn = dict(swiglu_limit=swiglu_limit, swiglu_alpha=swiglu_alpha)
  layout = None
  if backend.moe_exchange != "global":
    layout = expert_parallel_layout(x_TxD.shape[0], num_experts, {n: param_axes[n] for n in names})
  if layout is None:
    if dispatch == "dropless":
      y = moe_ops.moe_ffn_dropless(x_TxD, params, weights_TxK, experts_TxK, activation=activation, **ffn)
      return y, jnp.zeros((), jnp.float32)
    return moe_ops.moe_ffn_capacity(x_TxD, params, weights_TxK, experts_TxK, activation=activation,
                                    capacity=capacity, impl=capacity_impl, **ffn)
  kw = dict(activation=activation, exchange=backend.moe_exchange, gmm=backend.moe_gmm,
            interpret=backend.moe_interpret, **layout, **ffn)
  if dispatch == "dropless":
    return moe_parallel.moe_ffn_expert_parallel(x_TxD, params, weights_TxK, experts_TxK,
                                                buffer_factor=buffer_factor, **kw)
  keep_TxK = moe_ops.kept_assignments(experts_TxK, num_experts, capacity)   # global priority
  y, lost = moe_parallel.moe_ffn_expert_parallel(x_TxD, params, weights_TxK, experts_TxK,
                                                 keep_TxK=keep_TxK, capacity=capacity, **kw)
  return y, jnp.mean(jnp.logical_not(keep_TxK).astype(jnp.float32)) + lost
