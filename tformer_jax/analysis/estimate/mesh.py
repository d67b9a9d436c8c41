"""Per device on a mesh (`estimate_on_mesh`): the exact per-device state from the shardings the rules
give (`layout_of`) and what XLA:TPU keeps at the peak of a remat'd, scanned step."""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from tformer_jax.analysis.estimate.execution import F32, Estimate, Execution, dtype_bytes, execution_of
from tformer_jax.analysis.estimate.flops import flops_per_token
from tformer_jax.analysis.estimate.params import compute_cast_params, param_count
from tformer_jax.config import ModelConfig
from tformer_jax.nn import Transformer
from tformer_jax.ops import moe_parallel
from tformer_jax.ops.moe import capacity as moe_capacity
from tformer_jax.parallel import mesh as mesh_lib, rules as rules_lib
from tformer_jax.train import optim, precision, setup as setup_lib, state as state_lib

# What XLA:TPU keeps at the peak of a sharded step, read off its buffer assignment (tformer-aot with
# XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_as_text: the buffers of *-buffer-assignment.txt over the
# schedule of *-live-range.txt) on the scale presets. Besides the state, the float32 gradients, the
# compute-dtype weights and the saved layer inputs, the peak is one of two phases:
#   loss      the (T, V) logits in float32 and in the compute dtype (its gradient)
#   backward  the compute-dtype logits gradient, still live (XLA schedules the head's weight gradient
#             after the layers' backward), and one recomputed layer: FFN_KEPT_TPU (T, F) compute-dtype
#             arrays; dense attention's (B, H, L, S) scores: DENSE_SCORES_F32 float32 copies (the
#             scores and their normalised exponentials, in the forward and again in the recompute; the
#             online-softmax kernels, splash and blockwise, keep (T, H) statistics only).
# The weights are not gathered whole: XLA:TPU streams the FSDP shards through collective matmuls.
FFN_KEPT_TPU = 4
DENSE_SCORES_F32 = 2


@dataclasses.dataclass(frozen=True)
class Layout:
  """How a mesh splits a train step (`layout_of`): the ways the rules split each logical axis and the
  exact per-device state."""
  devices: int = 1
  splits: tuple[tuple[str, int], ...] = ()   # (logical axis, mesh devices it is split over)
  params: int = 0                             # per-device bytes of the parameters (from the shardings)
  optimizer: int = 0                          # and of the optimizer state
  param_share: float = 1.0                    # per-device parameters / all parameters

  def split(self, axis: str) -> int:
    return dict(self.splits).get(axis, 1)


def _shard_bytes(leaf: Any, names: Any, rules: Any, sizes: dict[str, int]) -> int:
  dims = list(leaf.shape)
  mesh_axes = tuple(nn.logical_to_mesh_axes(tuple(names), rules)) if names is not None else ()
  for i, target in enumerate(mesh_axes[:len(dims)]):
    axes = () if target is None else target if isinstance(target, tuple) else (target,)
    dims[i] = -(-dims[i] // math.prod(sizes.get(a, 1) for a in axes))
  return math.prod(dims) * jnp.dtype(leaf.dtype).itemsize


def layout_of(cfg: Any, devices: int) -> Layout:
  """cfg's mesh over `devices` devices: each logical axis's split (cfg.mesh.rules over the resolved
  mesh.shape) and the per-device state, exact (the shardings the run gives every leaf; nothing is
  allocated)."""
  axes = tuple(cfg.mesh.axes)
  sizes = dict(zip(axes, mesh_lib.resolve_shape(tuple(cfg.mesh.shape), devices)))
  rules = rules_lib.get_rules(cfg.mesh.rules, axes)
  splits = tuple((logical, math.prod(sizes[a] for a in (t if isinstance(t, tuple) else (t,)) if a))
                 for logical, t in rules if t is not None)
  m = setup_lib.resolve_model_config(cfg, check_paths=False)
  tx, _ = optim.make_optimizer(cfg.optim, 1000)
  init = state_lib.init_fn(Transformer(m), tx, precision.get_policy(cfg.train.precision).initial_loss_scale(),
                           int(cfg.data.seq_len))
  boxed = jax.eval_shape(init, jax.ShapeDtypeStruct((2,), jnp.uint32))
  specs, plain = nn.get_partition_spec(boxed), state_lib.unbox_plain(boxed)
  is_spec = lambda x: x is None or isinstance(x, jax.sharding.PartitionSpec)   # noqa: E731
  per_device = lambda sub_specs, sub: sum(jax.tree.leaves(jax.tree.map(         # noqa: E731
      lambda n, x: _shard_bytes(x, n, rules, sizes), sub_specs, sub, is_leaf=is_spec)))
  params = per_device(specs.params, plain.params)
  full = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(plain.params))
  return Layout(devices, splits, int(params), int(per_device(specs.opt_state, plain.opt_state)),
                params / max(full, 1))


