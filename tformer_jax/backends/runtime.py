"""`resolve_runtime(cfg)`: the `runtime` config section turned into one backend, once per run.

Every 'auto' is decided here and nowhere else, from the platform, the model's dtypes, the mesh and
whether the C++ kernels build. The choice is logged in one short line; its reasons (the rule behind each
'auto') go to the workdir's runtime.json and `tformer-doctor --kernels_only`. A CPU run that the cpu extra
would speed up (its C++ kernels) says so in that line. The allocator is chosen earlier, when a CLI process
starts (backends/cpu/host_alloc.py); this reports what the process runs with.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
from typing import Any

import jax
import ml_collections

from tformer_jax import config as config_lib
from tformer_jax.backends.base import Backend
from tformer_jax.backends.cpu import host_alloc, kernels as cpu_kernel
from tformer_jax.backends.cpu.xla_cpu import XlaCpuBackend

log = logging.getLogger("tformer_jax")


@dataclasses.dataclass(frozen=True)
class Runtime:
  backend: Backend
  platform: str
  allocator: str
  reasons: tuple[str, ...]   # why each 'auto' went the way it did
  advice: str = ""           # what would make the run faster (the extra to install), in the log line

  def summary(self) -> str:
    """The one log line (at most about 160 characters): backend, attention, kernels, allocator, advice; the
    reasons are in runtime.json (`as_dict()`)."""
    return (f"runtime: {self.backend.describe()} on {self.platform}, allocator {self.allocator}"
            + (f"; {self.advice}" if self.advice else "") + ("; why: runtime.json" if self.reasons else ""))

  def as_dict(self) -> dict[str, Any]:
    b = self.backend
    return {"backend": b.name, "attention": b.attention_impl, "attention_block_q": b.block_q,
            "attention_block_k": b.block_k, "splash_block_q": b.splash_block_q,
            "splash_block_kv": b.splash_block_kv, "splash_interpret": b.splash_interpret,
            "context_strategy": b.context_strategy, "context_load_balance": b.context_load_balance,
            "cpu_kernels": bool(getattr(b, "cpu_kernels", False)),
            "cpu_matmul": getattr(b, "cpu_matmul", None) if getattr(b, "cpu_kernels", False) else None,
            "cpu_blas": getattr(b, "cpu_blas", None) if getattr(b, "cpu_kernels", False) else None,
            "platform": self.platform, "allocator": self.allocator,
            "moe_exchange": b.moe_exchange, "moe_gmm": b.moe_gmm, "moe_interpret": b.moe_interpret,
            "decode_layout": b.decode_layout, "reasons": list(self.reasons)}


def resolve_runtime(cfg: Any, *, model: config_lib.ModelConfig | None = None, mesh_devices: int = 1,
                    platform: str | None = None, quiet: bool = False) -> Runtime:
  """The run's backend from cfg.runtime (defaults where the section or a field is missing).

  model: the architecture, when it is not cfg.model (an HF model being generated from).
  mesh_devices: devices of the jit mesh the step is partitioned over (the C++ kernels are
  single-device custom calls; pmap runs them per device, so pass 1 there). Raises ConfigError for a
  choice this platform cannot run. Logs `Runtime.summary()` unless quiet."""
  rt = dict(config_lib.default_config().runtime)
  rt.update(dict(cfg.get("runtime", {})))
  m = config_lib.ModelConfig.from_config(cfg.model) if model is None else model
  precision = cfg.train.get("precision", "float32") if "train" in cfg else "float32"
  config_lib.validate_runtime(ml_collections.ConfigDict(rt), m, precision)   # the platform-free rules
  platform = platform or jax.default_backend()
  reasons: list[str] = []

  backend = rt["backend"]
  if backend == "auto":
    backend = "xla_cpu" if platform == "cpu" else "reference"
    reasons.append(f"backend {backend}: platform {platform}")
  elif backend == "xla_cpu" and platform != "cpu":
    raise config_lib.ConfigError(f"runtime.backend: 'xla_cpu' runs on the CPU platform; this is "
                                 f"{platform!r}: use 'reference' or 'auto'")

  attention, fallback = _attention(rt["attention"], m, cfg, platform, reasons)
  blocks = dict(attention_impl=attention, block_q=int(rt["attention_block_q"]),
                block_k=int(rt["attention_block_k"]), cudnn_fallback=fallback,
                splash_block_q=int(rt.get("splash_block_q", 512)),
                splash_block_kv=int(rt.get("splash_block_kv", 512)), splash_interpret=platform != "tpu",
                context_strategy=str(cfg.get("mesh", {}).get("context_strategy", "all_gather")),
                context_load_balance=bool(cfg.get("mesh", {}).get("context_load_balance", True)))
  if "context" in tuple(cfg.get("mesh", {}).get("axes", ())):
    lb = blocks["context_load_balance"] and blocks["context_strategy"] == "all_gather"
    reasons.append(f"context {blocks['context_strategy']}: " + (
        "the causal sequence striped over the context shards (load balance)" if lb else "contiguous shards"))
  if attention == "splash" and platform != "tpu":
    reasons.append("splash in Pallas interpret mode: the target is not a TPU")
  blocks.update(_resolve_moe(rt, m, platform, reasons))
  blocks["decode_layout"] = _decode_layout(rt.get("decode_layout", "auto"), platform, reasons)

  advice = ""
  if backend == "reference":
    chosen: Backend = Backend(**blocks)
  else:
    use_kernels, bf16 = _cpu_kernels(rt["cpu_kernels"], m, precision, mesh_devices, reasons)
    if rt["cpu_kernels"] == "auto" and reasons[-1] == f"C++ kernels off: {cpu_kernel.CPU_EXTRA}":
      advice = "faster: pip install 'tformer_jax[cpu]'"
    matmul, blas = "weight_grads", "openblas"
    if use_kernels:
      blas = _cpu_blas(rt.get("cpu_blas", "auto"), bf16, reasons)
      if bf16 and not cpu_kernel.build.bf16_blas_available(blas)[0] and rt["cpu_kernels"] == "auto":
        use_kernels = False
        reasons[-1] += ("; C++ kernels off after all: bfloat16 compute needs a bfloat16 gemm that runs on this "
                        "CPU, which OpenBLAS's wheel lacks (oneMKL's, or oneDNN's with AVX-512: runtime.cpu_blas "
                        "'mkl' or 'onednn')")
      else:
        matmul = _cpu_matmul(rt.get("cpu_matmul", "auto"), blas, m.remat, reasons)
    chosen = XlaCpuBackend(cpu_kernels=use_kernels, cpu_matmul=matmul, cpu_blas=blas, **blocks)
    if use_kernels and attention == "chunked" and (m.attn_softcap or m.attention_sinks):
      reasons.append("attention chunked in jnp, not the C++ kernel: it has no soft cap or sinks")

  out = Runtime(chosen, platform, host_alloc.loaded_allocator(), tuple(reasons), advice)
  if not quiet:
    log.info(out.summary())
  return out


def _attention(choice: str, m: config_lib.ModelConfig, cfg: Any, platform: str,
               reasons: list[str]) -> tuple[str, str]:
  """(runtime.attention, the impl that serves the calls cuDNN cannot under 'auto' ('' = none))."""
  attention, fallback = choice, ""
  if attention == "auto":
    features = config_lib.attention_features(m)
    if config_lib.attention_unsupported("chunked", features):   # what no tiled kernel has
      attention = "reference"
      reasons.append("attention reference: dropout, a T5 bias, global tokens or random blocks need the dense path")
    elif platform == "cpu":
      attention = "chunked"
      reasons.append("attention chunked: the fastest exact path on CPU")
    elif platform == "tpu" and not config_lib.attention_unsupported("splash", features):
      attention = "splash"
      reasons.append("attention splash: jax's Pallas TPU kernel (block-sparse causal/window, segment ids)")
    elif why := config_lib.attention_unsupported("xla", features):
      attention = "blockwise"
      reasons.append(f"attention blockwise: {why}")
    elif platform == "gpu" and m.dtype in ("bfloat16", "float16") and m.position != "alibi":
      attention, fallback = "cudnn", "xla"
      reasons.append("attention cudnn (calls it cannot serve, e.g. packed documents, run xla)")
    else:
      attention = "xla"
      reasons.append(f"attention xla: jax.nn.dot_product_attention on {platform}")
  elif attention == "cudnn" and platform != "gpu":
    raise config_lib.ConfigError(f"runtime.attention: 'cudnn' needs a GPU; this is {platform!r}: use "
                                 "'xla', 'blockwise', 'chunked' or 'reference'")
  elif attention == "cudnn" and "data" in cfg and cfg.data.get("packing", "") == "document":
    raise config_lib.ConfigError("runtime.attention: 'cudnn' cannot mask packed documents (segment ids); "
                                 "use 'auto' (falls back to xla for them), 'xla' or 'blockwise'")
  return attention, fallback


def _cpu_kernels(kernels: str, m: config_lib.ModelConfig, precision: str, mesh_devices: int,
                 reasons: list[str]) -> tuple[bool, bool]:
  """(whether the xla_cpu backend runs its C++ kernels (runtime.cpu_kernels: auto | on | off), whether the
  model computes in bfloat16). 'auto' wants float32 parameters and float32 or bfloat16 compute (once
  train.precision's policy applies); bfloat16 compute then also wants the BLAS's bfloat16 gemm (oneMKL, oneDNN),
  checked by the caller once the BLAS is chosen."""
  ok, why = cpu_kernel.available()
  compute = {"bf16": "bfloat16", "fp16": "float16"}.get(precision, m.dtype)
  bf16 = compute == "bfloat16"
  f32 = m.param_dtype == "float32" and compute in ("float32", "bfloat16")
  if kernels == "on":
    if not ok:
      raise config_lib.ConfigError(f"runtime.cpu_kernels: 'on' but the C++ kernels are unavailable: {why}")
    use_kernels = True
  elif kernels == "off":
    use_kernels = False
  else:
    use_kernels = ok and f32 and mesh_devices <= 1
    reasons.append("C++ kernels " + (f"on: {compute}, one device, built" if use_kernels else "off: " + (
        "not float32 parameters with float32 or bfloat16 compute" if not f32
        else f"a {mesh_devices}-device mesh" if mesh_devices > 1
        else cpu_kernel.CPU_EXTRA if why.startswith(cpu_kernel.CPU_EXTRA) else f"unavailable ({why})")))
  return use_kernels, bf16


def _cpu_matmul(choice: str, blas: str, remat: str, reasons: list[str]) -> str:
  """Which projection products the C++ kernels run (runtime.cpu_matmul): 'all' on oneMKL or oneDNN, whose
  gemms beat XLA's dot; 'weight_grads' on OpenBLAS, where 'all' is no faster (the figures behind the rule:
  docs/runtime.md). The remat policies that
  keep dots by primitive ('dots', 'dots_no_batch') do not see the custom call as one and would recompute
  it: 'weight_grads' there (the named policies, 'save_qkvo' and 'save_mlp_in', keep its output by name)."""
  if choice != "auto":
    return choice
  if blas not in ("mkl", "onednn"):
    reasons.append("matmuls weight_grads: XLA's dot for the forward and input gradients ('all' on OpenBLAS "
                   "is no faster)")
    return "weight_grads"
  if remat in ("dots", "dots_no_batch"):
    reasons.append(f"matmuls weight_grads: remat {remat!r} keeps dots by primitive, which the C++ call is not")
    return "weight_grads"
  reasons.append(f"matmuls all: the projections' forward and input gradients on {blas} too (faster than XLA's dot)")
  return "all"


def cpu_vendor() -> str:
  """The CPU's vendor ('GenuineIntel', 'AuthenticAMD', ...; '' where unknown)."""
  return cpu_kernel.build.cpu_field("vendor_id")


