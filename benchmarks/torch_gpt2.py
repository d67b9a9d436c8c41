"""PyTorch reference of configs/bench/gpt2_cpu.py: same architecture, optimiser and FLOP accounting.

  python benchmarks/torch_gpt2.py [--steps 10 --warmup 2 --mode eager|compile|both --json OUT]

Architecture (nanoGPT-style, GPT-2): token + learned position embeddings; per block Pre-LN
LayerNorm -> fused qkv Linear (bias) -> causal attention -> out Linear (bias) -> residual, LayerNorm
-> Linear 4x (bias) -> GELU(tanh) -> Linear (bias) -> residual; final LayerNorm; LM head tied to the
token embedding. Same parameter count as the JAX model (a fused (d, 3d) qkv holds what wq/wk/wv hold).
Init: normal(0.02), residual projections 0.02/sqrt(2 * layers), zero biases. Optimiser: clip the
global grad norm to 1.0, then AdamW (b1 0.9, b2 0.95, eps 1e-8, wd 0.1 on every >= 2-D parameter,
embeddings included; none on norms and biases), as tformer_jax.train.optim does; AdamW(fused=True),
the faster of torch's CPU implementations here (--foreach-adam for the other).
Attention: --attn sdpa (F.scaled_dot_product_attention(is_causal=True), the fast path a PyTorch user
gets) or naive (masked softmax(QK^T)V, what tformer_jax's 'reference' impl computes).
FLOPs: the same formula as tformer_jax/analysis/flops.py: 6*N_matmul*T + 12*n_layers*d_model*seq*T.
torch.set_num_threads(--threads, default: all cores). torch.compile failures are caught and reported.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from tformer_jax.bench import emit


@dataclass(frozen=True)
class GPTConfig:
  vocab_size: int = 256
  d_model: int = 384
  num_layers: int = 6
  num_heads: int = 6
  max_len: int = 256
  seq: int = 256
  batch: int = 8
  mlp_ratio: int = 4
  attn: str = "sdpa"           # sdpa | naive
  lr: float = 6e-4
  weight_decay: float = 0.1
  clip: float = 1.0


class Block(nn.Module):
  def __init__(self, c: GPTConfig):
    super().__init__()
    d = c.d_model
    self.c = c
    self.ln1 = nn.LayerNorm(d, eps=1e-5)
    self.qkv = nn.Linear(d, 3 * d)
    self.proj = nn.Linear(d, d)
    self.ln2 = nn.LayerNorm(d, eps=1e-5)
    self.fc = nn.Linear(d, c.mlp_ratio * d)
    self.fc_out = nn.Linear(c.mlp_ratio * d, d)

  def attention(self, x: torch.Tensor) -> torch.Tensor:
    b, l, d = x.shape
    h = self.c.num_heads
    q, k, v = self.qkv(x).split(d, dim=2)
    q, k, v = (t.view(b, l, h, d // h).transpose(1, 2) for t in (q, k, v))
    if self.c.attn == "sdpa":
      y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
      att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // h))
      mask = torch.ones(l, l, dtype=torch.bool, device=x.device).tril()
      y = att.masked_fill(~mask, float("-inf")).softmax(dim=-1) @ v
    return self.proj(y.transpose(1, 2).reshape(b, l, d))

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    x = x + self.attention(self.ln1(x))
    return x + self.fc_out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
  def __init__(self, c: GPTConfig):
    super().__init__()
    self.c = c
    self.embed = nn.Embedding(c.vocab_size, c.d_model)
    self.pos_embed = nn.Embedding(c.max_len, c.d_model)
    self.blocks = nn.ModuleList(Block(c) for _ in range(c.num_layers))
    self.final_norm = nn.LayerNorm(c.d_model, eps=1e-5)
    for name, p in self.named_parameters():
      if name.endswith("bias"):
        nn.init.zeros_(p)
      elif p.dim() >= 2:
        std = 0.02 / math.sqrt(2 * c.num_layers) if name.endswith(("proj.weight", "fc_out.weight")) else 0.02
        nn.init.normal_(p, std=std)

  def forward(self, tokens: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(tokens.shape[1], device=tokens.device)
    x = self.embed(tokens) + self.pos_embed(pos)[None]
    for blk in self.blocks:
      x = blk(x)
    return self.final_norm(x) @ self.embed.weight.T   # tied head


def param_count(model: nn.Module) -> int:
  return sum(p.numel() for p in model.parameters())


def flops_per_step(c: GPTConfig) -> dict[str, Any]:
  """The formula of tformer_jax/analysis/flops.py ('full' attention term) for this architecture."""
  d, f, t = c.d_model, c.mlp_ratio * c.d_model, c.batch * c.seq
  per_layer = (4 * d * d + 4 * d) + (2 * d * f + f + d) + 4 * d     # attn, mlp, two LayerNorms
  n_matmul = c.num_layers * per_layer + 2 * d + c.vocab_size * d     # + final norm + tied head
  attention = 12 * c.num_layers * d * c.seq * t
  return {"flops_per_step": 6 * n_matmul * t + attention, "n_matmul": n_matmul,
          "attention_flops": attention, "formula": "6*N_matmul*T + 12*n_layers*n_heads*head_dim*seq*T"}


def make_optimizer(model: nn.Module, c: GPTConfig, fused: bool = True) -> torch.optim.Optimizer:
  decay = [p for p in model.parameters() if p.dim() >= 2]
  no_decay = [p for p in model.parameters() if p.dim() < 2]
  groups = [{"params": decay, "weight_decay": c.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
  kw = {"fused": True} if fused else {}
  return torch.optim.AdamW(groups, lr=c.lr, betas=(0.9, 0.95), eps=1e-8, **kw)


class TorchBench:
  """One training setup (eager or torch.compile), with the interface of tformer_jax's TrainBench."""

  def __init__(self, c: GPTConfig, compile: bool = False, seed: int = 0, fused_adam: bool = True,
               num_batches: int = 4):
    torch.manual_seed(seed)
    self.c, self.mode = c, ("compile" if compile else "eager")
    self.model = GPT(c)
    self.params = param_count(self.model)
    self.opt = make_optimizer(self.model, c, fused_adam)
    self.fwd = torch.compile(self.model) if compile else self.model
    g = torch.Generator().manual_seed(seed)
    toks = [torch.randint(0, c.vocab_size, (c.batch, c.seq + 1), generator=g) for _ in range(num_batches)]
    self.batches = [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in toks]
    self.tokens_per_step = c.batch * c.seq
    self.compile_s = float("nan")
    self.steps_done = 0
    self.loss = float("nan")

  def step(self, i: int) -> torch.Tensor:
    x, y = self.batches[i % len(self.batches)]
    logits = self.fwd(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
    self.opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.c.clip)
    self.opt.step()
    return loss.detach()

  def compile(self) -> float:
    """First step (torch.compile traces and builds here): timed as compile_s."""
    t0 = time.perf_counter()
    self.loss = float(self.step(0))
    self.compile_s = time.perf_counter() - t0
    self.steps_done = 1
    return self.compile_s

  def run(self, steps: int) -> tuple[float, list[float]]:
    t0 = time.perf_counter()
    marks, loss = [], None
    for i in range(steps):
      loss = self.step(self.steps_done + i)
      marks.append(time.perf_counter())
    self.steps_done += steps
    self.loss = float(loss) if loss is not None else self.loss
    return marks[-1] - t0, list(map(float, [b - a for a, b in zip([t0] + marks[:-1], marks)]))

  def final_loss(self) -> float:
    return self.loss


