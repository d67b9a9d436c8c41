"""The train state pytree and its sharded initialisation (eval_shape -> logical shardings -> jit)."""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import struct

from tformer_jax.ops import lora as lora_ops
from tformer_jax.train.precision import DynamicLossScale, NoOpLossScale


@struct.dataclass
class TrainState:
  step: jax.Array                      # int32 scalar: optimizer updates applied so far
  params: Any
  opt_state: Any
  loss_scale: DynamicLossScale | NoOpLossScale
  rng: jax.Array                       # folded with the step for dropout / jitter
  bad_steps: jax.Array                 # int32: consecutive non-finite (skipped) steps
  skipped: jax.Array                   # int32: total skipped steps
  frozen: Any = None                   # a LoRA run (train.lora): the frozen base params (params = the
                                       # adapters); rebuilt from train.init_from, never checkpointed


def init_fn(model: nn.Module, tx: optax.GradientTransformation, loss_scale, seq_len: int,
            lora: tuple[tuple[str, ...], int] | None = None):
  """A function rng -> TrainState with *boxed* params (nn.Partitioned carrying logical axes).
  lora=(targets, rank): params are adapters for the model's (frozen) params (ops/lora.py), boxed with
  their kernel's logical axes (`box_adapters`), and the optimizer state is theirs alone."""
  def init(rng: jax.Array) -> TrainState:
    p_rng, s_rng = jax.random.split(rng)
    tokens = jnp.zeros((1, seq_len), jnp.int32)
    params = model.init(p_rng, tokens)["params"]
    frozen = None
    if lora is not None:
      adapters = lora_ops.init(jax.random.fold_in(p_rng, 1), unbox_plain(params), *lora)
      frozen, params = params, box_adapters(adapters, params)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=_fit_boxes(tx.init(params)),
                      loss_scale=loss_scale, rng=s_rng, bad_steps=jnp.zeros((), jnp.int32),
                      skipped=jnp.zeros((), jnp.int32), frozen=frozen)
  return init


def box_adapters(adapters: Any, boxed_params: Any) -> Any:
  """LoRA adapters boxed like their kernels (`lora.axes`): A sharded as the kernel's inputs, B as its
  outputs, so a mesh splits them (and their optimizer moments) instead of replicating them."""
  def walk(ad: dict, p: Any) -> Any:
    if set(ad) != {lora_ops.A, lora_ops.B}:
      return {k: walk(v, p[k]) for k, v in ad.items()}
    if not isinstance(p, nn.meta.AxisMetadata):   # an unannotated kernel: replicated, as it is
      return ad
    a, b = ad[lora_ops.A], ad[lora_ops.B]
    a_axes, b_axes = lora_ops.axes(p.names, a.ndim, b.ndim)
    return {lora_ops.A: p.replace(value=a, names=a_axes), lora_ops.B: p.replace(value=b, names=b_axes)}
  return walk(adapters, boxed_params)


def _fit_boxes(opt_state: Any) -> Any:
  """Optimizer-state leaves keep their param's logical box; one that is not param-shaped (Adafactor's
  factored row/column moments: fewer dims than axis names) is unboxed, i.e. replicated."""
  def fit(x: Any) -> Any:
    if isinstance(x, nn.meta.AxisMetadata) and len(x.names) > jnp.ndim(x.value):
      return x.value
    return x
  return jax.tree.map(fit, opt_state, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))


def state_shardings(init: Any, rng: jax.Array, mesh: jax.sharding.Mesh, rules) -> tuple[Any, Any]:
  """(abstract unboxed state, NamedShardings) from the logical axis names the model annotated."""
  abstract_boxed = jax.eval_shape(init, rng)
  specs = nn.get_partition_spec(abstract_boxed)
  shardings = nn.logical_to_mesh_sharding(specs, mesh, rules)
  abstract = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                          unbox_plain(abstract_boxed), shardings)
  return abstract, shardings


def unbox_plain(tree: Any) -> Any:
  """Strip nn.Partitioned boxes without applying sharding constraints (for abstract trees)."""
  return jax.tree.map(lambda x: x.unbox(apply_constraint=False) if isinstance(x, nn.meta.AxisMetadata) else x,
                      tree, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))


def create_state(init: Any, rng: jax.Array, shardings: Any, **given: Any) -> TrainState:
  """Initialise straight into shards: nothing is ever materialised on one device first. `given`: state
  fields already on their devices (a fine-tune's loaded weights: params, or a LoRA run's frozen base),
  taken as they are (donated); their own random init is then dead code XLA never runs."""
  def make(r: jax.Array, fields: dict) -> TrainState:
    return nn.unbox(init(r)).replace(**fields)
  return jax.jit(make, out_shardings=shardings, donate_argnums=(1,))(rng, given)


def param_count(params: Any) -> int:
  return int(sum(x.size for x in jax.tree.leaves(params)))