def _cpu_blas(choice: str, bf16: bool, reasons: list[str]) -> str:
  """The gemms the C++ kernels call (runtime.cpu_blas), applied to the process (backends/cpu/kernels/build.py).
  'auto': oneMKL on an Intel CPU where the `mkl` wheel is installed; else, for bfloat16 compute, oneDNN where
  the `onednn-cpu-gomp` wheel is (a bfloat16 gemm, which OpenBLAS's wheel lacks; MKL's is slow off Intel);
  else OpenBLAS. The figures behind the rule: docs/runtime.md."""
  if choice == "auto":
    vendor = cpu_vendor()
    mkl = vendor == "GenuineIntel" and cpu_kernel.blas_available("mkl")[0]
    dnnl = bf16 and not mkl and cpu_kernel.build.bf16_blas_available("onednn")[0]
    choice = "mkl" if mkl else "onednn" if dnnl else "openblas"
    reasons.append("BLAS " + (
        "mkl: an Intel CPU and the `mkl` wheel installed" if mkl else
        "onednn: bfloat16 compute and the `onednn-cpu-gomp` wheel installed (its bfloat16 gemm)" if dnnl else
        "openblas: " + ("`pip install mkl` would give MKL on this Intel CPU" if vendor == "GenuineIntel" else
                        f"not an Intel CPU ({vendor or 'unknown'}: MKL is slower than OpenBLAS there)")
        + ("; `pip install onednn-cpu-gomp` would give the kernels a bfloat16 gemm" if bf16 else "")))
  else:
    ok, why = cpu_kernel.blas_available(choice)
    if not ok:
      raise config_lib.ConfigError(f"runtime.cpu_blas: {choice!r} is unavailable: {why}")
  cpu_kernel.load(blas=choice)
  return choice


