"""Memory and FLOPs of a training step from the config alone, next to what XLA compiles.

  est = estimate_config(cfg)                 # cfg's train step, runtime resolved as the run resolves it
  est = estimate(m, batch, seq, execution=Execution(backend="xla_cpu", attention="chunked", ...))
  xla = compiled_analysis_config(cfg)        # XLA's figures for the very same step (train/setup.py)

The estimate is a pure function of the config (nothing compiled, nothing allocated): parameter and
optimizer-state sizes are exact (`jax.eval_shape`), everything else is a formula over the arrays the
compiled step keeps. The peak is one of two phases:
  backward  params + optimizer + batch + compute_params + activations + working + grads
  update    params + optimizer + batch + compute_params + update
Terms (bytes; T = micro-batch tokens, D = d_model, F = FFN width, V = vocab, E = experts, w = compute dtype):
  params          parameter count (exact) x param dtype
  optimizer       the optimizer state (exact: eval_shape of its init)
  batch           the batch arrays the pipeline yields (inputs, targets; loss_mask, segment_ids, positions)
  compute_params  the matmul weights cast to the compute dtype once per step (bf16/fp16 only)
  activations     what the backward keeps from the forward: every block (`layer_kept_bytes`), final norm
  working         the largest transient on top: the loss's logits, a MoE layer's backward, a remat'd layer
  grads           gradient buffers held while the layers run (accumulation's running sum, a scan's stacks)
  update          every gradient in float32 + optax's temporaries (the fused C++ AdamW updates in place)
Per block (each array counted from XLA's buffer assignment; see "Calibration" below):
  norms       NORM_KEPT (T, D) float32 arrays for the two norms and the residual stream
  attention   q, k, v and the output (x ATTENTION_KEPT) + the probabilities the implementation keeps:
              dense (B, H, L, S) float32 x3; chunked: the chunk table's rows x visible keys (C++ kernel
              x1, XLA's version x2: p and p transposed); blockwise and cuDNN: none
  ffn         FFN_KEPT[activation] (T, F) arrays (FFN_KEPT_SCAN under scan_layers)
  moe         router (T, E) float32 x3; dropless: the T*top_k sorted rows through the FFN; off TPU
              jax.lax.ragged_dot lowers to a dense expansion: (E, N, D) and (E, N, F) (+ bool masks) kept,
              3 (E, N, F) more while its backward runs; capacity: CAPACITY_KEPT (T, E, C) float32
              one-hot dispatch/combine tensors, the experts' FFN on (E, C) slots
  remat       'full' (effective under scan_layers, or off CPU): the block inputs (n x T x D) + one
              block recomputed in the backward; 'dots': every matmul output + the rest of one block
  loss        full logits: LOGITS_KEPT (+1 tied) (T, V) float32; loss_chunk: one chunk's logits, two
              (T, D) copies of the hidden states and the (D, V) float32 gradient accumulator
XLA:CPU specifics (platform 'cpu'): half-precision matmuls run in float32 (their float32 result is kept
next to the half copy), a scanned half-precision stack keeps float32 residuals, an unrolled
rematerialised graph keeps its activations, ragged_dot expands in float32. GPU and TPU estimates use
the same arrays without these (ragged_dot native on TPU only). `estimate` is for one device (no sharding).

Per device on a mesh (`estimate_on_mesh(cfg, devices)`, tformer-estimate --devices, printed by tformer-aot
next to XLA:TPU's compiled peak): the state exact from the shardings the rules give (`layout_of`), the
batch, sequence, heads, FFN, vocabulary and experts split as the rules split them, and what XLA:TPU
keeps at the peak of a remat'd, scanned step (read off its buffer assignment; see FFN_KEPT_TPU):
  params + optimizer + batch + compute_params + grads (float32) + activations (n x T x D) + working
  working = max(loss: the (T, V) logits in float32 + compute dtype,
                backward: the compute-dtype logits gradient + one recomputed layer's arrays)

FLOPs per token (training = forward + backward = 3 x forward), bench/flops.py's formula:
  6 * N_matmul + 12 * n * L * h * hd          (remat 'full': the layers' share x 4/3, `flops.with_recompute`)
  N_matmul = parameters in a matmul per token (layer weights with top_k of the experts, the LM head); the
  second term is QK^T and AV over all L keys (dense attention computes every score). The executed FLOPs
  add what the step runs beyond that: the MoE dispatch (ragged_dot's expansion off TPU runs every
  expert on every row; capacity: the empty slots and the one-hot einsums) and the chunked loss's
  recomputed logits.
KV cache: 2 (K and V) * n * batch * len * kh * hd * bytes.

`compiled_analysis_config` compiles cfg's train step exactly as a run builds it (train/setup.py, one
device, cfg.runtime resolved on this platform) and reads memory_analysis(): arguments + temporaries (the
donated state aliases the outputs). FLOPs come from a second compile with the reference backend, dense
attention and unrolled layers: XLA's cost analysis counts no custom call (the xla_cpu backend's C++
kernels) and a loop body once (scan_layers).

Calibration: every constant below was read off XLA:CPU's buffer assignment of the compiled step
(XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_as_text: the *-live-range.txt file lists the buffers live
at the peak, each with the op that made it) and checked on the shipped presets and ~20 random tiny
configs: the presets within 6%, the random configs within 15% except small loss-dominated ones, where
XLA's heap packs the (T, V) logits buffers loosely (up to 2 more such arrays).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from tformer_jax import backends
from tformer_jax.bench import flops as flops_lib
from tformer_jax.config import GLU_ACTIVATIONS, ModelConfig, default_config
from tformer_jax.nn import Transformer
from tformer_jax.ops import kv_quant, lora as lora_ops, moe_parallel
from tformer_jax.ops.chunked_attention import chunk_table
from tformer_jax.ops.moe import capacity as moe_capacity
from tformer_jax.parallel import mesh as mesh_lib, rules as rules_lib
from tformer_jax.train import optim, precision, setup as setup_lib, state as state_lib, step as step_lib

MiB = 1024 * 1024
F32 = 4

# (T, D) float32 arrays a block's two norms and residual stream keep: input, normalised input, output and
# a row statistic per norm (xla_cpu's closed-form VJP), 3 per norm (autodiff), 4 in all under scan_layers.
NORM_KEPT = {"xla_cpu": 8, "reference": 6, "scan": 4}
# (T, F) arrays the FFN keeps: the matmul output(s), the activation's intermediates (silu's sigmoid,
# gelu_tanh's tanh, exact gelu's erfc x2) and the product feeding W_out; under scan_layers every
# residual of JAX's linearisation (XLA cannot fuse across the loop boundary).
FFN_KEPT = {"relu": 2, "gelu_tanh": 3, "silu": 3, "gelu": 4, "swiglu": 5, "geglu": 6}
FFN_KEPT_SCAN = {"relu": 3, "gelu_tanh": 7, "silu": 4, "gelu": 4, "swiglu": 6, "geglu": 6}
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


@dataclasses.dataclass(frozen=True)
class Execution:
  """How the train step runs the model: what, besides the architecture, changes its memory.
  `execution_of(cfg)` resolves it from a config as a run does (backends.resolve_runtime)."""
  backend: str = "reference"        # reference | xla_cpu
  attention: str = "reference"      # runtime.attention resolved: reference | chunked | blockwise | xla | cudnn
  block_q: int = 128                # the chunked query chunk / blockwise query tile
  block_k: int = 128                # the blockwise key tile
  cpu_kernels: bool = False         # xla_cpu: the C++ kernels (chunked attention, fused AdamW)
  platform: str = "cpu"             # cpu | gpu | tpu (XLA lowers ragged_dot, remat and bf16 differently)
  loss_chunk: int = 0               # train.loss_chunk
  grad_accum: int = 1               # optim.grad_accum: micro-batches per step
  optim: Any = None                 # the optim config section (None: the defaults, AdamW)
  batch_arrays: tuple[tuple[str, int], ...] = (("inputs", 4), ("targets", 4))   # (name, bytes per token)
  moe_exchange: str = "global"      # runtime.moe_exchange resolved: global | all_to_all | ragged
  lora: tuple[tuple[str, ...], int] | None = None   # train.lora (targets, rank): adapters on a frozen base

  def attention_path(self, m: ModelConfig) -> str:
    """What the layers run (backends/base.py Backend.attention): 'dense' (reference, xla), 'chunked_cpu'
    (the C++ kernel), 'chunked' (XLA), 'blockwise' or 'flash' (cuDNN, splash: online softmax kernels)."""
    if m.attn_dropout > 0 or m.position == "t5" or m.num_global_tokens:
      return "dense"                       # the tiled paths need a static mask and no dense bias
    if self.attention == "chunked":
      kernel = self.backend == "xla_cpu" and self.cpu_kernels and m.dtype == "float32"
      return "chunked_cpu" if kernel else "chunked"
    return {"blockwise": "blockwise", "cudnn": "flash", "splash": "flash"}.get(self.attention, "dense")

  def optim_name(self) -> str:
    return str((self.optim if self.optim is not None else default_config().optim).name)

  def describe(self, m: ModelConfig) -> str:
    kernels = f", C++ kernels {'on' if self.cpu_kernels else 'off'}" if self.backend == "xla_cpu" else ""
    lora = f", LoRA rank {self.lora[1]} on {','.join(self.lora[0])}" if self.lora else ""
    return (f"{self.backend} (attention {self.attention} -> {self.attention_path(m)}{kernels}) on {self.platform}; "
            f"{m.dtype} compute, loss_chunk {self.loss_chunk}, {self.optim_name()}, grad_accum {self.grad_accum}"
            f"{lora}")


@dataclasses.dataclass
class Estimate:
  params: int                          # parameter count (exact)
  bytes: dict[str, int]                # the terms of the peak phase (module docstring)
  activation_per_layer: int            # what the largest block keeps (no remat)
  flops_per_token: float               # model FLOPs: 6 N_matmul + attention (+ remat's recompute)
  remat: bool
  executed_flops_per_token: float = 0.0   # + the MoE dispatch and the chunked loss's recompute
  phases: dict[str, int] = dataclasses.field(default_factory=dict)   # {'backward', 'update'}: their totals
  notes: list[str] = dataclasses.field(default_factory=list)         # what is modelled coarsely, and why
  execution: str = ""                  # Execution.describe()

  @property
  def total(self) -> int:
    return int(sum(self.bytes.values()))

  def per_device(self, state_shards: int = 1, batch_shards: int = 1) -> int:
    """A first-order per-device figure for a sharded run: the parameter-shaped terms (params, optimizer,
    compute_params, grads, update) split `state_shards` ways (fsdp/tensor), the rest `batch_shards` ways
    (the batch axes). Collectives' buffers and replicated pieces are not modelled."""
    state = ("params", "optimizer", "compute_params", "grads", "update")
    return int(sum(v / (state_shards if k in state else batch_shards) for k, v in self.bytes.items()))


