"""PyTorch peer of configs/bench/llama_1b_gpu.py: transformers LlamaForCausalLM, same shape, batch and FLOPs.

  python benchmarks/torch_llama.py [--mode eager|compile|both] [--steps 10 --warmup 3] [--batch 16] [--json OUT]
  python benchmarks/torch_llama.py --config.model.num_layers=2 ...   # any model field of the config

The model is transformers' LlamaForCausalLM built from the config's architecture through the project's own
HF mapping (tformer_jax/interop/families/llama.py `llama_to_hf`: same vocab, width, layers, heads, KV heads, head
dim, SwiGLU width, RMSNorm eps, RoPE theta, untied head), random weights, SDPA attention
(F.scaled_dot_product_attention, causal: what a PyTorch user gets). The step: float32 parameters, forward
under torch.autocast(bfloat16), float32 cross-entropy over every position, backward, clip the global grad
norm (optim.clip_norm), AdamW(fused=True) with the config's betas/eps/weight decay (>= 2-D parameters only),
as tformer_jax.train.optim does. Synthetic random tokens already on the device; batch x seq =
data.batch_size x data.seq_len unless --batch.
Timing: the first step (torch.compile builds here) is `first_step_s`, then --warmup untimed steps, then
--steps timed steps dispatched back to back with one device synchronisation at the end: tokens_per_s =
steps * batch * seq / that wall time. FLOPs: the formula of tformer_jax/analysis/flops.py ('full' attention
term), counted from this model's own parameters: 6 * N_matmul * T + 12 * layers * heads * head_dim * seq * T,
N_matmul = every parameter but the token embedding (plus the head again when tied).
--mode both runs eager, then a fresh model under torch.compile (--compile-backend, default inductor), in one
process; the JSON file (--json) is rewritten after each mode, so a later failure keeps the earlier mode.
A failure of one mode (out of memory, a compiler error) is recorded as that mode's `error`.
"""
from __future__ import annotations

import gc
import json
import math
import os
import pathlib
import sys
import time
import traceback
from typing import Any, Sequence

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
  sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from absl import flags  # noqa: E402

from tformer_jax import cli_common  # noqa: E402
from tformer_jax.bench import emit  # noqa: E402
from tformer_jax.config import ConfigError, ModelConfig  # noqa: E402
from tformer_jax.interop.families import HFConfigError, llama  # noqa: E402

DEFAULT_CONFIG = "configs/bench/llama_1b_gpu.py"
FORMULA = "6*N_matmul*T + 12*n_layers*n_heads*head_dim*seq*T"


def define_flags(fv: flags.FlagValues) -> None:
  flags.DEFINE_enum("mode", "both", ["eager", "compile", "both"], "eager, torch.compile, or both in turn",
                    flag_values=fv)
  flags.DEFINE_integer("steps", 10, "timed steps", flag_values=fv)
  flags.DEFINE_integer("warmup", 3, "untimed steps after the first", flag_values=fv)
  flags.DEFINE_integer("batch", 0, "rows per step (0: the config's data.batch_size)", flag_values=fv)
  flags.DEFINE_string("device", "auto", "auto (cuda if available, else cpu), cuda or cpu", flag_values=fv)
  flags.DEFINE_string("compile-backend", "inductor", "torch.compile backend ('eager': tracing only, no code "
                      "generation: what the CPU smoke run uses)", flag_values=fv)
  flags.DEFINE_integer("seed", 0, "weights and tokens seed", flag_values=fv)
  flags.DEFINE_string("json", None, "write the result dict to this file (after each mode)", flag_values=fv)


def parse_args(argv: Sequence[str] | None) -> Any:
  return cli_common.parse(argv, define_flags, doc=__doc__, prog="python benchmarks/torch_llama.py",
                          config=DEFAULT_CONFIG)


