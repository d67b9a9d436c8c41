"""Mixture-of-experts routing, dispatch and expert FFNs.

Pure jax.numpy; no Flax. Tokens are flattened to T = batch * length; E experts, each token picks
K = top_k of them. Two dispatch strategies compute the same function when nothing is dropped:

  capacity (GShard / Switch): every expert gets a fixed buffer of C slots; token-assignments are
    placed in priority order (all top-1 choices first in token order, then all top-2 choices, ...)
    and those that do not fit are dropped. Dense einsums with one-hot dispatch/combine tensors
    (T, E, C) (impl='einsum'), or scatter/gather into the same (E, C, D) buffers
    (impl='scatter'); static shapes, predictable memory, drops tokens when routing is unbalanced.
  dropless (MegaBlocks-style): the T*K assignments are sorted by expert and run through grouped
    matmuls (`jax.lax.ragged_dot`) with per-expert group sizes; nothing is dropped.

Expert parameters are dicts of stacked weights:
  GLU experts (swiglu, geglu): w_gate, w_up (E, D, F), w_down (E, F, D);
  plain experts (gelu, gelu_tanh, relu, silu): w_in (E, D, F), w_out (E, F, D);
  optional biases (GPT-OSS) b_<name> for w_<name>: b_gate, b_up (E, F), b_down (E, D) (or b_in, b_out).
`swiglu_limit` > 0: GPT-OSS's clamped SwiGLU (`glu`). `moe_ffn_naive` is a per-token reference used by the tests.

Routers (`route_by`): 'softmax' (`route`: Mixtral, Qwen3-MoE), 'sigmoid' (`route_sigmoid`: DeepSeek-V3's
sigmoid scores, a correction bias for the choice only, group-limited top-k, scaled weights) and
'softmax_topk' (`route_softmax_topk`: GPT-OSS, top-k on the logits, softmax over the k).
"""
from __future__ import annotations

import math
from typing import Callable, Mapping

import jax
import jax.numpy as jnp

Array = jnp.ndarray
Params = Mapping[str, Array]

GLU_ACTIVATIONS = ("swiglu", "geglu")
PLAIN_ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu")


# ----------------------------------------------------------------------------------------------
# Activations and single-expert FFNs

def activation_fn(name: str) -> tuple[Callable[[Array], Array], bool]:
  """(elementwise fn, is_glu) for an activation name. GLU: act(x W_gate) * (x W_up)."""
  fns = {
      "swiglu": (jax.nn.silu, True),
      "geglu": (lambda x: jax.nn.gelu(x, approximate=False), True),
      "gelu": (lambda x: jax.nn.gelu(x, approximate=False), False),
      "gelu_tanh": (lambda x: jax.nn.gelu(x, approximate=True), False),
      "relu": (jax.nn.relu, False),
      "silu": (jax.nn.silu, False),
  }
  if name not in fns:
    raise ValueError(f"unknown activation {name!r}; expected one of {tuple(fns)}")
  return fns[name]


def expert_param_names(activation: str) -> tuple[str, ...]:
  """Names of the stacked expert weights for an activation (input projections first)."""
  _, glu = activation_fn(activation)
  return ("w_gate", "w_up", "w_down") if glu else ("w_in", "w_out")


def bias_name(weight: str) -> str:
  """The optional bias of an expert weight: w_gate -> b_gate, w_down -> b_down, ..."""
  return "b_" + weight[2:]


def glu(g: Array, u: Array, activation: str, swiglu_limit: float = 0.0, swiglu_alpha: float = 1.702) -> Array:
  """A GLU's hidden act(g) * u; with swiglu_limit > 0 GPT-OSS's clamped form: g clamped to <= limit,
  u to [-limit, limit], then (u + 1) * g * sigmoid(alpha * g)."""
  if swiglu_limit > 0:
    g = jnp.minimum(g, swiglu_limit)
    u = jnp.clip(u, -swiglu_limit, swiglu_limit)
    return (u + 1) * (g * jax.nn.sigmoid(swiglu_alpha * g))
  return activation_fn(activation)[0](g) * u