def _bytes(dtype: str) -> int:
  return jnp.dtype(dtype).itemsize


# -- parameters and state -----------------------------------------------------------------------------------

param_shapes = flops_lib.param_shapes       # the parameter tree as ShapeDtypeStructs (nothing is allocated)


def _leaves(m: ModelConfig) -> list[tuple[list[str], Any]]:
  return [([str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)], x)
          for path, x in jax.tree_util.tree_flatten_with_path(param_shapes(m))[0]]


def param_count(m: ModelConfig) -> int:
  """Exact number of parameters of the model."""
  return int(sum(math.prod(x.shape) for x in jax.tree.leaves(param_shapes(m))))


def compute_cast_params(m: ModelConfig) -> int:
  """Parameters the train step casts to the compute dtype once per step (precision.cast_for_compute)."""
  return sum(math.prod(x.shape) for keys, x in _leaves(m) if keys[-1] in precision.COMPUTE_CAST_NAMES)


def _layer_params(m: ModelConfig) -> int:
  return sum(math.prod(x.shape) for keys, x in _leaves(m) if keys[0].startswith("layers"))


def optimizer_state_bytes(m: ModelConfig, optim_cfg: Any = None) -> int:
  """Bytes of the optimizer state of m's parameters (exact: jax.eval_shape of the optimizer's init)."""
  tx, _ = optim.make_optimizer(optim_cfg if optim_cfg is not None else default_config().optim, 1000)
  state = jax.eval_shape(tx.init, param_shapes(m))
  return int(sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(state)))


