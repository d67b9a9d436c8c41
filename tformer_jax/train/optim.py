"""Optimizer pieces: learning-rate schedules, the weight-decay mask, the optimizers, gradient accumulation.

Everything reads the `optim` section of `default_config()`:

  tx, schedule = make_optimizer(cfg.optim, total_steps=cfg.train.steps)
  opt_state = tx.init(params)
  ...
  (loss, aux), grads = accumulate_gradients(loss_and_grad_fn, params, batch, rng, cfg.optim.grad_accum)
  norm, clipped_norm = grad_norms(grads, cfg.optim.clip_norm)      # metrics only
  updates, opt_state = tx.update(grads, opt_state, params, finite=finite, grad_norm=norm)
  params = optax.apply_updates(params, updates)
  lr = schedule(step)                                               # the lr this update used

Step convention: optax evaluates the schedule at its internal update count, i.e. the update with
0-based index `s` (the number of updates already applied) uses `schedule(s)`. With warmup the very
first update therefore has lr 0, and `schedule(warmup)` is the first update at `peak_lr`.

Built from optax: the schedules (`optax.warmup_cosine_decay_schedule`, `join_schedules`), the
optimizers (optim.name: adamw | adafactor | lion | sgd) and clipping. Gradient accumulation is not
`optax.MultiSteps`: MultiSteps averages one micro-batch per *call* across train steps, each
micro-batch mean weighted equally; `accumulate_gradients` runs all micro-batches inside one step and
weights them by their real (unmasked) tokens, so a step's gradient is exactly the whole batch's
token mean even with padding, and a train step is an optimizer step. With equal token counts the
two agree (tests/test_optim.py checks it).
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from tformer_jax import backends
from tformer_jax.config import OPTIMIZERS
from tformer_jax.train import precision

PyTree = Any

# Every parameter name in tformer_jax.nn, by role. Weight decay follows the role, not the rank: a
# stacked (num_layers, d) norm scale or a (heads, head_dim) q/k/v bias is never decayed.
PARAM_ROLES = {
    "kernel": frozenset({"wq", "wk", "wv", "wo", "wi", "wg", "head", "router", "w_up", "w_gate", "w_down",
                         "w_in", "w_out", "shared_w_in", "shared_w_out", "shared_w_up", "shared_w_gate",
                         "shared_w_down",                                   # MoE experts, shared expert
                         "kernel"}),                  # (flax's own nn.Dense / DenseGeneral name)
    "embedding": frozenset({"embed", "pos_embed", "type_embed", "rel_bias",
                            "embedding"}),            # (flax's nn.Embed)
    "bias": frozenset({"bq", "bk", "bv", "bo", "bi", "bg"}),
    "norm": frozenset({"scale", "bias"}),
}


def warmup_steps(optim_cfg: Any, total_steps: int) -> int:
  """The effective warmup length: round(warmup_fraction * total_steps) when the fraction is > 0, else
  warmup_steps, clamped to a tenth of total_steps when it is not shorter than the run
  (`config.warmup_note` says so in one line)."""
  frac = float(optim_cfg["warmup_fraction"])
  if frac > 0:
    return int(round(frac * total_steps))
  warm = int(optim_cfg["warmup_steps"])
  return total_steps // 10 if 0 < total_steps <= warm else warm


def make_schedule(optim_cfg: Any, total_steps: int) -> optax.Schedule:
  """Linear warmup 0 -> peak_lr over the warmup steps, then cosine | rsqrt | constant (optax).

  cosine: half-cosine from peak_lr at the end of warmup down to min_lr_ratio * peak_lr at
    `total_steps`, constant at that floor afterwards (`optax.warmup_cosine_decay_schedule`).
  rsqrt: peak_lr * sqrt(w / step) after warmup, with w = max(warmup, 1) (so no warmup means
    peak_lr at steps 0 and 1, then 1/sqrt decay).
  constant: peak_lr after warmup.
  The returned function is jit-friendly (step may be a traced int).
  """
  peak = float(optim_cfg["peak_lr"])
  kind = str(optim_cfg["schedule"])
  min_lr = float(optim_cfg["min_lr_ratio"]) * peak
  warm = warmup_steps(optim_cfg, total_steps)
  if kind == "cosine":
    return optax.warmup_cosine_decay_schedule(0.0, peak, warm, max(total_steps, warm + 1), min_lr)
  if kind == "rsqrt":
    w = float(max(warm, 1))
    after = lambda s: peak * jnp.sqrt(w / jnp.maximum(jnp.asarray(s, jnp.float32) + warm, w))  # noqa: E731
  elif kind == "constant":
    after = optax.constant_schedule(peak)
  else:
    raise ValueError(f"optim.schedule: unknown value {kind!r}; expected cosine, rsqrt or constant")
  if warm == 0:
    return after
  return optax.join_schedules([optax.linear_schedule(0.0, peak, warm), after], [warm])


def _param_name(path: tuple) -> str:
  """The last dict key on a pytree path (skips the `.value` of flax boxed params)."""
  for entry in reversed(path):
    if isinstance(entry, jax.tree_util.DictKey):
      return str(entry.key)
  return ""


def param_role(path: tuple, x: Any = None, *, strict: bool = False) -> str:
  """'kernel' | 'embedding' | 'bias' | 'norm' for a parameter path, by its name (PARAM_ROLES: every
  name tformer_jax.nn uses, and flax's own). A name outside the tables (a user's own module) falls
  back to its rank, ndim >= 2 -> 'kernel' else 'bias'; strict=True raises ValueError instead (the
  tests check that every parameter of every shipped preset has a named role)."""
  name = _param_name(path)
  for role, names in PARAM_ROLES.items():
    if name in names:
      return role
  if strict or x is None:
    raise ValueError(f"parameter {jax.tree_util.keystr(path)}: no weight-decay role for the name {name!r}; "
                     "add it to tformer_jax.train.optim.PARAM_ROLES")
  return "kernel" if jnp.ndim(x) >= 2 else "bias"


def decay_mask(params: PyTree, decay_embeddings: bool = True) -> PyTree:
  """True where weight decay applies, by parameter role (`param_role`): kernels always, embeddings
  (token, position, type and relative-bias tables) when decay_embeddings (GPT-2/nanoGPT-style
  AdamW decays them), biases and norm scales/biases never, whatever their rank.

  Works on plain param dicts and on trees holding flax boxed params (nn.Partitioned /
  nn.LogicallyPartitioned): the result has the same structure, boxes included, so it can be handed
  to optax as is.
  """
  decayed = {"kernel"} | ({"embedding"} if decay_embeddings else set())
  return jax.tree_util.tree_map_with_path(lambda path, x: param_role(path, x) in decayed, params)


def make_optimizer(optim_cfg: Any, total_steps: int, backend: backends.Backend | None = None
                   ) -> tuple[optax.GradientTransformationExtraArgs, optax.Schedule]:
  """(tx, schedule): clip_by_global_norm (if clip_norm > 0), then the optimizer of optim.name with
  weight decay on `decay_mask`, skipping non-finite steps (`skip_nonfinite`).

    adamw      optax.adamw(b1, b2, eps, weight_decay); the backend may run it its own way (the
               xla_cpu backend: one C++ pass per array, same state tree)
    adafactor  optax.adafactor (factored second moments, no first moment), decay weight_decay
    lion       optax.lion(b1, b2, weight_decay) (use a ~3-10x smaller peak_lr than AdamW)
    sgd        optax.sgd(momentum) (0 = plain SGD), with weight_decay * param added to the gradient
               before it (optax.add_decayed_weights: classic SGD weight decay)

  Gradient accumulation is not inside `tx`: use `accumulate_gradients` in the train step.
  `schedule(step)` gives the learning rate for logging (see the module docstring for the step
  convention).
  """
  name = str(optim_cfg["name"])
  if name not in OPTIMIZERS:
    raise ValueError(f"optim.name: unknown value {name!r}; expected one of {', '.join(OPTIMIZERS)}")
  schedule = make_schedule(optim_cfg, total_steps)
  clip = float(optim_cfg["clip_norm"])
  wd = float(optim_cfg["weight_decay"])
  b1, b2 = float(optim_cfg["b1"]), float(optim_cfg["b2"])
  mask = functools.partial(decay_mask, decay_embeddings=bool(_opt(optim_cfg, "decay_embeddings", True)))
  parts = [optax.clip_by_global_norm(clip)] if clip > 0 else []
  if name == "adamw":
    spec = backends.AdamWSpec(schedule=schedule, b1=b1, b2=b2, eps=float(optim_cfg["eps"]),
                              weight_decay=wd, clip_norm=clip, decay_mask=mask)
    parts.append(optax.adamw(learning_rate=schedule, b1=b1, b2=b2, eps=spec.eps, weight_decay=wd, mask=mask))
    tx = skip_nonfinite(optax.chain(*parts))
    return (backend or backends.current()).wrap_optimizer(tx, spec), schedule
  if name == "adafactor":
    parts.append(optax.adafactor(learning_rate=schedule, weight_decay_rate=wd or None, weight_decay_mask=mask))
  elif name == "lion":
    parts.append(optax.lion(learning_rate=schedule, b1=b1, b2=b2, weight_decay=wd, mask=mask))
  else:
    if wd:
      parts.append(optax.add_decayed_weights(wd, mask))
    parts.append(optax.sgd(learning_rate=schedule, momentum=float(_opt(optim_cfg, "momentum", 0.9)) or None))
  return skip_nonfinite(optax.chain(*parts)), schedule


def _opt(cfg: Any, name: str, default: Any) -> Any:
  """An optional field (configs written before it existed)."""
  try:
    return cfg[name]
  except (KeyError, AttributeError):
    return default


def skip_nonfinite(tx: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
  """tx whose update is zero and whose state stays as it was when the step is not finite (extra
  arg `finite`; default: every gradient finite). Same state tree as tx: no counter is added."""

  def update(grads: PyTree, state: Any, params: PyTree | None = None, *,
             finite: jax.Array | None = None, **extra) -> tuple[PyTree, Any]:
    del extra
    finite = precision.all_finite(grads) if finite is None else finite
    updates, new_state = tx.update(grads, state, params)
    zeros = jax.tree.map(jnp.zeros_like, updates)
    return precision.select_tree(finite, updates, zeros), precision.select_tree(finite, new_state, state)

  return optax.GradientTransformationExtraArgs(tx.init, update)


def grad_norms(grads: PyTree, clip_norm: float) -> tuple[jax.Array, jax.Array]:
  """(global norm before clipping, global norm after clip_by_global_norm(clip_norm)).

  The second equals optax.tree.norm(clipped grads) (min(norm, clip_norm)); clip_norm <= 0
  means no clipping, so both are equal.
  """
  norm = optax.tree.norm(grads)
  if clip_norm <= 0:
    return norm, norm
  return norm, jnp.minimum(norm, jnp.asarray(clip_norm, norm.dtype))


def split_micro_batches(batch: PyTree, num_micro: int) -> PyTree:
  """(B, ...) leaves -> (num_micro, B // num_micro, ...), micro-batch i = rows i, i + M, i + 2M, ...

  Strided (not contiguous) so that a batch sharded along its leading axis keeps every micro-batch
  spread over all data-parallel devices.
  """
  def split(x: jax.Array) -> jax.Array:
    b = x.shape[0]
    if b % num_micro:
      raise ValueError(f"batch size {b} is not divisible by num_micro={num_micro}")
    x = x.reshape((b // num_micro, num_micro) + x.shape[1:])
    return jnp.swapaxes(x, 0, 1)

  return jax.tree.map(split, batch)


LossAndGradFn = Callable[[PyTree, PyTree, jax.Array], tuple[tuple[jax.Array, tuple[jax.Array, PyTree]],
                                                              PyTree]]


def accumulate_gradients(loss_and_grad_fn: LossAndGradFn, params: PyTree, batch: PyTree,
                         rng: jax.Array | None, num_micro: int
                         ) -> tuple[tuple[jax.Array, PyTree], PyTree]:
  """Sum-form gradient accumulation over `num_micro` micro-batches with lax.scan.

  `loss_and_grad_fn(params, micro_batch, rng) -> ((loss_sum, (count, aux)), grads_of_loss_sum)`,
  e.g. `jax.value_and_grad(f, has_aux=True)` of an f returning (sum(loss * mask), (sum(mask), aux)).
  Returns `((loss, aux), grads)` with loss = sum(loss_sum) / sum(count) and grads the same ratio,
  i.e. exactly the token-weighted mean over the whole batch even when micro-batches hold different
  numbers of real tokens; aux is the mean over micro-batches. For a plain mean-loss fn, return
  count = 1: the result is then the mean of the micro-batch means. A total count of 0 gives 0.

  The batch's leading axis is split by `split_micro_batches` (strided). Micro-batch i gets
  rng fold_in(rng, i); with num_micro == 1 the fn is called once, on the whole batch, with rng
  itself (no scan): grad_accum=1 is exactly one call on the whole batch.
  """
  if num_micro < 1:
    raise ValueError(f"num_micro must be >= 1, got {num_micro}")
  if num_micro == 1:
    (loss_sum, (count, aux)), grads = loss_and_grad_fn(params, batch, rng)
    return _normalise(loss_sum, count, aux, grads)

  micro = split_micro_batches(batch, num_micro)
  first = jax.tree.map(lambda x: x[0], micro)
  rng0 = None if rng is None else jax.random.fold_in(rng, 0)
  _, grads_shape = jax.eval_shape(loss_and_grad_fn, params, first, rng0)
  grads0 = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), grads_shape)

  def body(grads_acc: PyTree, xs: tuple[jax.Array, PyTree]) -> tuple[PyTree, tuple]:
    i, mb = xs
    r = None if rng is None else jax.random.fold_in(rng, i)
    (loss_sum, (count, aux)), grads = loss_and_grad_fn(params, mb, r)
    grads_acc = jax.tree.map(jnp.add, grads_acc, grads)
    return grads_acc, (loss_sum, count, aux)

  grads_sum, (loss_sums, counts, auxs) = jax.lax.scan(
      body, grads0, (jnp.arange(num_micro), micro))
  aux = jax.tree.map(lambda a: jnp.mean(jnp.asarray(a, jnp.float32), axis=0), auxs)
  return _normalise(jnp.sum(loss_sums), jnp.sum(counts), aux, grads_sum)


def _normalise(loss_sum: jax.Array, count: jax.Array, aux: PyTree, grads: PyTree
               ) -> tuple[tuple[jax.Array, PyTree], PyTree]:
  count = jnp.asarray(count, jnp.float32)
  denom = jnp.where(count > 0, count, 1.0)
  loss = jnp.asarray(loss_sum, jnp.float32) / denom
  grads = jax.tree.map(lambda g: (g / denom).astype(g.dtype), grads)
  return (loss, aux), grads