def _decode_layout(choice: str, platform: str, reasons: list[str]) -> str:
  """Scanned or unrolled layers for decoding (decode.decode_layout), from the target platform (the
  figures behind the rule: docs/runtime.md, "The decode layout")."""
  if choice != "auto":
    return choice
  if platform == "cpu":
    reasons.append("decode unrolled: XLA:CPU copies each layer's weights out of a scanned stack at every "
                   "step, so unrolled layers decode faster there")
    return "unrolled"
  reasons.append(f"decode scanned: one compiled layer body on {platform} (the default where unrolling "
                 "has not been shown to pay)")
  return "scanned"


def _resolve_moe(rt: dict[str, Any], m: config_lib.ModelConfig, platform: str,
                 reasons: list[str]) -> dict[str, Any]:
  """The MoE exchange and grouped matmul (backends/moe.py) for the target platform."""
  exchange, gmm = rt.get("moe_exchange", "auto"), rt.get("moe_gmm", "auto")
  if exchange == "ragged" and platform == "cpu":
    raise config_lib.ConfigError("runtime.moe_exchange: 'ragged' needs ragged-all-to-all, which XLA:CPU "
                                 "lacks; use 'all_to_all' (the exact dense fallback) or 'auto'")
  auto_gmm = gmm == "auto"
  if auto_gmm:   # megablox's tgmm forms each local expert's weight gradient over its own rows; XLA:TPU's
    # transpose of ragged_dot runs every local expert over every row (x local experts the work)
    gmm = "megablox" if platform == "tpu" else "ragged_dot"
  interpret = gmm == "megablox" and platform != "tpu"
  if m.moe.num_experts <= 0:
    return dict(moe_exchange="global" if exchange == "auto" else exchange, moe_gmm=gmm,
                moe_interpret=interpret)
  if exchange == "auto":
    exchange = "all_to_all" if platform == "cpu" else "ragged"
    reasons.append(f"MoE expert parallel over the mesh's 'expert' axis (global without one): {exchange} "
                   + ("(XLA:CPU has no ragged-all-to-all)" if platform == "cpu"
                      else f"(ragged_all_to_all on {platform})"))
  why = {"megablox": " (its weight gradient per expert's own rows; ragged_dot's on XLA:TPU runs every expert "
                     "over every row)", "ragged_dot": " (jax.lax.ragged_dot)"}
  reasons.append(f"MoE grouped matmul {gmm}" + (why[gmm] if auto_gmm else "")
                 + (" (Pallas interpret mode: not a TPU)" if interpret else ""))
  return dict(moe_exchange=exchange, moe_gmm=gmm, moe_interpret=interpret)


def enable_compilation_cache(cache_dir: str = "") -> pathlib.Path:
  """Turn on JAX's persistent compilation cache under cache_dir (default $TFORMER_CACHE or
  ~/.cache/tformer_jax) + '/jax_compile': a rerun (training, or generation with the same model and
  prompt bucket) loads its executables instead of compiling them. Compiles under 1 s are not stored
  (JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS, JAX's own variable, sets another threshold)."""
  root = pathlib.Path(cache_dir or os.environ.get("TFORMER_CACHE", "~/.cache/tformer_jax")).expanduser()
  jax.config.update("jax_compilation_cache_dir", str(root / "jax_compile"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs",
                    float(os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", 1.0)))
  return root / "jax_compile"
