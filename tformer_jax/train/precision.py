"""Mixed precision: policies, dynamic loss scaling for fp16, and the non-finite-step guard.

`train.precision` is one of:
  float32  everything in float32.
  bf16     float32 params (and optimizer state), bfloat16 compute: the model runs with
           dtype='bfloat16', param_dtype='float32'. No loss scaling (bf16 has float32's range).
  fp16     float32 params, float16 compute, with a `DynamicLossScale`.

A train step that serves all three:

  policy = get_policy(cfg.train.precision)
  model_cfg = dataclasses.replace(model_cfg, **policy.model_overrides())
  loss_scale = policy.initial_loss_scale()                  # NoOpLossScale for float32 / bf16

  def f(params, mb, rng):                                   # sum-form loss, see optim
    loss_sum, (count, aux) = ...
    return loss_scale.scale_loss(loss_sum), (count, aux)
  (loss, aux), grads = accumulate_gradients(jax.value_and_grad(f, has_aux=True), ...)
  grads = loss_scale.unscale_grads(grads); loss = loss / loss_scale.scale
  finite = all_finite((loss, grads))
  updates, new_opt = tx.update(grads, opt_state, params)
  params, opt_state = select_tree(finite, (optax.apply_updates(params, updates), new_opt),
                                  (params, opt_state))
  loss_scale = loss_scale.adjust(finite)                    # the loop counts ~finite as skipped
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

PyTree = Any

PRECISIONS = ("float32", "bf16", "fp16")


@dataclasses.dataclass(frozen=True)
class Policy:
  """A precision policy: which dtypes the model computes and stores in, and whether to scale."""
  name: str
  compute_dtype: str            # model.dtype: float32 | bfloat16 | float16
  param_dtype: str = "float32"  # params and optimizer state always stay float32
  loss_scaling: bool = False

  def model_overrides(self) -> dict[str, str]:
    """Fields to set on ModelConfig / cfg.model: {'dtype': ..., 'param_dtype': ...}."""
    return {"dtype": self.compute_dtype, "param_dtype": self.param_dtype}

  def cast_to_compute(self, tree: PyTree) -> PyTree:
    """Floating leaves to the compute dtype (ints, bools untouched)."""
    return cast_floating(tree, self.compute_dtype)

  def cast_to_param(self, tree: PyTree) -> PyTree:
    """Floating leaves to the param dtype (e.g. gradients before the optimizer)."""
    return cast_floating(tree, self.param_dtype)

  def initial_loss_scale(self, **kwargs: Any) -> "DynamicLossScale | NoOpLossScale":
    """DynamicLossScale.create(**kwargs) for fp16, else NoOpLossScale()."""
    return DynamicLossScale.create(**kwargs) if self.loss_scaling else NoOpLossScale()


_POLICIES = {
    "float32": Policy("float32", "float32"),
    "bf16": Policy("bf16", "bfloat16"),
    "fp16": Policy("fp16", "float16", loss_scaling=True),
}


def get_policy(precision: str) -> Policy:
  """The policy for `train.precision` (float32 | bf16 | fp16)."""
  if precision not in _POLICIES:
    raise ValueError(f"train.precision: unknown value {precision!r}; expected one of {PRECISIONS}")
  return _POLICIES[precision]


def model_dtype(precision: str) -> str:
  """The model compute dtype for a `train.precision` value ('bf16' -> 'bfloat16')."""
  return get_policy(precision).compute_dtype


# The parameters tformer_jax.nn only ever reads as `.astype(cfg.dtype)`: matmul weights and the biases
# added to their outputs. `cast_for_compute` casts these once per step, giving the model exactly the
# values it would make itself at every use (per layer of a scan, again in a remat'd backward). The
# others stay float32: norm scales/biases and the MoE router (read in float32), embedding tables
# (gathered: their gradient is a scatter-add, kept in float32; a tied head casts the table once per
# step anyway) and the T5 relative-bias table (float32).
COMPUTE_CAST_NAMES = frozenset({
    "wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo",                   # attention
    "wi", "wg", "bi", "bg",                                           # MLP (and 'wo', 'bo')
    "w_gate", "w_up", "w_down", "w_in", "w_out",                      # MoE experts
    "shared_w_gate", "shared_w_up", "shared_w_down", "shared_w_in", "shared_w_out",
    "head",                                                           # untied LM head
})


def cast_for_compute(params: PyTree, dtype: Any) -> PyTree:
  """`params` with the COMPUTE_CAST_NAMES leaves in `dtype` (the model's compute dtype), others as they
  are. Differentiate through the result (or cast its gradients back with `cast_like`): the gradients of
  the cast leaves come back in the params' dtype, the same values the per-use casts gave."""
  dtype = jnp.dtype(dtype)

  def cast(path: tuple, x: Any) -> Any:
    keys = [p.key for p in path if isinstance(p, jax.tree_util.DictKey)]
    if keys and keys[-1] in COMPUTE_CAST_NAMES and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
      return x.astype(dtype)
    return x

  return jax.tree_util.tree_map_with_path(cast, params)


def cast_like(tree: PyTree, like: PyTree) -> PyTree:
  """Every leaf of `tree` in the dtype of the matching leaf of `like` (gradients -> param dtype)."""
  return jax.tree.map(lambda x, ref: x.astype(ref.dtype), tree, like)


def cast_floating(tree: PyTree, dtype: Any) -> PyTree:
  """Cast every floating-point leaf of `tree` to `dtype`; other leaves are returned unchanged."""
  dtype = jnp.dtype(dtype)

  def cast(x: Any) -> Any:
    if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating):
      return x.astype(dtype)
    return x

  return jax.tree.map(cast, tree)