def lora_shapes(m: ModelConfig, lora: tuple[tuple[str, ...], int]) -> tuple[int, int]:
  """(adapter parameters, parameters of the kernels they adapt) of train.lora on m (ops/lora.py)."""
  shapes = param_shapes(m)
  adapters = jax.eval_shape(lambda p: lora_ops.init(jax.random.PRNGKey(0), p, lora[0], lora[1]), shapes)
  targeted = sum(math.prod(w.shape) for _, w, _, _ in lora_ops._targeted(shapes, lora[0]))
  return int(sum(math.prod(x.shape) for x in jax.tree.leaves(adapters))), int(targeted)


def kv_cache_bytes(num_layers: int, batch: int, length: int, kv_heads: int, head_dim: int,
                   bytes_per_elem: int = 2) -> int:
  """2 (K, V) * layers * batch * length * kv_heads * head_dim * bytes."""
  return 2 * num_layers * batch * length * kv_heads * head_dim * bytes_per_elem


def kv_cache_bytes_as(m: ModelConfig, batch: int, length: int, cache_dtype: str) -> int:
  """The decode cache's K/V bytes stored as `cache_dtype` (decode.cache_dtype: '' = the compute dtype,
  bfloat16, int8 with its per-token-and-head scales: ops/kv_quant.py)."""
  return batch * length * kv_quant.cache_bytes_per_token(m.num_layers, m.kv_heads, m.hd, cache_dtype, m.dtype)


