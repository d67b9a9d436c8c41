"""What a training run compiles, built from the config without allocating an array.

  program = build(cfg, mesh, backend, vocab_size=ds.vocab_size)
  program.abstract          # the TrainState as ShapeDtypeStructs carrying their NamedShardings
  program.train_step        # jit(in_shardings=(state, batch), out_shardings=(state, None), donate state)
  program.train_step.lower(program.abstract, abstract_batch(cfg, mesh)).compile()   # ahead of time

train/loop.py runs `train_step` on arrays; tformer_jax/aot/ lowers the very same function on abstract
inputs for a TPU topology. One builder serves both, so the compiled figures are those of the step the
loop runs: same model config (train.precision applied), logical-axis rules, optimizer and state tree,
shardings, donation, remat/scan. Nothing here touches data, a workdir or device memory: `init` is only
traced (jax.eval_shape) for the abstract state; the loop materialises it with `state.create_state`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import optax
from jax.sharding import Mesh, NamedSharding

from tformer_jax import backends, config as config_lib
from tformer_jax.config.validate import parse_branch_from
from tformer_jax.nn import Transformer
from tformer_jax.ops import lora as lora_ops
from tformer_jax.parallel import mesh as mesh_lib, pmap as pmap_lib, rules as rules_lib
from tformer_jax.train import optim, precision, state as state_lib, step as step_lib
from tformer_jax.train.stats import make_stats_fn

Step = Callable[..., Any]


@dataclasses.dataclass(frozen=True)
class TrainProgram:
  """The compiled pieces of a run and everything they were built from."""
  model_config: config_lib.ModelConfig
  model: Transformer
  mesh: Mesh
  rules: rules_lib.Rules
  tx: optax.GradientTransformation
  schedule: optax.Schedule
  init: Callable[[jax.Array], state_lib.TrainState]  # rng -> boxed state (materialise: state.create_state)
  abstract: state_lib.TrainState                     # ShapeDtypeStructs with their shardings
  shardings: state_lib.TrainState                    # NamedShardings of the state
  batch_sharding: NamedSharding
  train_step: Step                                   # (state, batch) -> (state, metrics); state donated
  eval_step: Step                                    # (params, batch) -> {nll_sum, count, correct}
  stats_step: Step | None                            # (state, batch) -> layer statistics (train.stats_every)
  lora_scale: float | None = None                    # a LoRA run: alpha / rank (state.params = the adapters)

  def eval_params(self, state: state_lib.TrainState) -> Any:
    """What eval_step takes: the params, or (frozen base, adapters) for a LoRA run (merged inside)."""
    return state.params if self.lora_scale is None else (state.frozen, state.params)

  def full_params(self, state: state_lib.TrainState) -> Any:
    """The model's parameters: a LoRA run's adapters merged into its base (ops/lora.py)."""
    if self.lora_scale is None:
      return state.params
    return jax.jit(functools.partial(lora_ops.merge, scale=self.lora_scale))(state.frozen, state.params)


def lora_settings(cfg: ml_collections.ConfigDict) -> tuple[tuple[str, ...], int, float] | None:
  """(targets, rank, alpha / rank) of train.lora, or None when it is off (rank 0 or absent)."""
  lo = cfg.train.get("lora")
  if lo is None or int(lo.get("rank", 0)) <= 0:
    return None
  return lora_ops.parse_targets(lo.targets), int(lo.rank), float(lo.alpha) / int(lo.rank)


def resolve_model_config(cfg: ml_collections.ConfigDict, vocab_size: int | None = None, *,
                         check_paths: bool = True) -> config_lib.ModelConfig:
  """Validated ModelConfig, with the precision policy's compute dtype applied. check_paths=False: the
  run's files (corpus, tokenizer, init_from) need not exist here (ahead-of-time compilation)."""
  m = config_lib.validate(cfg, check_paths=check_paths)
  if m.vocab_size == 0 and vocab_size is not None:   # model.vocab_size left to the tokenizer (a synthetic task)
    m = dataclasses.replace(m, vocab_size=vocab_size)
  config_lib.validate_model(m)
  policy = precision.get_policy(cfg.train.precision)
  m = dataclasses.replace(m, **policy.model_overrides())
  if vocab_size is not None and m.vocab_size < vocab_size:
    raise config_lib.ConfigError(f"model.vocab_size: {m.vocab_size} is smaller than the tokenizer's "
                                 f"vocabulary ({vocab_size}); set --config.model.vocab_size={vocab_size}")
  return m