def apply_experts(x: Array, mm: Callable[[Array, str], Array], bias: Callable[[str], Array | None],
                  activation: str, swiglu_limit: float = 0.0, swiglu_alpha: float = 1.702) -> Array:
  """An expert FFN on rows x, whatever holds the weights: mm(h, 'w_gate') is h times that weight (per row's
  expert), bias('w_gate') its bias broadcast to mm's output, or None."""
  act, is_glu = activation_fn(activation)

  def lin(h: Array, name: str) -> Array:
    y = mm(h, name)
    b = bias(name)
    return y if b is None else y + b.astype(y.dtype)

  if is_glu:
    return lin(glu(lin(x, "w_gate"), lin(x, "w_up"), activation, swiglu_limit, swiglu_alpha), "w_down")
  return lin(act(lin(x, "w_in")), "w_out")


def _check_params(params: Params, activation: str) -> bool:
  _, glu = activation_fn(activation)
  need = expert_param_names(activation)
  missing = [n for n in need if n not in params]
  if missing:
    raise ValueError(f"activation {activation!r} needs expert weights {need}; missing {missing}")
  return glu


# ----------------------------------------------------------------------------------------------
# Routing

def route(logits_TxE: Array, *, top_k: int, renormalize: bool = True) -> tuple[Array, Array, Array]:
  """Softmax (float32) over experts, then top-k.

  Returns (weights_TxK float32, experts_TxK int32, probs_TxE float32). With `renormalize` the
  top-k probabilities are rescaled to sum to 1 per token (Mixtral); otherwise they are the raw
  softmax probabilities (Switch, GShard top-1).
  """
  probs_TxE = jax.nn.softmax(logits_TxE.astype(jnp.float32), axis=-1)
  weights_TxK, experts_TxK = jax.lax.top_k(probs_TxE, top_k)
  if renormalize:
    weights_TxK = weights_TxK / jnp.sum(weights_TxK, axis=-1, keepdims=True)
  return weights_TxK, experts_TxK.astype(jnp.int32), probs_TxE


def route_sigmoid(logits_TxE: Array, correction_bias_E: Array | None = None, *, top_k: int, n_group: int = 0,
                  topk_group: int = 0, renormalize: bool = True,
                  routed_scaling_factor: float = 1.0) -> tuple[Array, Array, Array]:
  """DeepSeek-V3's router (float32): scores s = sigmoid(logits); the choice ranks s + correction_bias
  (the bias steers selection only, no gradient); with n_group > 1 the experts form n_group equal groups,
  each group scored by the sum of its two best biased scores, and a token picks its top_k among the
  topk_group best groups only. Weights: the chosen experts' unbiased s, divided by their sum (+1e-20)
  when `renormalize` (norm_topk_prob), times routed_scaling_factor.

  Returns (weights_TxK, experts_TxK int32, probs_TxE: s normalised per token, for the aux loss and entropy).
  """
  scores_TxE = jax.nn.sigmoid(logits_TxE.astype(jnp.float32))
  t, e = scores_TxE.shape
  choice_TxE = scores_TxE
  if correction_bias_E is not None:
    choice_TxE = choice_TxE + jax.lax.stop_gradient(correction_bias_E.astype(jnp.float32))
  choice_TxE = jax.lax.stop_gradient(choice_TxE)
  if n_group > 1:
    per = e // n_group
    top2_TxGx2, _ = jax.lax.top_k(choice_TxE.reshape(t, n_group, per), 2)
    _, groups_TxG = jax.lax.top_k(jnp.sum(top2_TxGx2, axis=-1), topk_group)
    keep_TxG = jnp.zeros((t, n_group), bool).at[jnp.arange(t)[:, None], groups_TxG].set(True)
    choice_TxE = jnp.where(jnp.repeat(keep_TxG, per, axis=-1), choice_TxE, -jnp.inf)
  _, experts_TxK = jax.lax.top_k(choice_TxE, top_k)
  weights_TxK = jnp.take_along_axis(scores_TxE, experts_TxK, axis=-1)
  if renormalize:
    weights_TxK = weights_TxK / (jnp.sum(weights_TxK, axis=-1, keepdims=True) + 1e-20)
  weights_TxK = weights_TxK * routed_scaling_factor
  probs_TxE = scores_TxE / jnp.sum(scores_TxE, axis=-1, keepdims=True)
  return weights_TxK, experts_TxK.astype(jnp.int32), probs_TxE