# -- what a block keeps -------------------------------------------------------------------------------------

def _act_bytes(m: ModelConfig, ex: Execution) -> int:
  """Bytes of a kept activation element: the compute dtype's; float32 for a scanned stack on CPU (XLA:CPU's
  bf16 normalisation widens the loop's buffers)."""
  return F32 if ex.platform == "cpu" and m.scan_layers else _bytes(m.dtype)


def _matmul_out_bytes(m: ModelConfig, ex: Execution) -> int:
  """Bytes of a kept matmul output element: XLA:CPU computes half-precision matmuls in float32 and keeps
  that result next to the half copy."""
  w = _act_bytes(m, ex)
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


def ffn_kept_bytes(m: ModelConfig, ex: Execution, batch: int, seq: int, width: int | None = None) -> int:
  """A dense FFN of `width` (default m.ff): FFN_KEPT[activation] (T, F) arrays, one a matmul output."""
  arrays = (FFN_KEPT_SCAN if m.scan_layers else FFN_KEPT)[m.activation]
  return batch * seq * (width or m.ff) * ((arrays - 1) * _act_bytes(m, ex) + _matmul_out_bytes(m, ex))


def moe_kept_bytes(m: ModelConfig, ex: Execution, batch: int, seq: int) -> tuple[int, int]:
  """One MoE FFN: (kept, transient while its backward runs), as in the module docstring."""
  t, w, mo = batch * seq, _act_bytes(m, ex), m.moe
  e, k, d, f = mo.num_experts, mo.top_k, m.d_model, mo.d_ff or m.ff
  router = 3 * t * e * F32                                   # logits, probabilities, the aux losses' inputs
  shared = ffn_kept_bytes(m, ex, batch, seq, f) if mo.shared_expert else 0
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
  ffn, transient = moe_kept_bytes(m, ex, batch, seq) if moe else (ffn_kept_bytes(m, ex, batch, seq), 0)
  norms = NORM_KEPT["scan" if m.scan_layers else ex.backend] * batch * seq * m.d_model * F32
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
  t, v, d, w = batch * seq, m.vocab_size, m.d_model, _bytes(m.dtype)
  if not m.lm_head:
    return 2 * t * d * F32
  if ex.loss_chunk > 0:
    rows = batch * max(1, min(seq, ex.loss_chunk // batch))      # ops/losses.py: chunk // B positions
    return rows * v * F32 + 2 * t * d * w + d * v * F32 + t * d * F32
  return (LOGITS_KEPT + m.tie_embeddings) * t * v * F32 + t * d * F32


# -- FLOPs --------------------------------------------------------------------------------------------------

def flops_per_token(m: ModelConfig, seq: int, remat: bool = False) -> float:
  """Training FLOPs per token, bench/flops.py's formula (6 * N_matmul + 12 * n * L * h * hd); remat:
  + the recomputed forward of the layers (remat 'full': x 4/3 on the layers, not the embedding and
  head: `flops.with_recompute`, the figure tformer-aot compares the compiled HLO with)."""
  mm = dataclasses.replace(m, remat="full" if remat else "none")
  return float(flops_lib.with_recompute(mm, 1, seq)["with_recompute"]) / seq


def extra_flops_per_token(m: ModelConfig, ex: Execution, batch: int, seq: int) -> float:
  """Training FLOPs per token the step runs beyond `flops_per_token`: the MoE dispatch and the chunked
  loss's recomputed logits (one more (T x D x V) matmul)."""
  mo, t = m.moe, batch * seq
  loss = 2.0 * m.d_model * m.vocab_size if ex.loss_chunk > 0 and m.lm_head else 0.0
  if not mo.num_experts:
    return loss
  e, k, d, f = mo.num_experts, mo.top_k, m.d_model, mo.d_ff or m.ff
  per_row = 2.0 * d * f * (3 if m.activation in GLU_ACTIVATIONS else 2)   # one row through one expert
  if mo.dispatch == "capacity":
    c = moe_capacity(t, e, k, mo.capacity_factor)
    # every slot through its expert (forward + backward) and the one-hot einsums: building dispatch and
    # combine (3 x 2 K E C) and applying them (5 x 2 E C D), per token
    extra = 3.0 * (e * c / t - k) * per_row + 6.0 * k * e * c + 10.0 * e * c * d
  elif ex.platform != "tpu":
    extra = 3.0 * k * (e - 1) * per_row                             # ragged_dot's expansion: every expert
  else:
    extra = 0.0
  return loss + extra * sum(m.is_moe_layer(i) for i in range(m.num_layers))


# -- the estimate -------------------------------------------------------------------------------------------

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
  n, w = param_count(m), _bytes(m.dtype)
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
    grads = (SCAN_WEIGHT_COPIES if m.num_layers > 1 else 1) * _layer_params(m) * F32
  grads += trained * F32 if ex.grad_accum > 1 else 0       # the running sum of micro-batch gradients
  fused = ex.backend == "xla_cpu" and ex.cpu_kernels and ex.optim_name() == "adamw"
  update = trained * F32 * (1 if fused else 3)              # gradients (+ optax's updates and new moments)
  optimizer = (optimizer_state_bytes(m, ex.optim) * trained // n)
  fixed = {"params": (n + (trained if ex.lora else 0)) * _bytes(m.param_dtype), "optimizer": optimizer,
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


# -- per device on a mesh (GPU / TPU) ---------------------------------------------------------------------

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
  w, tp_h, tp_f = _bytes(m.dtype), lay.split("heads"), lay.split("mlp")
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
  n, w, share = param_count(m), _bytes(m.dtype), lay.param_share
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


# -- from a config ------------------------------------------------------------------------------------------

def execution_of(cfg: Any, *, platform: str | None = None, mesh_devices: int = 1) -> Execution:
  """The Execution of cfg's run: cfg.runtime resolved as backends.resolve_runtime does on `platform`
  (default this process's) and `mesh_devices`, the loss, accumulation, optimizer and batch arrays of cfg."""
  rt = backends.resolve_runtime(cfg, platform=platform, mesh_devices=mesh_devices, quiet=True)
  b = rt.backend
  arrays = tuple((name, jnp.dtype(dt).itemsize) for name, (_, dt) in setup_lib.batch_spec(cfg.data).items())
  lora = setup_lib.lora_settings(cfg)
  return Execution(backend=b.name, attention=b.attention_impl, block_q=b.block_q, block_k=b.block_k,
                   cpu_kernels=bool(getattr(b, "cpu_kernels", False)), platform=rt.platform,
                   loss_chunk=int(cfg.train.get("loss_chunk", 0) or 0), grad_accum=int(cfg.optim.grad_accum),
                   optim=cfg.optim, batch_arrays=arrays, moe_exchange=str(getattr(b, "moe_exchange", "global")),
                   lora=lora[:2] if lora else None)


def estimate_config(cfg: Any, *, platform: str | None = None) -> Estimate:
  """The estimate for cfg's train step: the model with train.precision applied, the runtime resolved."""
  m = setup_lib.resolve_model_config(cfg, check_paths=False)
  return estimate(m, int(cfg.data.batch_size), int(cfg.data.seq_len), execution=execution_of(cfg, platform=platform))


# -- host memory (RSS) of a CPU run ------------------------------------------------------------------------

# What a CPU training process holds besides the train step's arrays, measured on the 2-core machine with
# the allocator the CLIs use (tcmalloc; /proc/PID/status VmRSS sampled every 0.25 s, docs/finetune.md):
# python + jax/XLA:CPU + the package's imports + the compiled executables + the data pipeline's buffers
# before the first step (llama_tiny, finetune_hf on a 135M Llama: 0.40-0.55 GiB).
RUNTIME_BASELINE = 480 * MiB
# tcmalloc keeps freed spans mapped, and the train step's temp buffer (malloc'd on every call) is served
# from a second span once (XLA:CPU's allocations between calls fragment the first): the heap holds two
# temp buffers' worth from the first steps on, while one is in use.
TEMP_COPIES = 2


def host_rss(est: Estimate, cfg: Any) -> dict[str, int]:
  """The peak resident memory of cfg's training process on CPU, by term (bytes): on CPU the "device"
  arrays are host memory, so the train step's estimate plus what the host adds:
    runtime     RUNTIME_BASELINE (interpreter, jax/XLA:CPU, imports, executables, data pipeline)
    state       params + optimizer state (+ the batch) live for the whole run
    step_temp   the step's temporaries (est.total - state), TEMP_COPIES of them held by the allocator
    checkpoint  Orbax's host copy of the saved state while it writes (a LoRA run: the adapters only)
    init_from   loading the source's weights: a float32 host copy next to the state being built
  peak = runtime + state + max(step_temp, checkpoint, init_from): the three happen at different
  times; the loop hands free pages back after loading and after each evaluation (host_alloc)."""
  state = est.bytes.get("params", 0) + est.bytes.get("optimizer", 0) + est.bytes.get("batch", 0)
  temp = max(est.total - state, 0)
  lora = cfg.train.get("lora") if "train" in cfg else None
  lora_on = bool(lora) and int(lora.get("rank", 0)) > 0
  trained = est.params if not lora_on else est.bytes.get("optimizer", 0) // (2 * F32)
  saved = trained * F32 + est.bytes.get("optimizer", 0)
  source = str(cfg.train.get("init_from", "") or "") if "train" in cfg else ""
  load = est.params * F32 if source else 0
  terms = {"runtime": RUNTIME_BASELINE, "state": state, "step_temp": TEMP_COPIES * temp,
           "checkpoint": saved, "init_from": load}
  terms["peak"] = terms["runtime"] + state + max(terms["step_temp"], saved, load)
  return terms


def format_host(terms: dict[str, int]) -> str:
  """The host-RSS lines of tformer-estimate (a CPU run)."""
  g = lambda b: f"{b / (1024 * MiB):6.2f} GiB"  # noqa: E731
  return "\n".join([
      "host RSS of this run on CPU (train step + what the host adds; peak = runtime + state + the largest of "
      "the rest):",
      f"  runtime        {g(terms['runtime'])}  (python, jax/XLA:CPU, imports, executables, data pipeline)",
      f"  state          {g(terms['state'])}  (params + optimizer state + batch)",
      f"  step_temp      {g(terms['step_temp'])}  (the step's temporaries x{TEMP_COPIES}: the allocator's heap)",
      f"  checkpoint     {g(terms['checkpoint'])}  (Orbax's host copy of the saved state)",
      f"  init_from      {g(terms['init_from'])}  (the source's weights in float32 while they load)",
      f"  peak           {g(terms['peak'])}"])


# -- XLA's side ---------------------------------------------------------------------------------------------

def _memory(compiled: Any) -> dict[str, Any]:
  ma = compiled.memory_analysis()
  out = {"argument": float(ma.argument_size_in_bytes), "output": float(ma.output_size_in_bytes),
         "alias": float(ma.alias_size_in_bytes), "temp": float(ma.temp_size_in_bytes)}
  out["total"] = out["argument"] + out["temp"] + max(out["output"] - out["alias"], 0.0)
  return out


def _flops(compiled: Any) -> float:
  ca = compiled.cost_analysis()
  ca = ca[0] if isinstance(ca, (list, tuple)) else ca
  return float(ca.get("flops", float("nan"))) if ca else float("nan")


def compiled_analysis(m: ModelConfig, batch: int, seq: int, optim_cfg: Any = None) -> dict[str, float]:
  """memory_analysis() and cost_analysis() of the train step (donated state) for `m`, traced under the
  current backend (backends.use; default the reference one); under scan_layers XLA's FLOPs count one
  layer. For a config, `compiled_analysis_config` (the run's exact step, FLOPs counted unrolled)."""
  optim_cfg = optim_cfg if optim_cfg is not None else default_config().optim
  model = Transformer(m)
  tx, schedule = optim.make_optimizer(optim_cfg, 1000)
  init = state_lib.init_fn(model, tx, precision.get_policy("float32").initial_loss_scale(), seq)
  state = jax.eval_shape(lambda r: state_lib.unbox_plain(init(r)), jax.random.PRNGKey(0))
  tok = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
  fn = step_lib.make_train_step(model, tx, schedule, optim_cfg)
  compiled = jax.jit(fn, donate_argnums=(0,)).lower(state, {"inputs": tok, "targets": tok}).compile()
  out = _memory(compiled)
  out["flops"] = _flops(compiled)
  out["flops_per_token"] = out["flops"] / (batch * seq)
  return out


def _compile_config(cfg: Any) -> tuple[Any, str]:
  """cfg's train step as train/setup.py builds it, on a one-device mesh, compiled: (compiled, runtime)."""
  cfg = cfg.copy_and_resolve_references()
  cfg.mesh.shape, cfg.mesh.parallelism, cfg.mesh.num_devices = (1,) * len(tuple(cfg.mesh.axes)), "jit", 1
  mesh = mesh_lib.make_mesh(cfg.mesh, devices=jax.devices()[:1])
  rt = backends.resolve_runtime(cfg, mesh_devices=1, quiet=True)
  with backends.use(rt.backend):
    program = setup_lib.build(cfg, mesh, rt.backend, check_paths=False)
    batch = setup_lib.abstract_batch(cfg, mesh)
    return program.train_step.lower(program.abstract, batch).compile(), rt.summary()


def compiled_analysis_config(cfg: Any, *, flops: bool = True) -> dict[str, Any]:
  """XLA's figures for cfg's train step compiled as a run compiles it (train/setup.py, one device,
  cfg.runtime resolved here): memory_analysis() bytes, 'total' = arguments + temporaries, and 'runtime'.
  flops: + 'flops' / 'flops_per_token' from a second compile XLA can count (the module docstring)."""
  compiled, runtime = _compile_config(cfg)
  out: dict[str, Any] = _memory(compiled)
  out["runtime"] = runtime
  if flops:
    ref = cfg.copy_and_resolve_references()
    ref.runtime.backend, ref.runtime.attention, ref.runtime.cpu_kernels = "reference", "reference", "off"
    ref.model.scan_layers = False
    out["flops"] = _flops(_compile_config(ref)[0])
    out["flops_per_token"] = out["flops"] / (int(cfg.data.batch_size) * int(cfg.data.seq_len))
    out["flops_runtime"] = "reference backend, dense attention, unrolled layers"
  return out


# -- the report ---------------------------------------------------------------------------------------------

def format_report(m: ModelConfig, est: Estimate, batch: int, seq: int, xla: dict[str, Any] | None = None,
                  kv: tuple[int, int] | None = None) -> str:
  """A text report: the estimate by term, next to XLA's numbers when given (with estimate/XLA)."""
  unit, scale = ("GiB", 1024 * MiB) if est.total >= 16 * 1024 * MiB else ("MiB", MiB)
  mb = lambda b: f"{b / scale:10.2f} {unit}"  # noqa: E731
  moe = f", MoE {m.moe.num_experts} experts top-{m.moe.top_k} {m.moe.dispatch}" if m.moe.num_experts else ""
  lines = [f"model: d_model={m.d_model} layers={m.num_layers} heads={m.num_heads}/{m.kv_heads} head_dim={m.hd} "
           f"ff={m.ff} vocab={m.vocab_size} ({m.activation}, {m.norm}{moe}); batch={batch} seq={seq} "
           f"remat={m.remat} scan_layers={m.scan_layers}",
           f"parameters: {est.params:,} (exact, from jax.eval_shape)"]
  if est.execution:
    lines.append(f"estimated for: {est.execution}")
  lines.append("")
  for k, v in est.bytes.items():
    if v or k in ("params", "optimizer", "activations"):
      lines.append(f"  {k:<15}{mb(v)}")
  phase = max(est.phases, key=est.phases.get) if est.phases else "backward"
  if "per device of" in est.execution:        # estimate_on_mesh: activation_per_layer is one layer's backward
    lines.append(f"  {'total':<15}{mb(est.total)}   (per device; peak in the {phase} phase, one recomputed "
                 f"layer's backward adds {est.activation_per_layer / scale:.2f} {unit})")
  else:
    lines.append(f"  {'total':<15}{mb(est.total)}   (peak in the {phase} phase; the largest block keeps "
                 f"{est.activation_per_layer / scale:.2f} {unit}; one device: --devices=N for a mesh)")
  formula = ("6 N_matmul + 12 n L h hd, the layers x4/3 (remat 'full')" if est.remat and m.remat == "full"
             else "6 N_matmul + 12 n L h hd")
  lines.append(f"  FLOPs/token    {est.flops_per_token:,.0f}  ({formula})")
  executed = est.executed_flops_per_token or est.flops_per_token
  if executed != est.flops_per_token:
    lines.append(f"  executed       {executed:,.0f}  (+ the MoE dispatch / chunked loss as the step runs them)")
  lines += [f"  note: {note}" for note in est.notes]
  if xla is not None:
    lines += ["", f"XLA compiled train step (memory_analysis), {xla.get('runtime', 'the current backend')}:",
              f"  arguments      {mb(xla['argument'])}", f"  temporaries    {mb(xla['temp'])}",
              f"  total          {mb(xla['total'])}   estimate/XLA = {est.total / xla['total']:.3f}"]
    if "flops_per_token" in xla:
      lines.append(f"  FLOPs/token    {xla['flops_per_token']:,.0f}   estimate/XLA = "
                   f"{executed / xla['flops_per_token']:.3f}  ({xla.get('flops_runtime', 'cost_analysis')})")
  if kv is not None:
    b, length = kv
    for name, nbytes in (("float32", 4), ("bf16/fp16", 2)):
      total = kv_cache_bytes(m.num_layers, b, length, m.kv_heads, m.hd, nbytes)
      lines.append(f"KV cache batch={b} len={length} {name}: {mb(total)} "
                   f"({total / m.num_layers / MiB:.2f} MiB per layer)")
    q8 = kv_cache_bytes_as(m, b, length, "int8")
    lines.append(f"KV cache batch={b} len={length} int8 (decode.cache_dtype=int8, scales included): {mb(q8)} "
                 f"({q8 / kv_cache_bytes(m.num_layers, b, length, m.kv_heads, m.hd, 2):.3f}x bf16)")
  return "\n".join(lines)


__all__ = ["Estimate", "Execution", "activation_bytes_per_layer", "compiled_analysis", "compiled_analysis_config",
           "estimate", "estimate_config", "execution_of", "extra_flops_per_token", "flops_per_token",
           "format_host", "format_report", "host_rss", "kv_cache_bytes", "optimizer_state_bytes", "param_count",
           "param_shapes"]
