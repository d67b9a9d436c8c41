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
  norms       NORM_KEPT (T, D) float32 arrays for the two norms and the residual stream (in the compute
              dtype where the C++ kernels take it: bfloat16 on MKL)
  attention   q, k, v and the output (x ATTENTION_KEPT) + the probabilities the implementation keeps:
              dense (B, H, L, S) float32 x3; chunked: the chunk table's rows x visible keys (C++ kernel
              x1, XLA's version x2: p and p transposed); blockwise and cuDNN: none
  ffn         FFN_KEPT[activation] (T, F) arrays (FFN_KEPT_SCAN under scan_layers; GLU_KERNEL_SAVES fewer
              with SwiGLU on the C++ kernel)
  moe         router (T, E) float32 x3; dropless: the T*top_k sorted rows through the FFN; off TPU
              jax.lax.ragged_dot lowers to a dense expansion: (E, N, D) and (E, N, F) (+ bool masks) kept,
              3 (E, N, F) more while its backward runs; capacity: CAPACITY_KEPT (T, E, C) float32
              one-hot dispatch/combine tensors, the experts' FFN on (E, C) slots
  remat       'full' (effective under scan_layers, or off CPU): the block inputs (n x T x D) + one
              block recomputed in the backward; 'dots': every matmul output + the rest of one block
  loss        full logits: LOGITS_KEPT (+1 tied) (T, V) float32; loss_chunk: one chunk's logits, two
              (T, D) copies of the hidden states and the (D, V) float32 gradient accumulator
XLA:CPU specifics (platform 'cpu'): half-precision matmuls run in float32 (their float32 result is kept
next to the half copy; not on the C++ matmul, which writes bfloat16 itself), a scanned half-precision
stack keeps float32 residuals, an unrolled rematerialised graph keeps its activations, ragged_dot expands
in float32. GPU and TPU estimates use the same arrays without these (ragged_dot native on TPU only).
`estimate` is for one device (no sharding).

Per device on a mesh (`estimate_on_mesh(cfg, devices)`, tformer-estimate --devices, printed by tformer-aot
next to XLA:TPU's compiled peak): the state exact from the shardings the rules give (`layout_of`), the
batch, sequence, heads, FFN, vocabulary and experts split as the rules split them, and what XLA:TPU
keeps at the peak of a remat'd, scanned step (read off its buffer assignment; see FFN_KEPT_TPU):
  params + optimizer + batch + compute_params + grads (float32) + activations (n x T x D) + working
  working = max(loss: the (T, V) logits in float32 + compute dtype,
                backward: the compute-dtype logits gradient + one recomputed layer's arrays)

FLOPs per token (training = forward + backward = 3 x forward), analysis/flops.py's formula:
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

Calibration: every constant of device.py was read off XLA:CPU's buffer assignment of the compiled step
(XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_as_text: the *-live-range.txt file lists the buffers live
at the peak, each with the op that made it) and checked on the shipped presets and ~20 random tiny
configs: the presets within 6%, the random configs within 15% except small loss-dominated ones, where
XLA's heap packs the (T, V) logits buffers loosely (up to 2 more such arrays).

The package, one job a module: `execution` (Execution, Estimate, execution_of), `params` (exact
sizes from shapes), `device` (the one-device model: estimate, estimate_config), `flops`, `mesh`
(estimate_on_mesh, layout_of), `host` (host_rss), `xla` (compiled_analysis_config), `report`
(format_report).
"""
from tformer_jax.analysis.estimate.device import (
    ATTENTION_KEPT,
    CAPACITY_KEPT,
    FFN_KEPT,
    FFN_KEPT_SCAN,
    LOGITS_KEPT,
    LORA_KERNEL_COPIES,
    NORM_KEPT,
    SCAN_WEIGHT_COPIES,
    activation_bytes_per_layer,
    attention_kept_bytes,
    estimate,
    estimate_config,
    ffn_kept_bytes,
    layer_kept_bytes,
    loss_working_bytes,
    matmul_outputs_bytes,
    moe_kept_bytes,
)
from tformer_jax.analysis.estimate.execution import F32, Estimate, Execution, MiB, dtype_bytes, execution_of
from tformer_jax.analysis.estimate.flops import extra_flops_per_token, flops_per_token
from tformer_jax.analysis.estimate.host import RUNTIME_BASELINE, TEMP_COPIES, format_host, host_rss
from tformer_jax.analysis.estimate.mesh import (
    DENSE_SCORES_F32,
    FFN_KEPT_TPU,
    Layout,
    estimate_on_mesh,
    estimate_sharded,
    layout_of,
    seq_kv,
)
from tformer_jax.analysis.estimate.params import (
    compute_cast_params,
    kv_cache_bytes,
    kv_cache_bytes_as,
    layer_params,
    lora_shapes,
    optimizer_state_bytes,
    param_count,
    param_shapes,
)
from tformer_jax.analysis.estimate.report import format_report
from tformer_jax.analysis.estimate.xla import compiled_analysis, compiled_analysis_config
from tformer_jax.train import setup as setup_lib  # noqa: F401 (est_lib.setup_lib.resolve_model_config)

__all__ = [
    "ATTENTION_KEPT", "CAPACITY_KEPT", "DENSE_SCORES_F32", "Estimate", "Execution", "F32", "FFN_KEPT",
    "FFN_KEPT_SCAN", "FFN_KEPT_TPU", "LOGITS_KEPT", "LORA_KERNEL_COPIES", "Layout", "MiB", "NORM_KEPT",
    "RUNTIME_BASELINE", "SCAN_WEIGHT_COPIES", "TEMP_COPIES", "activation_bytes_per_layer",
    "attention_kept_bytes", "compiled_analysis", "compiled_analysis_config", "compute_cast_params",
    "dtype_bytes", "estimate", "estimate_config", "estimate_on_mesh", "estimate_sharded", "execution_of",
    "extra_flops_per_token", "ffn_kept_bytes", "flops_per_token", "format_host", "format_report", "host_rss",
    "kv_cache_bytes", "kv_cache_bytes_as", "layer_kept_bytes", "layer_params", "layout_of", "lora_shapes",
    "loss_working_bytes", "matmul_outputs_bytes", "moe_kept_bytes", "optimizer_state_bytes", "param_count",
    "param_shapes", "seq_kv",
]