def route_softmax_topk(logits_TxE: Array, *, top_k: int) -> tuple[Array, Array, Array]:
  """GPT-OSS's router (float32): top-k of the logits, softmax over those k. Returns (weights_TxK,
  experts_TxK int32, probs_TxE = softmax over all experts, for the aux loss and entropy)."""
  logits_TxE = logits_TxE.astype(jnp.float32)
  top_TxK, experts_TxK = jax.lax.top_k(logits_TxE, top_k)
  return jax.nn.softmax(top_TxK, axis=-1), experts_TxK.astype(jnp.int32), jax.nn.softmax(logits_TxE, axis=-1)


def route_by(router: str, logits_TxE: Array, *, top_k: int, renormalize: bool = True,
             correction_bias_E: Array | None = None, n_group: int = 0, topk_group: int = 0,
             routed_scaling_factor: float = 1.0) -> tuple[Array, Array, Array]:
  """(weights_TxK, experts_TxK, probs_TxE) of the router named by model.moe.router."""
  if router == "softmax":
    return route(logits_TxE, top_k=top_k, renormalize=renormalize)
  if router == "sigmoid":
    return route_sigmoid(logits_TxE, correction_bias_E, top_k=top_k, n_group=n_group, topk_group=topk_group,
                         renormalize=renormalize, routed_scaling_factor=routed_scaling_factor)
  if router == "softmax_topk":
    return route_softmax_topk(logits_TxE, top_k=top_k)
  raise ValueError(f"unknown router {router!r}; expected softmax, sigmoid or softmax_topk")


def bias_update(bias_E: Array, load_E: Array, rate: float) -> Array:
  """Auxiliary-loss-free balancing (DeepSeek-V3): bias + rate * sign(mean load - load), float32. An
  overloaded expert's bias falls, an underloaded one's rises; `load_E` any per-expert load measure
  (fractions or counts: only its sign against its mean counts)."""
  load_E = load_E.astype(jnp.float32)
  return bias_E + rate * jnp.sign(jnp.mean(load_E, axis=-1, keepdims=True) - load_E).astype(bias_E.dtype)


def jitter(x: Array, rng: Array, eps: float) -> Array:
  """Multiplicative router-input noise: x * U(1 - eps, 1 + eps) (Switch Transformer)."""
  if eps <= 0.0:
    return x
  noise = jax.random.uniform(rng, x.shape, jnp.float32, 1.0 - eps, 1.0 + eps)
  return (x.astype(jnp.float32) * noise).astype(x.dtype)


def load_balancing_loss(probs_TxE: Array, experts_TxK: Array, num_experts: int) -> Array:
  """Switch/GShard auxiliary loss E * sum_i f_i * P_i (float32 scalar).

  f_i: the fraction of the T*K token-assignments (all top-k choices counted) sent to expert i, so
  sum_i f_i = 1; P_i: the mean router probability of expert i over tokens, sum_i P_i = 1. With this
  normalisation perfectly uniform routing gives exactly 1.0 for every top_k, and routing that
  collapses onto one expert approaches E / top_k (E for top-1). f_i is piecewise constant (no
  gradient); the gradient reaches the router through P_i.
  """
  load_E = expert_load(experts_TxK, num_experts)
  mean_prob_E = jnp.mean(probs_TxE.astype(jnp.float32), axis=0)
  return num_experts * jnp.sum(load_E * mean_prob_E)