def estimate_on_mesh(cfg: Any, devices: int, *, platform: str = "tpu", layout: Layout | None = None) -> Estimate:
  """The per-device peak of cfg's train step on `devices` devices of `platform` (its mesh, rules and
  runtime as the run resolves them): the state exact (`layout_of`), the rest from what XLA keeps at
  the peak (module constants above)."""
  lay = layout or layout_of(cfg, devices)
  m = setup_lib.resolve_model_config(cfg, check_paths=False)
  ex = execution_of(cfg, platform=platform, mesh_devices=devices)
  return estimate_sharded(m, int(cfg.data.batch_size), int(cfg.data.seq_len), ex, lay)


def _sharded_layer_bytes(m: ModelConfig, ex: Execution, lay: Layout, t: float, seqs: float, s: float,
                        moe: bool, batch_tokens: int) -> float:
  """What one recomputed layer's backward adds on a device (`FFN_KEPT_TPU`, the scores); a MoE layer:
  the FFN arrays over the rows its experts run, their input/output buffers and the router's."""
  w, tp_h, tp_f = dtype_bytes(m.dtype), lay.split("heads"), lay.split("mlp")
  if moe:
    mo, ep = m.moe, lay.split("expert")
    tokens = batch_tokens // max(ex.grad_accum, 1)
    cap = moe_capacity(tokens, mo.num_experts, mo.top_k, mo.capacity_factor) if mo.dispatch == "capacity" else None
    if ex.moe_exchange != "global" and ep > 1:     # the rows a device receives (ops/moe_parallel.py)
      rows = moe_parallel.receive_rows(tokens, mo.num_experts, mo.top_k, ep,
                                       lay.split("batch") * lay.split("length"), capacity=cap,
                                       buffer_factor=mo.ep_buffer_factor)
    else:                                           # the global dispatch: every device runs every row
      rows = mo.num_experts * cap if cap else tokens * mo.top_k
    ffn = FFN_KEPT_TPU * rows * (mo.d_ff or m.ff) / tp_f * w + 4 * rows * m.d_model * w + 3 * t * mo.num_experts * F32
  else:
    ffn = FFN_KEPT_TPU * t * m.ff / tp_f * w
  scores = 0.0
  if ex.attention_path(m) == "dense":
    scores = seqs * m.num_heads / tp_h * s * seq_kv(m, s, lay) * DENSE_SCORES_F32 * F32
  return ffn + scores


def seq_kv(m: ModelConfig, s: float, lay: Layout) -> float:
  """Keys each query block is scored against on a device: the whole sequence (context shards gather it)."""
  return s * lay.split("length")


def estimate_sharded(m: ModelConfig, batch: int, seq: int, ex: Execution, lay: Layout) -> Estimate:
  """`estimate_on_mesh` for a model, batch and execution: the state, float32 gradients (and the
  accumulation's running sum), compute-dtype weights and saved layer inputs, plus the larger of the
  loss phase and a recomputed layer's backward (module constants above)."""
  notes: list[str] = []
  n, w, share = param_count(m), dtype_bytes(m.dtype), lay.param_share
  seqs = max(batch // max(ex.grad_accum, 1) / lay.split("batch"), 1.0)   # sequences a device runs at once
  s = seq / lay.split("length")
  t = seqs * s
  fixed = {"params": lay.params, "optimizer": lay.optimizer,
           "batch": int(sum(b for _, b in ex.batch_arrays) * batch * seq / lay.split("batch") / lay.split("length")),
           "compute_params": int(compute_cast_params(m) * share * w) if m.dtype != m.param_dtype else 0}
  if not (m.remat == "full" and m.scan_layers):
    notes.append(f"remat {m.remat!r}, scan_layers {m.scan_layers}: the per-device figure models remat 'full' "
                 "over scanned layers (only each layer's input kept)")
  activations = int(m.num_layers * t * m.d_model * w)
  grads = int(n * share * F32)                          # float32 gradients (or the accumulation's sum)
  v = m.vocab_size / lay.split("vocab") if m.lm_head else 0
  if ex.loss_chunk > 0 and m.lm_head:
    rows = min(t, max(1.0, ex.loss_chunk / lay.split("batch")))
    loss, kept = rows * v * (F32 + w) + m.d_model * v * F32, 0.0
  else:
    loss, kept = t * v * (F32 + w), t * v * w
  layer = max(_sharded_layer_bytes(m, ex, lay, t, seqs, s, m.is_moe_layer(i), batch * seq)
              for i in range(m.num_layers))
  phases = {"loss": int(loss), "backward": int(kept + layer)}
  parts = dict(fixed, activations=activations, grads=grads, working=max(phases.values()))
  model_flops = flops_per_token(m, seq, m.remat == "full")
  return Estimate(n, parts, int(layer), model_flops, m.remat != "none", model_flops, phases, notes,
                  ex.describe(m) + f"; per device of {lay.devices}")
