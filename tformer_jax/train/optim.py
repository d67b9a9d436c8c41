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
optimizers (optim.name: adamw | adafactor | lion | sgd | muon: `optax.contrib`'s Muon pieces) and
clipping. Gradient accumulation is not
`optax.MultiSteps`: MultiSteps averages one micro-batch per *call* across train steps, each
micro-batch mean weighted equally; `accumulate_gradients` runs all micro-batches inside one step and
weights them by their real (unmasked) tokens, so a step's gradient is exactly the whole batch's
token mean even with padding, and a train step is an optimizer step. With equal token counts the
two agree (tests/test_optim.py checks it).
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from optax import contrib as optax_contrib
from optax.contrib import _muon as optax_muon  # scale_by_shape: optax.contrib.muon's RMS step, not exported
from optax.transforms import _masking

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
                         "wq_a", "wq_b", "wkv_a", "wkv_b", "eh_proj",       # MLA, multi-token prediction
                         "kernel"}),                  # (flax's own nn.Dense / DenseGeneral name)
    "embedding": frozenset({"embed", "pos_embed", "type_embed", "rel_bias",
                            "embedding"}),            # (flax's nn.Embed)
    "bias": frozenset({"bq_a", "bkv_a", "bq", "bk", "bv", "bo", "bi", "bg",
                       "router_bias", "correction_bias", "b_gate", "b_up", "b_down", "b_in", "b_out"}),   # MoE
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


def wsd_decay_start(optim_cfg: Any, total_steps: int) -> int:
  """The step where the wsd schedule's decay begins: total_steps - round(decay_fraction * total_steps)."""
  return total_steps - int(round(float(_opt(optim_cfg, "decay_fraction", 0.2)) * total_steps))