def router_z_loss(logits_TxE: Array) -> Array:
  """ST-MoE router z-loss: mean over tokens of logsumexp(logits)^2 (float32 scalar)."""
  lse_T = jax.nn.logsumexp(logits_TxE.astype(jnp.float32), axis=-1)
  return jnp.mean(lse_T ** 2)


def expert_load(experts_TxK: Array, num_experts: int) -> Array:
  """Fraction of token-assignments per expert, (E,) float32 summing to 1 (no gradient)."""
  counts_E = jnp.zeros((num_experts,), jnp.float32).at[experts_TxK.reshape(-1)].add(1.0)
  return jax.lax.stop_gradient(counts_E / experts_TxK.size)


def router_entropy(probs_TxE: Array) -> Array:
  """Mean per-token entropy (nats) of the router distribution; log(E) is uniform, 0 is one-hot."""
  p = probs_TxE.astype(jnp.float32)
  ent_T = -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0), axis=-1)
  return jnp.mean(ent_T)


# ----------------------------------------------------------------------------------------------
# Capacity dispatch

def capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
  """Slots per expert: ceil(capacity_factor * T * K / E), at least 1 and at most T.

  An expert can receive each token at most once, so more than T slots are never needed.
  """
  c = int(math.ceil(capacity_factor * num_tokens * top_k / num_experts))
  return max(1, min(c, num_tokens))


def capacity_dispatch(weights_TxK: Array, experts_TxK: Array, num_experts: int,
                      capacity: int) -> tuple[Array, Array, Array]:
  """One-hot dispatch / weighted combine tensors (T, E, C) and the dropped fraction.

  Assignments take slots in priority order: rank first, then token index (all top-1 choices in
  token order, then all top-2 choices, ...), as in GShard / Switch. Assignment (t, k) gets slot
  #{earlier assignments to the same expert}; those at slot >= capacity are dropped (the token
  then gets no contribution from that expert; the residual stream carries it).

  Returns dispatch_TxExC (float32 0/1), combine_TxExC (float32: dispatch * routing weight; the
  gradient to the router flows through it) and dropped_fraction (float32 scalar, of T*K).
  """
  onehot_KxTxE = jax.nn.one_hot(experts_TxK.T, num_experts, dtype=jnp.int32)
  slot_KxT = _slots(experts_TxK, num_experts)
  keep_KxT = slot_KxT < capacity
  slot_KxTxC = jax.nn.one_hot(jnp.where(keep_KxT, slot_KxT, capacity), capacity, dtype=jnp.float32)
  dispatch_TxExC = jnp.einsum("kte,ktc->tec", onehot_KxTxE.astype(jnp.float32), slot_KxTxC)
  w_KxT = weights_TxK.T.astype(jnp.float32)
  combine_TxExC = jnp.einsum("kte,ktc->tec", onehot_KxTxE.astype(jnp.float32) * w_KxT[..., None],
                             slot_KxTxC)
  dropped_fraction = jnp.mean(jnp.logical_not(keep_KxT).astype(jnp.float32))
  return dispatch_TxExC, combine_TxExC, dropped_fraction


def _slots(experts_TxK: Array, num_experts: int) -> Array:
  """slot_KxT int32: #earlier assignments to the same expert, in (rank, token) priority order."""
  t, k = experts_TxK.shape
  flat_NxE = jax.nn.one_hot(experts_TxK.T.reshape(-1), num_experts, dtype=jnp.int32)
  slot_N = jnp.sum((jnp.cumsum(flat_NxE, axis=0) - 1) * flat_NxE, axis=-1)
  return slot_N.reshape(k, t)


def kept_assignments(experts_TxK: Array, num_experts: int, capacity: int) -> Array:
  """keep_TxK bool: which assignments fit under `capacity` (same priority as capacity_dispatch)."""
  return (_slots(experts_TxK, num_experts) < capacity).T


# ----------------------------------------------------------------------------------------------
# Expert FFNs