def all_finite(tree: PyTree) -> jax.Array:
  """A scalar bool array: True iff every element of every (floating) leaf is finite."""
  leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
  if not leaves:
    return jnp.array(True)
  return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]).all()


def select_tree(pred: jax.Array, new: PyTree, old: PyTree) -> PyTree:
  """Leafwise `new if pred else old` for a scalar bool `pred` (jit-friendly, no Python branch).

  Used to skip an update whose loss or gradients are non-finite: params, optimizer state and any
  other carried state keep their old values when pred is False.
  """
  pred = jnp.asarray(pred, bool)
  return jax.tree.map(lambda n, o: jnp.where(pred, n, o), new, old)


@struct.dataclass
class NoOpLossScale:
  """The loss scale for float32 / bf16: scale 1, nothing changes. Same interface as Dynamic."""

  @property
  def scale(self) -> jax.Array:
    return jnp.float32(1.0)

  def scale_loss(self, loss: jax.Array) -> jax.Array:
    return loss

  def unscale_grads(self, grads: PyTree) -> PyTree:
    return grads

  def adjust(self, grads_finite: jax.Array) -> "NoOpLossScale":
    del grads_finite
    return self


@struct.dataclass
class DynamicLossScale:
  """Dynamic loss scaling state (a pytree: scale and good_steps are arrays, the rest static).

  Each step: scale the loss, unscale the gradients, then `adjust(all_finite(grads))`: an overflow
  halves the scale (by `factor`, not below min_scale) and resets the counter; `period` finite
  steps in a row double it (not above max_scale) and reset the counter.
  """
  scale: jax.Array                      # float32 scalar
  good_steps: jax.Array                 # int32 scalar: consecutive finite steps since last change
  period: int = struct.field(pytree_node=False, default=2000)
  factor: float = struct.field(pytree_node=False, default=2.0)
  min_scale: float = struct.field(pytree_node=False, default=1.0)
  max_scale: float = struct.field(pytree_node=False, default=2.0 ** 24)

  @classmethod
  def create(cls, initial_scale: float = 2.0 ** 15, period: int = 2000, factor: float = 2.0,
             min_scale: float = 1.0, max_scale: float = 2.0 ** 24) -> "DynamicLossScale":
    if not (0 < min_scale <= initial_scale <= max_scale) or factor <= 1 or period < 1:
      raise ValueError("need 0 < min_scale <= initial_scale <= max_scale, factor > 1, period >= 1")
    return cls(scale=jnp.float32(initial_scale), good_steps=jnp.int32(0), period=period,
               factor=factor, min_scale=min_scale, max_scale=max_scale)

  def scale_loss(self, loss: jax.Array) -> jax.Array:
    """loss * scale, in the loss's dtype."""
    return loss * self.scale.astype(jnp.result_type(loss))

  def unscale_grads(self, grads: PyTree) -> PyTree:
    """grads / scale, computed in float32 and cast back to each leaf's dtype."""
    inv = 1.0 / self.scale
    return jax.tree.map(lambda g: (g.astype(jnp.float32) * inv).astype(g.dtype), grads)

  def adjust(self, grads_finite: jax.Array) -> "DynamicLossScale":
    """The state for the next step, given whether this step's gradients were all finite."""
    grads_finite = jnp.asarray(grads_finite, bool)
    good = self.good_steps + 1
    grow = good >= self.period
    up = jnp.where(grow, jnp.minimum(self.scale * self.factor, self.max_scale), self.scale)
    down = jnp.maximum(self.scale / self.factor, self.min_scale)
    scale = jnp.where(grads_finite, up, down).astype(jnp.float32)
    good_steps = jnp.where(grads_finite & ~grow, good, 0).astype(jnp.int32)
    return self.replace(scale=scale, good_steps=good_steps)
