"""What a train step runs and what its estimate holds: `Execution` (resolved from a config as the run
resolves it: `execution_of`) and `Estimate` (the peak by term, the FLOPs, the notes)."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from tformer_jax import backends
from tformer_jax.config import ModelConfig, default_config
from tformer_jax.train import setup as setup_lib

MiB = 1024 * 1024
F32 = 4


@dataclasses.dataclass(frozen=True)
class Execution:
  """How the train step runs the model: what, besides the architecture, changes its memory.
  `execution_of(cfg)` resolves it from a config as a run does (backends.resolve_runtime)."""
  backend: str = "reference"        # reference | xla_cpu
  attention: str = "reference"      # runtime.attention resolved: reference | chunked | blockwise | xla | cudnn
  block_q: int = 128                # the chunked query chunk / blockwise query tile
  block_k: int = 128                # the blockwise key tile
  cpu_kernels: bool = False         # xla_cpu: the C++ kernels (chunked attention, SwiGLU, fused AdamW)
  cpu_blas: str = "openblas"        # xla_cpu: the kernels' BLAS (bfloat16 runs on them with 'mkl' or 'onednn')
  cpu_matmul: str = "weight_grads"  # xla_cpu: the projections' products on the kernels ('all': y and dx too)
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
      return "chunked_cpu" if self.kernels_take(m) else "chunked"
    return {"blockwise": "blockwise", "cudnn": "flash", "splash": "flash"}.get(self.attention, "dense")

  def kernels_take(self, m: ModelConfig) -> bool:
    """Whether the C++ kernels run the model's compute dtype (backends/cpu/xla_cpu._kernel_dtype): float32, or
    bfloat16 where the BLAS has a bfloat16 gemm (MKL, oneDNN)."""
    return (self.backend == "xla_cpu" and self.cpu_kernels
            and (m.dtype == "float32" or (m.dtype == "bfloat16" and self.cpu_blas in backends.BF16_BLAS)))

  def glu_kernel(self, m: ModelConfig) -> bool:
    """Whether a dense FFN's gated activation runs as the C++ SwiGLU (xla_cpu's Backend.glu; no BLAS)."""
    return (self.backend == "xla_cpu" and self.cpu_kernels and m.activation == "swiglu"
            and m.dtype in ("float32", "bfloat16"))

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
  bytes: dict[str, int]                # the terms of the peak phase (package docstring)
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


def dtype_bytes(dtype: str) -> int:
  return jnp.dtype(dtype).itemsize


def execution_of(cfg: Any, *, platform: str | None = None, mesh_devices: int = 1) -> Execution:
  """The Execution of cfg's run: cfg.runtime resolved as backends.resolve_runtime does on `platform`
  (default this process's) and `mesh_devices`, the loss, accumulation, optimizer and batch arrays of cfg."""
  rt = backends.resolve_runtime(cfg, platform=platform, mesh_devices=mesh_devices, quiet=True)
  b = rt.backend
  arrays = tuple((name, jnp.dtype(dt).itemsize) for name, (_, dt) in setup_lib.batch_spec(cfg.data).items())
  lora = setup_lib.lora_settings(cfg)
  return Execution(backend=b.name, attention=b.attention_impl, block_q=b.block_q, block_k=b.block_k,
                   cpu_kernels=bool(getattr(b, "cpu_kernels", False)), cpu_blas=str(getattr(b, "cpu_blas", "openblas")),
                   cpu_matmul=str(getattr(b, "cpu_matmul", "weight_grads")), platform=rt.platform,
                   loss_chunk=int(cfg.train.get("loss_chunk", 0) or 0), grad_accum=int(cfg.optim.grad_accum),
                   optim=cfg.optim, batch_arrays=arrays, moe_exchange=str(getattr(b, "moe_exchange", "global")),
                   lora=lora[:2] if lora else None)