def _bias_of(params: Params, index: Callable[[Array], Array]) -> Callable[[str], Array | None]:
  """bias(weight name) for `apply_experts`: the expert bias indexed per row by `index`, or None."""
  return lambda name: index(params[bias_name(name)]) if bias_name(name) in params else None


def _expert_ffn_dense(x_ExCxD: Array, params: Params, activation: str, swiglu_limit: float = 0.0,
                      swiglu_alpha: float = 1.702) -> Array:
  """All experts on their (E, C, D) buffers with batched einsums."""
  dt = x_ExCxD.dtype
  mm = lambda h, n: jnp.einsum("ecd,edf->ecf", h, params[n].astype(dt))  # noqa: E731
  return apply_experts(x_ExCxD, mm, _bias_of(params, lambda b: b[:, None, :]), activation, swiglu_limit,
                       swiglu_alpha)


def moe_ffn_capacity(x_TxD: Array, params: Params, weights_TxK: Array, experts_TxK: Array, *,
                     activation: str, capacity: int, impl: str = "einsum", swiglu_limit: float = 0.0,
                     swiglu_alpha: float = 1.702) -> tuple[Array, Array]:
  """Capacity-dispatch MoE FFN. Returns (y_TxD in x's dtype, dropped_fraction).

  impl 'einsum' (GShard): one-hot (T, E, C) dispatch/combine einsums, O(T*E*C*D) flops — dense
  ops that suit TPUs. impl 'scatter': the same buffers filled by scatter-add and read back by
  gather at each assignment's (expert, slot), O(T*K*D). Identical results.
  """
  _check_params(params, activation)
  num_experts = params[expert_param_names(activation)[0]].shape[0]
  if impl == "scatter":
    return _capacity_scatter(x_TxD, params, weights_TxK, experts_TxK, activation, capacity,
                             num_experts, swiglu_limit, swiglu_alpha)
  if impl != "einsum":
    raise ValueError(f"unknown capacity impl {impl!r}; expected 'einsum' or 'scatter'")
  dispatch_TxExC, combine_TxExC, dropped = capacity_dispatch(
      weights_TxK, experts_TxK, num_experts, capacity)
  dt = x_TxD.dtype
  x_ExCxD = jnp.einsum("tec,td->ecd", dispatch_TxExC.astype(dt), x_TxD)
  y_ExCxD = _expert_ffn_dense(x_ExCxD, params, activation, swiglu_limit, swiglu_alpha)
  y_TxD = jnp.einsum("tec,ecd->td", combine_TxExC.astype(dt), y_ExCxD)
  return y_TxD, dropped


def _capacity_scatter(x_TxD: Array, params: Params, weights_TxK: Array, experts_TxK: Array,
                      activation: str, capacity: int, num_experts: int, swiglu_limit: float,
                      swiglu_alpha: float) -> tuple[Array, Array]:
  t, k = experts_TxK.shape
  slot_KxT = _slots(experts_TxK, num_experts)
  keep_KxT = slot_KxT < capacity
  n_slots = num_experts * capacity
  # Row of the (E*C + 1, D) buffer per assignment; dropped ones go to the last (discarded) row.
  row_KxT = jnp.where(keep_KxT, experts_TxK.T * capacity + slot_KxT, n_slots)
  upd_KxTxD = jnp.broadcast_to(x_TxD[None], (k, t, x_TxD.shape[-1]))
  buf = jnp.zeros((n_slots + 1, x_TxD.shape[-1]), x_TxD.dtype).at[row_KxT].add(upd_KxTxD)
  x_ExCxD = buf[:n_slots].reshape(num_experts, capacity, -1)
  y_ExCxD = _expert_ffn_dense(x_ExCxD, params, activation, swiglu_limit, swiglu_alpha)
  y_buf = jnp.concatenate([y_ExCxD.reshape(n_slots, -1), jnp.zeros_like(y_ExCxD[0, :1])], axis=0)
  y_KxTxD = jnp.take(y_buf, row_KxT, axis=0)
  w_KxT = jnp.where(keep_KxT, weights_TxK.T, 0.0).astype(y_KxTxD.dtype)
  y_TxD = jnp.einsum("kt,ktd->td", w_KxT, y_KxTxD)
  return y_TxD, jnp.mean(jnp.logical_not(keep_KxT).astype(jnp.float32))


