"""The one-device memory model of a train step (`estimate`, `estimate_config`): what each block keeps
for the backward, the loss's and a remat'd layer's transients, the peak phase (the constants were
read off XLA:CPU's buffer assignment: the package docstring)."""
from __future__ import annotations

import dataclasses
from typing import Any

from tformer_jax.analysis.estimate.execution import F32, Estimate, Execution, dtype_bytes, execution_of
from tformer_jax.analysis.estimate.flops import extra_flops_per_token, flops_per_token
from tformer_jax.analysis.estimate.params import (
  compute_cast_params,
  layer_params,
  lora_shapes,
  optimizer_state_bytes,
  param_count,
)
from tformer_jax.config import GLU_ACTIVATIONS, ModelConfig
from tformer_jax.ops.chunked_attention import chunk_table
from tformer_jax.ops.moe import capacity as moe_capacity
from tformer_jax.train import setup as setup_lib

# (T, D) float32 arrays a block's two norms and residual stream keep: input, normalised input, output and
# a row statistic per norm (xla_cpu's closed-form VJP), 3 per norm (autodiff), 4 in all under scan_layers.
NORM_KEPT = {"xla_cpu": 8, "reference": 6, "scan": 4}
# (T, F) arrays the FFN keeps: the matmul output(s), the activation's intermediates (silu's sigmoid,
# gelu_tanh's tanh, exact gelu's erfc x2) and the product feeding W_out; under scan_layers every
# residual of JAX's linearisation (XLA cannot fuse across the loop boundary).
FFN_KEPT = {"relu": 2, "gelu_tanh": 3, "silu": 3, "gelu": 4, "swiglu": 5, "geglu": 6}
FFN_KEPT_SCAN = {"relu": 3, "gelu_tanh": 7, "silu": 4, "gelu": 4, "swiglu": 6, "geglu": 6}
# SwiGLU as the C++ kernel (xla_cpu's Backend.glu): its custom VJP keeps the two matmul outputs, and W_out's
# input is kept: 2 fewer (T, F) arrays than XLA's fused silu(g) * u (read off XLA's compiled temp of
# llama_tiny at 8 x 128, unrolled and scanned).
GLU_KERNEL_SAVES = 2
# Per attention path: (copies of q + k + v + output, copies of the probabilities); scan_layers adds one
# query-sized array.
ATTENTION_KEPT = {"dense": (1.0, 3), "chunked_cpu": (1.0, 1), "chunked": (1.5, 2), "blockwise": (2.0, 0),
                  "flash": (1.0, 0)}
# (T, E, C) float32 one-hot tensors a capacity-dispatch layer keeps: dispatch, its transpose, combine
# (XLA frees part of the last layer's before the peak).
CAPACITY_KEPT = 2.5
# float32 copies of the stacked layer weights a scan_layers backward holds: the stacked gradients and the
# weights transposed for the backward matmuls, hoisted out of the loop (a one-layer scan: the gradients).
SCAN_WEIGHT_COPIES = 2
# float32 copies of the adapted kernels a LoRA step holds: the merged W + s A @ B, its gradient (from which
# the adapters' gradients are formed) and, under scan_layers, both transposed for the backward (read off one
# run: the 135M Llama at rank 8 on q,k,v,o, docs/finetune.md).
LORA_KERNEL_COPIES = 4
# (T, V) float32 arrays of the full-logits loss: logits, log-softmax and its gradient (tied embeddings:
# + the gradient transposed for the embedding's).
LOGITS_KEPT = 3


def _act_bytes(m: ModelConfig, ex: Execution) -> int:
  """Bytes of a kept activation element: the compute dtype's; float32 for a scanned stack on CPU (XLA:CPU's
  bf16 normalisation widens the loop's buffers)."""
  return F32 if ex.platform == "cpu" and m.scan_layers else dtype_bytes(m.dtype)