def llama_config(m: ModelConfig) -> transformers.LlamaConfig:
  """transformers' LlamaConfig of our architecture (ConfigError when LlamaForCausalLM cannot hold it)."""
  if m.position != "rope" or m.norm != "rmsnorm" or m.activation != "swiglu":
    raise ConfigError(f"model: LlamaForCausalLM needs position 'rope', norm 'rmsnorm' and activation 'swiglu'; "
                      f"got {m.position!r}, {m.norm!r}, {m.activation!r}")
  try:
    hf = llama.llama_to_hf(m)
  except HFConfigError as e:
    raise ConfigError(f"model: {cli_common.one_line(e)}") from e
  hf = {k: v for k, v in hf.items() if k not in ("architectures", "model_type")}
  return transformers.LlamaConfig(**hf, attn_implementation="sdpa", bos_token_id=None, eos_token_id=None,
                                  pad_token_id=None, use_cache=False)


def device_of(name: str) -> torch.device:
  if name == "auto":
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
  if name == "cuda" and not torch.cuda.is_available():
    raise ConfigError("--device cuda: torch sees no CUDA device")
  return torch.device(name)


def build_model(lc: transformers.LlamaConfig, device: torch.device, seed: int,
                dtype: torch.dtype = torch.float32) -> torch.nn.Module:
  """LlamaForCausalLM with random weights (initialised on `device`), eval-free: dropout is 0 anyway."""
  torch.manual_seed(seed)
  with torch.device(device):
    model = transformers.LlamaForCausalLM(lc)
  return model.to(dtype=dtype)


def flops_per_step(model: torch.nn.Module, lc: transformers.LlamaConfig, batch: int, seq: int) -> dict[str, Any]:
  """tformer_jax/analysis/flops.py's formula ('full' attention term) from this model's parameters."""
  total = sum(p.numel() for p in model.parameters())
  embed = model.get_input_embeddings().weight.numel()
  n_matmul = total - embed + (embed if lc.tie_word_embeddings else 0)
  t = batch * seq
  attention = 12 * lc.num_hidden_layers * lc.num_attention_heads * lc.head_dim * seq * t
  return {"params": total, "n_matmul": n_matmul, "flops_per_step": 6 * n_matmul * t + attention,
          "attention_flops": attention, "formula": FORMULA}


def make_optimizer(model: torch.nn.Module, o: Any, device: torch.device) -> torch.optim.Optimizer:
  decay = [p for p in model.parameters() if p.dim() >= 2]
  no_decay = [p for p in model.parameters() if p.dim() < 2]
  groups = [{"params": decay, "weight_decay": float(o.weight_decay)}, {"params": no_decay, "weight_decay": 0.0}]
  return torch.optim.AdamW(groups, lr=float(o.peak_lr), betas=(float(o.b1), float(o.b2)), eps=float(o.eps),
                           fused=True)


def sync(device: torch.device) -> None:
  if device.type == "cuda":
    torch.cuda.synchronize(device)


class TrainStep:
  """One mode's model, optimizer, batches and step function (eager, or the loss under torch.compile)."""

  def __init__(self, lc: transformers.LlamaConfig, cfg: Any, batch: int, seq: int, device: torch.device,
               compile_backend: str | None, seed: int):
    self.model = build_model(lc, device, seed)
    self.opt = make_optimizer(self.model, cfg.optim, device)
    self.clip = float(cfg.optim.clip_norm)
    self.device, self.vocab = device, lc.vocab_size
    g = torch.Generator(device="cpu").manual_seed(seed)
    toks = [torch.randint(0, lc.vocab_size, (batch, seq + 1), generator=g) for _ in range(2)]
    self.batches = [(t[:, :-1].contiguous().to(device), t[:, 1:].contiguous().to(device)) for t in toks]
    self.loss_fn = (torch.compile(self._loss, backend=compile_backend) if compile_backend else self._loss)
    self.i = 0

  def _loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with torch.autocast(self.device.type, dtype=torch.bfloat16):
      logits = self.model(input_ids=x, use_cache=False).logits
    return F.cross_entropy(logits.float().reshape(-1, self.vocab), y.reshape(-1))

  def step(self) -> torch.Tensor:
    x, y = self.batches[self.i % len(self.batches)]
    self.i += 1
    loss = self.loss_fn(x, y)
    self.opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
    self.opt.step()
    return loss.detach()