def _ragged(x_NxD: Array, w_ExDxF: Array, group_sizes_E: Array) -> Array:
  return jax.lax.ragged_dot(x_NxD, w_ExDxF.astype(x_NxD.dtype), group_sizes_E)


def moe_ffn_dropless(x_TxD: Array, params: Params, weights_TxK: Array, experts_TxK: Array, *,
                     activation: str, swiglu_limit: float = 0.0, swiglu_alpha: float = 1.702) -> Array:
  """Dropless MoE FFN: sort assignments by expert, grouped matmuls, unsort, weighted sum over k."""
  _check_params(params, activation)
  num_experts = params[expert_param_names(activation)[0]].shape[0]
  t, k = experts_TxK.shape
  experts_N = experts_TxK.reshape(-1)                     # N = T*K, assignment n = t*K + k
  order_N = jnp.argsort(experts_N, stable=True)            # sorted position -> assignment
  group_sizes_E = jnp.zeros((num_experts,), jnp.int32).at[experts_N].add(1)
  x_NxD = jnp.take(x_TxD, order_N // k, axis=0)
  sorted_N = jnp.take(experts_N, order_N)
  y_NxD = apply_experts(x_NxD, lambda h, n: _ragged(h, params[n], group_sizes_E),
                        _bias_of(params, lambda b: jnp.take(b, sorted_N, axis=0)), activation, swiglu_limit,
                        swiglu_alpha)
  inverse_N = jnp.argsort(order_N)                         # assignment -> sorted position
  y_TxKxD = jnp.take(y_NxD, inverse_N, axis=0).reshape(t, k, -1)
  return jnp.einsum("tk,tkd->td", weights_TxK.astype(y_TxKxD.dtype), y_TxKxD)


def moe_ffn_naive(x_TxD: Array, params: Params, weights_TxK: Array, experts_TxK: Array, *,
                  activation: str, keep_TxK: Array | None = None, swiglu_limit: float = 0.0,
                  swiglu_alpha: float = 1.702) -> Array:
  """Reference: for each token (vmap) and each of its k choices (Python loop), gather that
  expert's weights and apply it. `keep_TxK` (bool) zeroes dropped assignments."""
  _check_params(params, activation)
  names = expert_param_names(activation)
  names = names + tuple(bias_name(n) for n in names if bias_name(n) in params)
  k = experts_TxK.shape[1]
  if keep_TxK is None:
    keep_TxK = jnp.ones(experts_TxK.shape, bool)

  def one_token(x_D, w_K, e_K, keep_K):
    y_D = jnp.zeros_like(x_D)
    for j in range(k):
      w = {n: params[n][e_K[j]].astype(x_D.dtype) for n in names}
      out = apply_experts(x_D, lambda h, n, w=w: h @ w[n], lambda n, w=w: w.get(bias_name(n)), activation,
                          swiglu_limit, swiglu_alpha)
      y_D = y_D + jnp.where(keep_K[j], w_K[j].astype(x_D.dtype), 0.0) * out
    return y_D

  return jax.vmap(one_token)(x_TxD, weights_TxK, experts_TxK, keep_TxK)


def dense_ffn(x_TxD: Array, params: Params, *, activation: str) -> Array:
  """A dense FFN with unstacked weights (w_gate/w_up (D, F), w_down (F, D); or w_in, w_out).

  Used for the shared expert and the dense baseline in the benchmark."""
  act, glu = activation_fn(activation)
  dt = x_TxD.dtype
  if glu:
    h = act(x_TxD @ params["w_gate"].astype(dt)) * (x_TxD @ params["w_up"].astype(dt))
    return h @ params["w_down"].astype(dt)
  return act(x_TxD @ params["w_in"].astype(dt)) @ params["w_out"].astype(dt)