def try_bench(c: GPTConfig, compile: bool, **kw: Any) -> tuple[TorchBench | None, str | None]:
  """(bench, None), or (None, error text) if building or compiling fails (e.g. no C++ compiler)."""
  try:
    b = TorchBench(c, compile=compile, **kw)
    b.compile()
    return b, None
  except Exception as e:  # noqa: BLE001 - report any torch.compile failure, keep going
    tb = traceback.format_exc(limit=3)
    return None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}\n{tb}"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--mode", choices=("eager", "compile", "both"), default="both")
  p.add_argument("--attn", choices=("sdpa", "naive"), default="sdpa")
  p.add_argument("--threads", type=int, default=os.cpu_count())
  p.add_argument("--foreach-adam", action="store_true",
                 help="AdamW(foreach) instead of AdamW(fused=True) (fused is ~14%% faster per step here)")
  p.add_argument("--layers", type=int, default=6)
  p.add_argument("--d-model", type=int, default=384)
  p.add_argument("--heads", type=int, default=6)
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--seq", type=int, default=256)
  p.add_argument("--json")
  return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = parse_args(sys.argv[1:] if argv is None else argv)
  torch.set_num_threads(args.threads)
  c = GPTConfig(num_layers=args.layers, d_model=args.d_model, num_heads=args.heads, batch=args.batch,
                seq=args.seq, max_len=max(256, args.seq), attn=args.attn)
  fl = flops_per_step(c)
  res: dict[str, Any] = {"bench": "torch_gpt2", "torch": torch.__version__,
                         "threads": torch.get_num_threads(),
                         "config": asdict(c), "flops_per_step": fl["flops_per_step"],
                         "flops_formula": fl["formula"], "loadavg": list(os.getloadavg())}
  modes = ["eager", "compile"] if args.mode == "both" else [args.mode]
  for mode in modes:
    bench, err = try_bench(c, compile=mode == "compile", fused_adam=not args.foreach_adam)
    if bench is None:
      print(f"{mode}: FAILED: {err}")
      res[mode] = {"error": err.splitlines()[0]}
      continue
    bench.run(args.warmup)
    wall, iv = bench.run(args.steps)
    tok_s = args.steps * bench.tokens_per_step / wall
    gflops = args.steps * fl["flops_per_step"] / wall / 1e9
    res["params"] = bench.params
    res[mode] = {"tokens_per_s": round(tok_s, 1), "step_ms_median": round(1e3 * statistics.median(iv), 2),
                 "compile_s": round(bench.compile_s, 2), "achieved_gflops": round(gflops, 2),
                 "final_loss": bench.final_loss()}
    print(f"torch {mode}: {tok_s:,.0f} tokens/s | step median {res[mode]['step_ms_median']:.1f} ms | "
          f"{gflops:.1f} GFLOP/s | first step {bench.compile_s:.1f}s | params {bench.params:,}")
  return emit(res, args.json)


if __name__ == "__main__":
  main()