def _matmul_out_bytes(m: ModelConfig, ex: Execution) -> int:
  """Bytes of a kept matmul output element: XLA:CPU computes half-precision matmuls in float32 and keeps
  that result next to the half copy."""
  w = _act_bytes(m, ex)
  if ex.kernels_take(m) and ex.cpu_matmul == "all":
    return w   # the C++ matmul writes the compute dtype itself
  return w + F32 if ex.platform == "cpu" and w < F32 else w


def _probs_elems(m: ModelConfig, ex: Execution, path: str, seq: int) -> int:
  """Probabilities per (sequence, query head) the attention path keeps: L x S dense, the chunk table's
  rows x visible keys when chunked, none for the online-softmax paths."""
  if path == "dense":
    return seq * seq
  if path in ("chunked_cpu", "chunked"):
    table = chunk_table(seq, seq, causal=m.causal, window=m.window, q_offset=0, chunk=ex.block_q)
    return int(sum((r1 - r0) * (hi - lo) for r0, r1, lo, hi in table.tolist()))
  return 0


def attention_kept_bytes(m: ModelConfig, ex: Execution, batch: int, seq: int) -> int:
  """One attention layer: q, k, v and the output (ATTENTION_KEPT copies; scan_layers: + a query) and
  the float32 probabilities."""
  t, w = batch * seq, _act_bytes(m, ex)
  path = ex.attention_path(m)
  copies, prob_copies = ATTENTION_KEPT[path]
  qkvo = t * w * (2 * m.num_heads + 2 * m.kv_heads) * m.hd
  scan = t * w * m.num_heads * m.hd if m.scan_layers else 0
  return int(copies * qkvo) + scan + prob_copies * F32 * batch * m.num_heads * _probs_elems(m, ex, path, seq)


def ffn_kept_bytes(m: ModelConfig, ex: Execution, batch: int, seq: int, width: int | None = None,
                   glu_kernel: bool = False) -> int:
  """A dense FFN of `width` (default m.ff): FFN_KEPT[activation] (T, F) arrays, one a matmul output;
  glu_kernel: the block's MLP with SwiGLU on the C++ kernel (Execution.glu_kernel)."""
  arrays = (FFN_KEPT_SCAN if m.scan_layers else FFN_KEPT)[m.activation] - (GLU_KERNEL_SAVES if glu_kernel else 0)
  return batch * seq * (width or m.ff) * ((arrays - 1) * _act_bytes(m, ex) + _matmul_out_bytes(m, ex))


def moe_kept_bytes(m: ModelConfig, ex: Execution, batch: int, seq: int) -> tuple[int, int]:
  """One MoE FFN: (kept, transient while its backward runs), as in the package docstring."""
  t, w, mo = batch * seq, _act_bytes(m, ex), m.moe
  e, k, d, f = mo.num_experts, mo.top_k, m.d_model, mo.d_ff or m.ff
  router = 3 * t * e * F32                                   # logits, probabilities, the aux losses' inputs
  shared = ffn_kept_bytes(m, ex, batch, seq, mo.shared_count * (mo.shared_d_ff or f)) if mo.shared_count else 0
  if mo.dispatch == "capacity":
    c = moe_capacity(t, e, k, mo.capacity_factor)
    onehots = int(CAPACITY_KEPT * t * e * c * F32) + k * t * c * F32   # dispatch/combine, slot one-hots
    experts = ffn_kept_bytes(m, ex, e * c, 1, f) + 2 * e * c * d * w     # the slots' FFN, their in/out
    return router + onehots + experts + shared, 0
  n = t * k                                                  # dropless: the sorted (token, expert) rows
  rows = ffn_kept_bytes(m, ex, n, 1, f) - n * f * w + n * d * w          # the rows' FFN and their input
  if ex.platform == "tpu":                                   # ragged_dot is a grouped matmul there
    return router + rows + shared, 0
  xw = F32 if ex.platform == "cpu" else w                    # the dense expansion (float32 on CPU) + masks
  expanded = e * n * (d + f) * (xw + 1)
  if m.scan_layers:                                          # recomputed in the backward, not kept
    return router + rows + shared, expanded + 4 * e * n * f * xw
  return router + rows + expanded + shared, 3 * e * n * f * xw