def make_schedule(optim_cfg: Any, total_steps: int, decay_start: int | None = None) -> optax.Schedule:
  """Linear warmup 0 -> peak_lr over the warmup steps, then cosine | rsqrt | constant | wsd (optax).

  cosine: half-cosine from peak_lr at the end of warmup down to min_lr_ratio * peak_lr at
    `total_steps`, constant at that floor afterwards (`optax.warmup_cosine_decay_schedule`).
  rsqrt: peak_lr * sqrt(w / step) after warmup, with w = max(warmup, 1) (so no warmup means
    peak_lr at steps 0 and 1, then 1/sqrt decay).
  constant: peak_lr after warmup.
  wsd (warmup-stable-decay; MiniCPM, Hägele et al. 2024): peak_lr from the end of warmup until
    `decay_start` (default `wsd_decay_start`: the last decay_fraction of the steps decay; a branched
    cooldown passes the step it branched from), then down to min_lr_ratio * peak_lr at total_steps along
    decay_shape: linear | cosine | 1-sqrt (1 - sqrt(fraction of the decay done)). The phase boundaries are
    exact: schedule(warmup) = schedule(decay_start) = peak_lr, schedule(total_steps) = the floor.
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
  elif kind == "wsd":
    start = wsd_decay_start(optim_cfg, total_steps) if decay_start is None else int(decay_start)
    after = _wsd_after(peak, min_lr, warm, start, total_steps, str(_opt(optim_cfg, "decay_shape", "linear")))
  else:
    raise ValueError(f"optim.schedule: unknown value {kind!r}; expected cosine, rsqrt, constant or wsd")
  if warm == 0:
    return after
  return optax.join_schedules([optax.linear_schedule(0.0, peak, warm), after], [warm])


def _wsd_after(peak: float, floor: float, warm: int, start: int, total: int, shape: str) -> optax.Schedule:
  """The wsd schedule after warmup, as a function of the steps since warmup ended (join_schedules)."""
  if shape not in ("linear", "cosine", "1-sqrt"):
    raise ValueError(f"optim.decay_shape: unknown value {shape!r}; expected linear, cosine or 1-sqrt")
  length = max(total - start, 1)

  def after(count):
    step = jnp.asarray(count, jnp.float32) + warm
    frac = jnp.clip((step - start) / length, 0.0, 1.0)
    if shape == "linear":
      left = 1.0 - frac
    elif shape == "cosine":
      left = 0.5 * (1.0 + jnp.cos(jnp.pi * frac))
    else:
      left = 1.0 - jnp.sqrt(frac)
    return jnp.where(step <= start, peak, jnp.where(frac >= 1.0, floor, floor + (peak - floor) * left))

  return after


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


def make_optimizer(optim_cfg: Any, total_steps: int, backend: backends.Backend | None = None, *,
                   param_axes: dict[str, tuple] | None = None, decay_start: int | None = None
                   ) -> tuple[optax.GradientTransformationExtraArgs, optax.Schedule]:
  """(tx, schedule): clip_by_global_norm (if clip_norm > 0), then the optimizer of optim.name with
  weight decay on `decay_mask`, skipping non-finite steps (`skip_nonfinite`).

    adamw      optax.adamw(b1, b2, eps, weight_decay); the backend may run it its own way (the
               xla_cpu backend: one C++ pass per array, same state tree)
    adafactor  optax.adafactor (factored second moments, no first moment), decay weight_decay
    lion       optax.lion(b1, b2, weight_decay) (use a ~3-10x smaller peak_lr than AdamW)
    sgd        optax.sgd(momentum) (0 = plain SGD), with weight_decay * param added to the gradient
               before it (optax.add_decayed_weights: classic SGD weight decay)
    muon       Muon on the hidden matrices, AdamW on the rest (`make_muon`)

  param_axes: {param path: logical axis names} (`logical_axes`), which Muon reads its matrices'
  reduction and output axes from; None: taken from the boxed parameters `tx.init` is given.
  decay_start: the wsd schedule's decay start (a branched cooldown's step; `make_schedule`).

  Gradient accumulation is not inside `tx`: use `accumulate_gradients` in the train step.
  `schedule(step)` gives the learning rate for logging (see the module docstring for the step
  convention).
  """
  name = str(optim_cfg["name"])
  if name not in OPTIMIZERS:
    raise ValueError(f"optim.name: unknown value {name!r}; expected one of {', '.join(OPTIMIZERS)}")
  schedule = make_schedule(optim_cfg, total_steps, decay_start)
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
  elif name == "muon":
    parts.append(make_muon(optim_cfg, schedule, mask, param_axes))
  else:
    if wd:
      parts.append(optax.add_decayed_weights(wd, mask))
    parts.append(optax.sgd(learning_rate=schedule, momentum=float(_opt(optim_cfg, "momentum", 0.9)) or None))
  return skip_nonfinite(optax.chain(*parts)), schedule


# Muon (Keller Jordan's speedruns; Liu et al. 2025, "Muon is scalable"): which parameters, and how each is a
# matrix. The hidden matrices by name: attention q/k/v/o, the dense FFN and the experts' matrices. The
# embeddings, the LM head, the MoE router, norms and biases train with AdamW (as MaxText and the papers split).
MUON_NAMES = PARAM_ROLES["kernel"] - {"head", "router", "kernel"}
BATCH_AXES = ("layers", "expert")    # logical axes of a stack of matrices: each slice orthogonalised alone
# a matrix whose first (non-batch) axis is one of these reads it: the residual stream, MLA's latents, the MTP
# modules' concatenated [embedding ; hidden]
READS_FIRST = ("embed", "q_lora", "kv_lora", "embed_concat")


def muon_dims(names: tuple) -> optax_contrib.MuonDimensionNumbers:
  """A hidden weight's (reduction, output) axes from its logical axis names: 'layers' and 'expert' are
  batch axes (a stack of matrices); a weight whose first other axis is 'embed' reads the residual stream
  (q/k/v (embed, heads, kv), FFN in (embed, mlp)): reduction 'embed', output the rest; otherwise it writes
  into it (o (heads, kv, embed), FFN out (mlp, embed)): output the last axis, reduction the others."""
  rest = [i for i, n in enumerate(names) if n not in BATCH_AXES]
  if len(rest) < 2:
    raise ValueError(f"muon: a weight with logical axes {names} is not a matrix (or a stack of matrices)")
  if names[rest[0]] in READS_FIRST:
    return optax_contrib.MuonDimensionNumbers(reduction_axis=(rest[0],), output_axis=tuple(rest[1:]))
  return optax_contrib.MuonDimensionNumbers(reduction_axis=tuple(rest[:-1]), output_axis=(rest[-1],))


def _path_key(path: tuple) -> str:
  return "/".join(str(e.key) for e in path if isinstance(e, jax.tree_util.DictKey))


def _is_box(x: Any) -> bool:
  return isinstance(x, nn.meta.AxisMetadata)


def logical_axes(boxed_params: Any) -> dict[str, tuple]:
  """{'layers_0/attn/wq': ('embed', 'heads', 'kv'), ...}: each boxed parameter's logical axis names."""
  flat = jax.tree_util.tree_flatten_with_path(boxed_params, is_leaf=_is_box)[0]
  return {_path_key(p): tuple(x.names) for p, x in flat if _is_box(x)}