def run_mode(mode: str, lc: transformers.LlamaConfig, args: Any, batch: int, seq: int,
             device: torch.device, flops: float) -> dict[str, Any]:
  if device.type == "cuda":
    torch.cuda.reset_peak_memory_stats(device)
  bench = TrainStep(lc, args.config, batch, seq, device, args.compile_backend if mode == "compile" else None,
                    args.seed)
  t0 = time.perf_counter()
  loss = bench.step()
  sync(device)
  first = time.perf_counter() - t0
  for _ in range(args.warmup):
    loss = bench.step()
  sync(device)
  t0 = time.perf_counter()
  for _ in range(args.steps):
    loss = bench.step()
  sync(device)
  wall = time.perf_counter() - t0
  final = float(loss)
  out = {"tokens_per_s": round(args.steps * batch * seq / wall, 1), "step_ms_mean": round(1e3 * wall / args.steps, 2),
         "first_step_s": round(first, 3), "achieved_tflops": round(args.steps * flops / wall / 1e12, 3),
         "final_loss": final, "loss_finite": math.isfinite(final)}
  if mode == "compile":
    out["compile_backend"] = args.compile_backend
  if device.type == "cuda":
    out["peak_memory_gb"] = round(torch.cuda.max_memory_allocated(device) / 2 ** 30, 2)
  return out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = parse_args(argv)
  if args.steps < 1 or args.warmup < 0:
    cli_common.fail("--steps must be >= 1 and --warmup >= 0")
  cfg = args.config
  m = ModelConfig.from_config(cfg.model)
  lc = llama_config(m)
  device = device_of(args.device)
  batch, seq = args.batch or int(cfg.data.batch_size), int(cfg.data.seq_len)
  if device.type == "cpu":
    torch.set_num_threads(os.cpu_count() or 1)
  with torch.device("meta"):
    fl = flops_per_step(transformers.LlamaForCausalLM(lc), lc, batch, seq)
  dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
  res: dict[str, Any] = {"bench": "torch_llama", "config": args.config_file, "overrides": args.overrides,
                         "torch": torch.__version__, "transformers": transformers.__version__,
                         "device": dev_name, "batch": batch, "seq": seq, "tokens_per_step": batch * seq,
                         "steps": args.steps, "warmup": args.warmup, "attention": "sdpa",
                         "precision": "float32 params, bfloat16 autocast", "optimizer": "AdamW(fused=True)", **fl}
  print(f"torch {torch.__version__}, transformers {transformers.__version__} on {dev_name}: LlamaForCausalLM "
        f"{fl['params'] / 1e6:.1f}M params, batch {batch} x seq {seq}, {fl['flops_per_step'] / 1e12:.3f} TFLOP/step",
        flush=True)
  for mode in (["eager", "compile"] if args.mode == "both" else [args.mode]):
    try:
      res[mode] = run_mode(mode, lc, args, batch, seq, device, fl["flops_per_step"])
      r = res[mode]
      print(f"torch {mode}: {r['tokens_per_s']:,.0f} tokens/s | step {r['step_ms_mean']:.1f} ms | "
            f"{r['achieved_tflops']:.1f} TFLOP/s | first step {r['first_step_s']:.1f} s | loss {r['final_loss']:.4f}",
            flush=True)
    except Exception as e:  # noqa: BLE001 - one mode's failure (OOM, compiler) is its result
      oom = isinstance(e, torch.OutOfMemoryError)
      res[mode] = {"error": ("out of memory: " if oom else f"{type(e).__name__}: ") + cli_common.one_line(e)[:400]}
      print(f"torch {mode}: FAILED: {res[mode]['error']}\n{traceback.format_exc(limit=4)}", flush=True)
    gc.collect()
    if device.type == "cuda":
      torch.cuda.empty_cache()
    if args.json:
      emit_file(res, args.json)
  return emit(res, None)


def emit_file(res: dict[str, Any], path: str) -> None:
  """Write `res` to `path` atomically (a reader never sees half a file)."""
  p = pathlib.Path(path)
  tmp = p.with_name(p.name + ".tmp")
  tmp.write_text(json.dumps(res, indent=2, default=str))
  os.replace(tmp, p)


if __name__ == "__main__":
  sys.exit(cli_common.run_main(main))