def layer_kept_bytes(m: ModelConfig, ex: Execution, batch: int, seq: int, moe: bool) -> tuple[int, int]:
  """One block without remat: (kept, transient while its backward runs): norms, attention, FFN or MoE."""
  ffn, transient = (moe_kept_bytes(m, ex, batch, seq) if moe
                     else (ffn_kept_bytes(m, ex, batch, seq, glu_kernel=ex.glu_kernel(m)), 0))
  # float32 (XLA:CPU widens half-precision elementwise work), or the compute dtype where the C++ kernels take
  # it (calibrated on XLA's compiled temp of llama_tiny at 8 x 128 in bfloat16 on MKL's kernels: the estimate
  # 1.07x XLA's total this way, 1.24x counting float32)
  norm_bytes = _act_bytes(m, ex) if ex.kernels_take(m) else F32
  norms = NORM_KEPT["scan" if m.scan_layers else ex.backend] * batch * seq * m.d_model * norm_bytes
  return norms + attention_kept_bytes(m, ex, batch, seq) + ffn, transient


def matmul_outputs_bytes(m: ModelConfig, ex: Execution, batch: int, seq: int) -> int:
  """A block's matmul outputs (what remat 'dots' keeps): q, k, v, two output projections, the FFN input(s)."""
  inputs = 2 if m.activation in GLU_ACTIVATIONS else 1
  return batch * seq * _matmul_out_bytes(m, ex) * (2 * m.d_model + (m.num_heads + 2 * m.kv_heads) * m.hd
                                                   + inputs * m.ff)


def _block_gradients_bytes(m: ModelConfig, ex: Execution, batch: int, seq: int) -> int:
  """What a recomputed block's backward allocates on top: the probabilities' gradient (XLA's attention
  paths; the C++ kernel and the online-softmax paths keep none)."""
  path = ex.attention_path(m)
  return F32 * batch * m.num_heads * _probs_elems(m, ex, path, seq) if path in ("dense", "chunked") else 0


def activation_bytes_per_layer(m: ModelConfig, batch: int, seq: int, execution: Execution | None = None) -> int:
  """What the largest block keeps for the backward pass without remat."""
  ex = execution or Execution()
  return max(layer_kept_bytes(m, ex, batch, seq, m.is_moe_layer(i))[0] for i in range(m.num_layers))


