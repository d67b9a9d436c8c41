"""Pure train and eval steps. `train_step(state, batch) -> (state, metrics)`; the loop jits them with
shardings and donation. Loss: token-mean cross-entropy in float32 (+ MoE aux losses), masked by
batch['loss_mask'] when present. Encoders (causal=False) train and evaluate on BERT's masked LM:
train/objectives.py rewrites the batch first (inputs masked, loss on the chosen tokens; eval_step's
`correct` is then the masked-token accuracy).

loss_chunk (train.loss_chunk) > 0: the loss never holds the full (tokens x vocab) float32 logits; it
takes the model's final hidden states and unembedding matrix (`Transformer(..., return_hidden=True)`)
and runs `ops.losses.nll_sum` over about loss_chunk tokens a device at a time (`device_chunk`; same
values; the gradients are formed in the forward, chunk by chunk: no extra matmul). 0: the model's
logits, then log-softmax.
The chunked loss applies model.final_logit_softcap itself (the model's logits path does when it returns
logits). z_loss (train.logit_z_loss) > 0: PaLM's z-loss, z_loss * logsumexp(logits)^2 per token, is added
to the loss; the metrics log it apart ('z_loss') with the mean squared logsumexp ('logit_lse_sq') of
every run.
cast_params: under bf16/fp16 with gradient accumulation the train step casts the matmul weights to the
compute dtype once per step (`precision.cast_for_compute`), not once per micro-batch, and casts their
gradients back to float32 before accumulation and the optimizer (docs/runtime.md, "The GPU training
step", has the measurements behind the default)."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Any, Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.linen import partitioning as flax_partitioning

from tformer_jax import backends
from tformer_jax.nn import moe as moe_nn
from tformer_jax.nn.common import LORA
from tformer_jax.nn.transformer import sown_per_layer
from tformer_jax.ops import context_parallel as cp_ops, lora as lora_ops, losses, mtp as mtp_ops
from tformer_jax.ops.attention import soft_cap
from tformer_jax.train import objectives, optim, precision
from tformer_jax.train.state import TrainState

AUX_COLLECTIONS = ("aux_loss", "moe_metrics")


cross_entropy = losses.cross_entropy_logits   # (logits_BxLxV, targets_BxL) -> per-token NLL (B, L) float32


def document_args(batch: dict) -> dict[str, jax.Array]:
  """Packed-document batches (data.packing='document') carry segment ids and per-document positions."""
  return {k + "_BxL": batch[k] for k in ("segment_ids", "positions") if k in batch}


def _stripable(m: Any) -> bool:
  """A causal softmax model whose outputs do not depend on the token order (an MoE that drops tokens,
  by capacity or a bounded expert-parallel buffer, drops them in token order: it stays contiguous)."""
  drops = m.moe.num_experts > 0 and (m.moe.dispatch == "capacity" or m.moe.ep_buffer_factor > 0)
  mtp = getattr(m, "mtp_depth", 0) > 0   # multi-token prediction shifts the targets along the sequence
  return m.causal and m.attention == "softmax" and not drops and not mtp


@contextlib.contextmanager
def context_layout(model: nn.Module, batch: dict) -> Iterator[dict]:
  """The batch as the model sees it in this step: with a 'context' axis in the traced mesh and
  mesh.context_load_balance (strategy 'all_gather', a causal softmax model that drops no tokens),
  every (B, L) array in striped order (`ops.context_parallel.stripe_batch`: each context shard holds
  chunks i and 2n - 1 - i, the same causal work on every shard), traced under the backend with
  context_stripes set so that attention knows; else unchanged. Token sums (the loss, counts,
  accuracy) do not depend on the order."""
  b = backends.current()
  n = b.stripe_shards(batch["inputs"].shape[1]) if _stripable(model.cfg) else 1
  if n <= 1:
    yield batch
    return
  with backends.use(dataclasses.replace(b, context_stripes=n)):
    yield cp_ops.stripe_batch(batch, n)


def moe_log_metrics(mut: Any) -> dict[str, jax.Array]:
  """Scalar MoE metrics for the logs, from `nn.moe.collect_moe_metrics` (averaged over MoE layers):
  load_max / load_min (expert load fractions, 1/E is balanced), load_ratio (max/min load of the worst
  layer; 1.0 = perfectly balanced), dropped_fraction, router_entropy, load_balance and z_loss (the
  coefficient-weighted aux losses, summed over layers). Empty for dense models."""
  m = moe_nn.collect_moe_metrics(mut)
  return {k.removeprefix("moe_"): v for k, v in m.items() if k != "moe_load"}


def moe_layer_metrics(cfg: Any, mut: Any) -> dict[str, jax.Array]:
  """Per MoE layer i (the model's layer index): 'layer_<i>/load_max_mean' (its busiest expert's load over
  the mean load, 1.0 = balanced; the global batch's routing choices) and 'layer_<i>/dropped_fraction'.
  Empty for dense models."""
  metrics = mut.get("moe_metrics", {})
  loads = sown_per_layer(metrics, "load")
  if not loads:
    return {}
  layers = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
  dropped = sown_per_layer(metrics, "dropped_fraction")
  out = {}
  for j, (i, load) in enumerate(zip(layers, loads)):
    load = jnp.asarray(load, jnp.float32).reshape(-1)
    out[f"layer_{i}/load_max_mean"] = jnp.max(load) / jnp.maximum(jnp.mean(load), 1e-12)
    if j < len(dropped):
      out[f"layer_{i}/dropped_fraction"] = jnp.asarray(dropped[j], jnp.float32).reshape(())
  return out


def device_chunk(loss_chunk: int, batch_size: int) -> int:
  """train.loss_chunk (tokens a device holds logits for at a time) as the chunk of the global batch the loss
  cuts: times the shards the traced mesh splits the batch over. Cut from the global (B, L) batch, a chunk of
  loss_chunk tokens would shrink per device with every data shard: at 256-way FSDP a 2048-token chunk is 8
  tokens a device, 4096 passes over the unembedding a step (docs/scaling.md)."""
  mesh = jax.sharding.get_abstract_mesh()
  if loss_chunk <= 0 or mesh is None or mesh.empty:
    return loss_chunk
  axes = flax_partitioning.logical_to_mesh_axes(("batch",))
  axes = axes[0] if axes else None
  axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
  shards = math.prod(dict(mesh.shape).get(a, 1) for a in axes)
  return loss_chunk * shards if batch_size % shards == 0 else loss_chunk


def gathered_unembedding(unembed_DxV: jax.Array) -> jax.Array:
  """The unembedding with its d_model axis whole on every device, for the chunked loss: under FSDP that axis
  is sharded, and a loop over token chunks would then all-reduce each chunk's partial (chunk x vocab)
  logits over the shards (30x the step's other collectives on the Qwen3-8B preset, docs/scaling.md)
  instead of gathering the matrix once. The vocab axis keeps its own sharding (tensor parallelism)."""
  return nn.with_logical_constraint(unembed_DxV, (None, "vocab"))


def loss_sum_fn(model: nn.Module, params: Any, batch: dict, rng: jax.Array | None, *, train: bool,
                scale: jax.Array | float = 1.0, loss_chunk: int = 0, adapters: Any = None, z_loss: float = 0.0,
                mtp_weight: float = 0.0):
  """(scaled sum of token losses incl. aux and z-loss, (token count, aux metrics)) — the sum form that
  `optim.accumulate_gradients` needs. loss_chunk, z_loss: see the module docstring. adapters: LoRA adapters
  (B already scaled, `ops.lora.scaled`) that the model applies unmerged on `params`. mtp_weight > 0 (a
  model with mtp_depth > 0): plus mtp_weight x `mtp_loss` per token, the mean logged as 'mtp_loss'."""
  rngs = {"dropout": rng} if (train and rng is not None) else {}
  loss_chunk = device_chunk(loss_chunk, batch["targets"].shape[0])
  hidden = {"return_hidden": True} if loss_chunk > 0 else {}
  mtp = mtp_weight > 0 and getattr(model.cfg, "mtp_depth", 0) > 0
  if mtp:   # the main and the MTP modules' hidden states, one unembedding (nn/transformer.py)
    hidden = {"mtp_tokens_BxL": batch["targets"]}
  variables = {"params": params} if adapters is None else {"params": params, LORA: adapters}
  out, mut = model.apply(variables, batch["inputs"], **document_args(batch), deterministic=not train,
                         rngs=rngs, mutable=list(AUX_COLLECTIONS), **hidden)
  if mtp:
    h_BxLxD, unembed_DxV, mtp_h = out
    out = (h_BxLxD, unembed_DxV) if loss_chunk > 0 else _logits(model, h_BxLxD, unembed_DxV)
  mask = batch.get("loss_mask")
  mask = jnp.ones(batch["targets"].shape, jnp.float32) if mask is None else mask.astype(jnp.float32)
  count = jnp.sum(mask)
  if loss_chunk > 0:
    h_BxLxD, unembed_DxV = out
    unembed_DxV = gathered_unembedding(unembed_DxV)
    total, nll_sum, lse_sq_sum = losses.loss_sums(
        h_BxLxD, unembed_DxV, batch["targets"], mask, chunk=loss_chunk, matmul=backends.current().loss_matmul(),
        softcap=float(getattr(model.cfg, "final_logit_softcap", 0.0)), z_loss=z_loss)
  else:
    nll_BxL, lse_BxL = losses.nll_and_lse_logits(out, batch["targets"])
    total = nll_sum = jnp.sum(nll_BxL * mask)
    lse_sq_sum = jnp.sum(jnp.square(lse_BxL) * mask)
    if z_loss:
      total = nll_sum + z_loss * lse_sq_sum
    nll_sum, lse_sq_sum = jax.lax.stop_gradient((nll_sum, lse_sq_sum))
  aux_loss = moe_nn.collect_aux_loss(mut)
  metrics = {"nll_sum": nll_sum, "lse_sq_sum": lse_sq_sum, "aux_loss": aux_loss}
  if mtp:
    mtp_mean = mtp_loss(model, mtp_h, unembed_DxV, batch, mask, loss_chunk)
    total = total + mtp_weight * mtp_mean * count
    metrics["mtp_loss"] = jax.lax.stop_gradient(mtp_mean)
  metrics.update({f"moe/{k}": v for k, v in moe_log_metrics(mut).items()})
  metrics.update({f"moe/{k}": v for k, v in moe_layer_metrics(model.cfg, mut).items()})
  if _updates_biases(model.cfg):   # this batch's expert loads, for the auxiliary-loss-free bias update
    metrics["moe_bias_loads"] = moe_nn.correction_loads(mut)
  return (total + aux_loss * count) * scale, (count, metrics)


def _updates_biases(cfg: Any) -> bool:
  return cfg.moe.num_experts > 0 and cfg.moe.router == "sigmoid" and cfg.moe.bias_update_rate > 0


def _logits(model: nn.Module, h_BxLxD: jax.Array, unembed_DxV: jax.Array) -> jax.Array:
  """The model's float32 logits from its hidden states, as `Transformer` forms them (its soft cap)."""
  logits = jnp.einsum("bld,dv->blv", h_BxLxD, unembed_DxV).astype(jnp.float32)
  return soft_cap(logits, float(getattr(model.cfg, "final_logit_softcap", 0.0)))


def mtp_loss(model: nn.Module, mtp_h: list[jax.Array], unembed_DxV: jax.Array, batch: dict, mask_BxL: jax.Array,
             loss_chunk: int = 0) -> jax.Array:
  """Multi-token prediction's loss (DeepSeek-V3, section 2.2): the mean over the D depths of each depth's
  token-mean cross-entropy, depth k (1-based) predicting token t+1+k at position t from its hidden states
  mtp_h[k-1] (`ops.mtp.depth_targets`: the targets shifted by k, the last k positions and a target in
  another packed document masked); the chunked loss when loss_chunk > 0."""
  means = []
  for k, h_BxLxD in enumerate(mtp_h, start=1):
    targets_BxL, m_BxL = mtp_ops.depth_targets(batch["targets"], mask_BxL, k, batch.get("segment_ids"))
    if loss_chunk > 0:
      nll_sum = losses.loss_sums(h_BxLxD, unembed_DxV, targets_BxL, m_BxL, chunk=loss_chunk,
                                 matmul=backends.current().loss_matmul(),
                                 softcap=float(getattr(model.cfg, "final_logit_softcap", 0.0)))[0]
    else:
      nll_sum = jnp.sum(losses.nll_and_lse_logits(_logits(model, h_BxLxD, unembed_DxV), targets_BxL)[0] * m_BxL)
    means.append(nll_sum / jnp.maximum(jnp.sum(m_BxL), 1.0))
  return jnp.mean(jnp.stack(means))


def train_step(state: TrainState, batch: dict, *, model: nn.Module, tx: optax.GradientTransformation,
               schedule: optax.Schedule, grad_accum: int = 1, clip_norm: float = 0.0,
               axis_name: str | None = None, loss_chunk: int = 0, cast_params: bool | None = None,
               lora_scale: float = 1.0, z_loss: float = 0.0, mtp_weight: float = 0.0
               ) -> tuple[TrainState, dict[str, jax.Array]]:
  """One optimizer step. `axis_name` (pmap): `batch` is this device's shard; token counts, losses and
  gradients are summed over the axis, so the loss is the same token-weighted global mean as under jit.
  loss_chunk: see the module docstring. cast_params (a no-op in float32): the matmul weights cast to
  the model's compute dtype once, before the micro-batches, their gradients cast back to the params'
  dtype (float32) per micro-batch, before they are summed. The same values either way; None = when
  grad_accum > 1 (each micro-batch would cast again; with one micro-batch the model's own casts run
  once per step already and the step-long half-precision copy only costs memory).
  A LoRA state (state.frozen set): state.params are the adapters; the model runs on state.frozen with
  them applied unmerged in each adapted projection (x W + lora_scale (x A) B, nn.common.project), so only
  the adapters get gradients, and those cost O(rank) a token (no merged kernel's x^T dy).
  A sigmoid-router MoE's 'correction_bias' params never take the optimizer's update: each moves by
  model.moe.bias_update_rate * sign(mean load - load) from this step's global expert loads (the routing
  choices of the whole batch, every micro-batch and data shard; DeepSeek-V3's auxiliary-loss-free
  balancing), and stays as it was on a non-finite step or with rate 0 (a LoRA run keeps its base's)."""
  rng = jax.random.fold_in(state.rng, state.step)
  if axis_name is not None:  # distinct dropout masks per device
    rng = jax.random.fold_in(rng, jax.lax.axis_index(axis_name))
  if not model.cfg.causal:   # masked LM: this step's masks from its own key
    rng, mask_rng = jax.random.split(rng)
    batch = objectives.masked_lm_batch(batch, mask_rng, model.cfg)
  ls = state.loss_scale
  # The loss is a token *sum* (exact under accumulation); dividing by the static token count keeps
  # the fp16-scaled gradients at the size a mean loss would give.
  tokens = batch["targets"].size // grad_accum
  psum = (lambda x: x) if axis_name is None else functools.partial(jax.lax.psum, axis_name=axis_name)

  def f(params, mb, r):
    base, adapters = params, None
    if state.frozen is not None:   # LoRA: the adapters, applied unmerged on the frozen base
      base, adapters = state.frozen, lora_ops.scaled(params, lora_scale)
    loss_sum, (count, metrics) = loss_sum_fn(model, base, mb, r, train=True, scale=ls.scale / tokens,
                                             loss_chunk=loss_chunk, adapters=adapters, z_loss=z_loss,
                                             mtp_weight=mtp_weight)
    return loss_sum, (psum(count), metrics)  # normalised by the global token count

  value_and_grad = jax.value_and_grad(f, has_aux=True)

  def grad_fn(params, mb, r):
    out, grads = value_and_grad(params, mb, r)
    return out, precision.cast_like(grads, state.params)   # float32 before accumulation

  if cast_params is None:
    cast_params = grad_accum > 1
  compute_params = precision.cast_for_compute(state.params, model.cfg.dtype) if cast_params else state.params
  with context_layout(model, batch) as batch:
    (scaled_loss, aux), grads = optim.accumulate_gradients(grad_fn, compute_params, batch, rng, grad_accum)
  if axis_name is not None:
    scaled_loss, grads = psum((scaled_loss, grads))
    aux = {k: psum(v) if k in ("nll_sum", "lse_sq_sum") else jax.lax.pmean(v, axis_name) for k, v in aux.items()}
  grads = jax.tree.map(lambda g: g * tokens, ls.unscale_grads(grads))
  loss = scaled_loss * tokens / ls.scale
  finite = precision.all_finite((loss, grads))
  gnorm, gnorm_clipped = optim.grad_norms(grads, clip_norm)
  # a non-finite step: zero updates and the old optimizer state (optim.skip_nonfinite)
  updates, opt_state = tx.update(grads, state.opt_state, state.params, finite=finite, grad_norm=gnorm)
  params = optax.apply_updates(state.params, updates)
  if model.cfg.moe.num_experts and model.cfg.moe.router == "sigmoid" and state.frozen is None:
    # the correction biases: outside the optimizer, moved by this step's loads (model.moe.bias_update_rate)
    params = moe_nn.update_correction_biases(params, state.params, aux.get("moe_bias_loads", {}),
                                             float(model.cfg.moe.bias_update_rate), finite)
  bad = jnp.where(finite, 0, state.bad_steps + 1)
  new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                            loss_scale=ls.adjust(finite), bad_steps=bad,
                            skipped=state.skipped + (1 - finite.astype(jnp.int32)))
  tokens_seen = jnp.maximum(1.0, psum(_batch_count(batch, grad_accum)))
  metrics = {
      "loss": loss,
      "nll": aux["nll_sum"] / tokens_seen,
      "logit_lse_sq": aux["lse_sq_sum"] / tokens_seen,   # mean logsumexp(logits)^2: what the z-loss pulls to 0
      "z_loss": z_loss * aux["lse_sq_sum"] / tokens_seen,
      "aux_loss": aux["aux_loss"],
      **({"mtp_loss": aux["mtp_loss"]} if "mtp_loss" in aux else {}),   # MTP's mean loss, before its weight
      "lr": schedule(state.step),
      "grad_norm": gnorm,
      "grad_norm_clipped": gnorm_clipped,
      "finite": finite,
      "bad_steps": bad,
      "skipped": new_state.skipped,
      "loss_scale": jnp.asarray(ls.scale, jnp.float32),
  }
  metrics.update({k: v for k, v in aux.items() if k.startswith("moe/")})
  return new_state, metrics


def _batch_count(batch: dict, grad_accum: int) -> jax.Array:
  """Tokens per micro-batch (aux['nll_sum'] is a micro-batch mean under accumulation)."""
  mask = batch.get("loss_mask")
  total = batch["targets"].size if mask is None else jnp.sum(mask)
  return jnp.asarray(total, jnp.float32) / grad_accum


def eval_step(params: Any, batch: dict, *, model: nn.Module, loss_chunk: int = 0) -> dict[str, jax.Array]:
  """Sums (not means) so the loop can add them over batches: nll_sum, count, correct (argmax of the
  logits == target). loss_chunk: as in train_step."""
  if not model.cfg.causal:   # masked LM, the same masks at every evaluation (objectives.eval_rng)
    batch = objectives.masked_lm_batch(batch, objectives.eval_rng(batch), model.cfg)
  with context_layout(model, batch) as batch:
    loss_chunk = device_chunk(loss_chunk, batch["targets"].shape[0])
    if loss_chunk > 0:
      h_BxLxD, unembed_DxV = model.apply({"params": params}, batch["inputs"], **document_args(batch),
                                         deterministic=True, return_hidden=True)
      unembed_DxV = gathered_unembedding(unembed_DxV)
      nll_BxL, correct = losses.nll_and_correct(h_BxLxD, unembed_DxV, batch["targets"], chunk=loss_chunk,
                                                softcap=float(getattr(model.cfg, "final_logit_softcap", 0.0)))
    else:
      logits = model.apply({"params": params}, batch["inputs"], **document_args(batch), deterministic=True)
      nll_BxL = cross_entropy(logits, batch["targets"])
      correct = jnp.argmax(logits, -1) == batch["targets"]
  mask = batch.get("loss_mask")
  mask = jnp.ones_like(nll_BxL) if mask is None else mask.astype(jnp.float32)
  correct = correct.astype(jnp.float32)
  return {"nll_sum": jnp.sum(nll_BxL * mask), "count": jnp.sum(mask), "correct": jnp.sum(correct * mask)}


def make_train_step(model, tx, schedule, optim_cfg, axis_name: str | None = None, *, loss_chunk: int = 0,
                    cast_params: bool | None = None, lora_scale: float = 1.0, z_loss: float = 0.0,
                    mtp_weight: float = 0.0):
  """train_step with the optimizer settings bound; loss_chunk: train.loss_chunk (0 = full logits);
  lora_scale: alpha / rank of a LoRA run; z_loss: train.logit_z_loss; mtp_weight: train.mtp_loss_weight."""
  return functools.partial(train_step, model=model, tx=tx, schedule=schedule,
                           grad_accum=int(optim_cfg.grad_accum), clip_norm=float(optim_cfg.clip_norm),
                           axis_name=axis_name, loss_chunk=int(loss_chunk), cast_params=cast_params,
                           lora_scale=float(lora_scale), z_loss=float(z_loss), mtp_weight=float(mtp_weight))