def build(cfg: ml_collections.ConfigDict, mesh: Mesh, backend: backends.Backend, *,
          vocab_size: int | None = None, check_paths: bool = True) -> TrainProgram:
  """The run's model, optimizer, abstract sharded state and jitted (or pmapped) steps over `mesh`.

  Raises ConfigError for a layout the mesh cannot split (batch, heads, experts, any parameter
  dimension) before anything compiles. Trace the steps under `backends.use(backend)`."""
  mesh_lib.check_layout(cfg, mesh)
  m = resolve_model_config(cfg, vocab_size, check_paths=check_paths)
  rules = rules_lib.get_rules(cfg.mesh.rules, mesh.axis_names)
  model = Transformer(m)
  _, branch_step = parse_branch_from(cfg.train.get("branch_from", ""))
  tx, schedule = optim.make_optimizer(cfg.optim, cfg.train.steps, backend, decay_start=branch_step)
  policy = precision.get_policy(cfg.train.precision)
  lora = lora_settings(cfg)
  init = state_lib.init_fn(model, tx, policy.initial_loss_scale(), cfg.data.seq_len,
                           lora=lora[:2] if lora else None)
  rng = jax.ShapeDtypeStruct((2,), jnp.uint32)   # a PRNGKey's shape: the state is only traced here
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    try:
      abstract, shardings = state_lib.state_shardings(init, rng, mesh, rules)
    except lora_ops.NoTargets as e:
      raise config_lib.ConfigError(f"train.lora.targets: {e}") from None
    except lora_ops.RankTooLarge as e:
      raise config_lib.ConfigError(f"train.lora.rank: {e}") from None
  mesh_lib.check_shardings(abstract, mesh)

  batch_sh = mesh_lib.batch_sharding(mesh)
  eval_fn = functools.partial(step_lib.eval_step, model=model, **step_options(cfg))
  options = train_step_options(cfg)
  eval_in = shardings.params
  if lora:   # (frozen base, adapters) -> the merged model's eval sums
    base_eval, eval_in = eval_fn, (shardings.frozen, shardings.params)
    eval_fn = lambda pair, batch: base_eval(lora_ops.merge(*pair, scale=lora[2]), batch)  # noqa: E731
    options = {**options, "lora_scale": lora[2]}
  stats_step = None
  if cfg.mesh.parallelism == "pmap":  # replicated state, batch split over local devices (parallel/pmap.py)
    train_step = pmap_lib.make_train_step(
        step_lib.make_train_step(model, tx, schedule, cfg.optim, axis_name=pmap_lib.AXIS, **options), mesh,
        shardings)
    eval_step = pmap_lib.make_eval_step(eval_fn, mesh)
  else:  # traced under the rules, so the model's activation constraints take effect
    train_step = jax.jit(mesh_lib.traced_under(step_lib.make_train_step(model, tx, schedule, cfg.optim, **options),
                                               mesh, rules),
                         in_shardings=(shardings, batch_sh), out_shardings=(shardings, None), donate_argnums=(0,))
    eval_step = jax.jit(mesh_lib.traced_under(eval_fn, mesh, rules), in_shardings=(eval_in, batch_sh))
    if int(cfg.train.get("stats_every", 0)) > 0:  # layer statistics, train/stats.py
      stats_fn = make_stats_fn(model, tx, lora_scale=lora[2] if lora else None)   # a LoRA run: the merged model
      stats_step = jax.jit(mesh_lib.traced_under(stats_fn, mesh, rules),
                           in_shardings=(shardings, batch_sh))
  return TrainProgram(m, model, mesh, rules, tx, schedule, init, abstract, shardings, batch_sh,
                      train_step, eval_step, stats_step, lora[2] if lora else None)


def step_options(cfg: ml_collections.ConfigDict) -> dict[str, Any]:
  """make_train_step's options from the config: train.loss_chunk > 0, the chunked loss (train/step.py)."""
  chunk = int(cfg.train.get("loss_chunk", 0) or 0)
  return {"loss_chunk": chunk} if chunk > 0 else {}


def train_step_options(cfg: ml_collections.ConfigDict) -> dict[str, Any]:
  """step_options, plus what only the train step takes: train.logit_z_loss > 0, and train.mtp_loss_weight
  for a model with multi-token prediction (model.mtp_depth > 0)."""
  z = float(cfg.train.get("logit_z_loss", 0.0) or 0.0)
  mtp = float(cfg.train.get("mtp_loss_weight", 0.0) or 0.0) if int(cfg.model.get("mtp_depth", 0) or 0) > 0 else 0.0
  return {**step_options(cfg), **({"z_loss": z} if z > 0 else {}), **({"mtp_weight": mtp} if mtp > 0 else {})}


def batch_spec(data_cfg: Any) -> dict[str, tuple[tuple[int, ...], Any]]:
  """{key: (global shape, dtype)} of one training batch as data.pipeline yields it: 'inputs' and
  'targets' int32 (batch_size, seq_len); document packing adds 'segment_ids', 'positions' (int32) and a
  float32 'loss_mask'; synthetic tasks add a 'loss_mask'."""
  shape = (int(data_cfg.batch_size), int(data_cfg.seq_len))
  spec: dict[str, tuple[tuple[int, ...], Any]] = {"inputs": (shape, jnp.int32), "targets": (shape, jnp.int32)}
  if data_cfg.get("packing", "packed") == "document":
    spec.update(segment_ids=(shape, jnp.int32), positions=(shape, jnp.int32), loss_mask=(shape, jnp.float32))
  elif str(data_cfg.get("corpus", "")).startswith("synthetic:"):
    spec["loss_mask"] = (shape, jnp.float32)
  return spec


def abstract_batch(cfg: ml_collections.ConfigDict, mesh: Mesh) -> dict[str, jax.ShapeDtypeStruct]:
  """One global training batch (`batch_spec`) as ShapeDtypeStructs, sharded as the loop shards it."""
  sh = mesh_lib.batch_sharding(mesh)
  return {k: jax.ShapeDtypeStruct(shape, dtype, sharding=sh) for k, (shape, dtype) in batch_spec(cfg.data).items()}