def loss_working_bytes(m: ModelConfig, ex: Execution, batch: int, seq: int) -> int:
  """The loss's transient: LOGITS_KEPT (+1 tied) (T, V) float32 arrays, or with loss_chunk one chunk's
  logits + two (T, D) hidden-state copies + the (D, V) float32 gradient accumulator; + the embedding's
  (T, D) float32 gradient."""
  t, v, d, w = batch * seq, m.vocab_size, m.d_model, dtype_bytes(m.dtype)
  if not m.lm_head:
    return 2 * t * d * F32
  if ex.loss_chunk > 0:
    rows = batch * max(1, min(seq, ex.loss_chunk // batch))      # ops/losses.py: chunk // B positions
    return rows * v * F32 + 2 * t * d * w + d * v * F32 + t * d * F32
  return (LOGITS_KEPT + m.tie_embeddings) * t * v * F32 + t * d * F32


def estimate(m: ModelConfig, batch: int, seq: int, *, remat: bool | None = None, loss_mask: bool = False,
             execution: Execution | None = None) -> Estimate:
  """The estimate for one training step of `m` on (batch, seq) run as `execution` (default: the
  reference backend, dense attention, AdamW, on CPU). remat=True: remat 'full' with scan_layers."""
  ex = execution or Execution()
  if remat:
    m = dataclasses.replace(m, remat="full", scan_layers=True)
  if loss_mask and "loss_mask" not in dict(ex.batch_arrays):
    ex = dataclasses.replace(ex, batch_arrays=ex.batch_arrays + (("loss_mask", 4),))
  notes: list[str] = []
  n, w = param_count(m), dtype_bytes(m.dtype)
  mb = batch // max(ex.grad_accum, 1)                       # the micro-batch the layers see
  t = mb * seq
  blocks = [layer_kept_bytes(m, ex, mb, seq, m.is_moe_layer(i)) for i in range(m.num_layers)]
  outer_norms = (m.final_norm + m.embed_norm) * NORM_KEPT[ex.backend] // 2 * t * m.d_model * F32
  loss = loss_working_bytes(m, ex, mb, seq)
  remat_on = m.remat != "none" and (m.scan_layers or ex.platform != "cpu")
  if m.remat != "none" and not remat_on:
    notes.append("remat: XLA:CPU keeps an unrolled rematerialised graph's activations (set scan_layers)")
  if remat_on:
    kept, transient = max(blocks, key=sum)
    transient += _block_gradients_bytes(m, ex, mb, seq)     # the recomputed block's own backward
    if m.remat == "full":                                   # block inputs; one block recomputed
      activations, recompute = m.num_layers * t * m.d_model * w, kept + transient
    else:                                                   # every matmul output; the rest of one block
      dots = matmul_outputs_bytes(m, ex, mb, seq)
      activations, recompute = m.num_layers * dots, kept + transient - dots
    activations, working = activations + outer_norms, max(loss, recompute)
  else:
    activations, working = sum(k for k, _ in blocks) + outer_norms, max([loss] + [tr for _, tr in blocks])
  trained = n                                               # parameters with gradients and optimizer state
  grads = 0
  if ex.lora:   # the adapters are trained; the merged kernels (base + A @ B) exist while the step runs
    trained, targeted = lora_shapes(m, ex.lora)
    grads = targeted * F32 * LORA_KERNEL_COPIES
  elif m.scan_layers:
    grads = (SCAN_WEIGHT_COPIES if m.num_layers > 1 else 1) * layer_params(m) * F32
  grads += trained * F32 if ex.grad_accum > 1 else 0       # the running sum of micro-batch gradients
  fused = ex.backend == "xla_cpu" and ex.cpu_kernels and ex.optim_name() == "adamw"
  update = trained * F32 * (1 if fused else 3)              # gradients (+ optax's updates and new moments)
  optimizer = (optimizer_state_bytes(m, ex.optim) * trained // n)
  fixed = {"params": (n + (trained if ex.lora else 0)) * dtype_bytes(m.param_dtype), "optimizer": optimizer,
           "batch": sum(b for _, b in ex.batch_arrays) * batch * seq,
           "compute_params": compute_cast_params(m) * w if m.dtype != m.param_dtype else 0}
  phases = {"backward": activations + working + grads, "update": update}
  if phases["backward"] >= update:
    parts = dict(fixed, activations=activations, working=working, grads=grads)
  else:
    parts = dict(fixed, update=update)
  if ex.platform == "cpu" and w < F32:
    notes.append(f"{m.dtype} on CPU: XLA:CPU runs half-precision matmuls in float32 (kept next to the half "
                 "copies); a GPU/TPU keeps less")
  model_flops = flops_per_token(m, seq, m.remat == "full")
  return Estimate(n, parts, max(k for k, _ in blocks), model_flops, m.remat != "none",
                  model_flops + extra_flops_per_token(m, ex, mb, seq), phases, notes, ex.describe(m))


def estimate_config(cfg: Any, *, platform: str | None = None) -> Estimate:
  """The estimate for cfg's train step: the model with train.precision applied, the runtime resolved."""
  m = setup_lib.resolve_model_config(cfg, check_paths=False)
  return estimate(m, int(cfg.data.batch_size), int(cfg.data.seq_len), execution=execution_of(cfg, platform=platform))