def muon_labels(params: Any, axes: dict[str, tuple] | None = None) -> Any:
  """'muon' or 'adam' for each parameter (a tree like `params`, boxes kept): Muon for MUON_NAMES, AdamW for
  everything else; with logical axes known (`axes`, or the params' own boxes), a MUON_NAMES parameter without
  any (a user's unannotated module) goes to AdamW too."""
  def label(path, x):
    if _param_name(path) not in MUON_NAMES:
      return "adam"
    names = axes.get(_path_key(path)) if axes else (tuple(x.names) if _is_box(x) else ())
    return "muon" if names is not None else "adam"
  return jax.tree_util.tree_map_with_path(label, params, is_leaf=_is_box)


def make_muon(optim_cfg: Any, schedule: optax.Schedule, decay: Callable[[PyTree], PyTree],
              param_axes: dict[str, tuple] | None = None) -> optax.GradientTransformation:
  """Muon (optax.contrib's scale_by_muon: Nesterov momentum muon_beta, muon_ns_steps Newton-Schulz steps
  on each matrix, its axes from `muon_dims`; then optax.contrib.scale_by_shape: update RMS muon_rms, or
  width scaling when 0) on the hidden matrices, AdamW (b1, b2, eps) on the rest; both at the schedule's
  learning rate, weight decay by role (`decay_mask`: every Muon matrix is a decayed kernel).
  optax.contrib.muon itself decays all of its AdamW part (norms and biases too): its pieces are combined
  here the same way, with the decay mask. param_axes None: the logical axes are read from the boxed params
  that `init` is given (and kept for `update`, which sees plain arrays); an init on plain arrays (a state's
  size) labels by name alone."""
  axes: dict[str, tuple] = dict(param_axes) if param_axes is not None else {}

  def labels(params):
    if param_axes is None and any(_is_box(x) for x in jax.tree.leaves(params, is_leaf=_is_box)):
      axes.update(logical_axes(params))
    return muon_labels(params, axes)

  def dims(updates):   # the muon part's tree: MaskedNode where AdamW's parameters are
    def one(path, x):
      if isinstance(x, _masking.MaskedNode):
        return x
      if _path_key(path) not in axes:
        raise ValueError(f"optim.name=muon: no logical axes for {_path_key(path)!r} (pass make_optimizer "
                         "param_axes=logical_axes(boxed params), or init the optimizer on boxed params)")
      return muon_dims(axes[_path_key(path)])
    return jax.tree_util.tree_map_with_path(one, updates, is_leaf=lambda x: isinstance(x, _masking.MaskedNode))

  wd, rms = float(optim_cfg["weight_decay"]), float(_opt(optim_cfg, "muon_rms", 0.2))
  muon_part = optax.chain(
      optax_contrib.scale_by_muon(ns_steps=int(_opt(optim_cfg, "muon_ns_steps", 5)),
                                  beta=float(_opt(optim_cfg, "muon_beta", 0.95)), weight_dimension_numbers=dims),
      optax_muon.scale_by_shape(weight_dimension_numbers=dims, consistent_rms=rms or None),
      optax.add_decayed_weights(wd),
      optax.scale_by_learning_rate(schedule))
  adam_part = optax.adamw(learning_rate=schedule, b1=float(optim_cfg["b1"]), b2=float(optim_cfg["b2"]),
                          eps=float(optim_cfg["eps"]), weight_decay=wd, mask=decay)
  return optax.partition({"muon": muon_part, "adam": adam_part}, labels)


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
