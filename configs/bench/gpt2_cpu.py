"""GPT-2-style benchmark model for a small CPU: the config `python -m tformer_jax.bench train` uses.

vocab 256, 6 layers, d_model 384, 6 heads, seq 256, batch 8, learned positions, Pre-LN LayerNorm,
GELU (tanh) MLP 4x, biases (GPT-2), tied embeddings, no dropout, float32, AdamW (wd 0.1), clip 1.0.
benchmarks/torch_gpt2.py builds the same architecture and optimiser in PyTorch.

  python -m tformer_jax.bench train --config=configs/bench/gpt2_cpu.py --steps 20 --warmup 3
  python benchmarks/compare_torch.py          # JAX vs torch eager vs torch.compile, interleaved

Measured (2026-12-01, 2-vCPU AMD EPYC, JAX 0.10.2, torch 2.13.0+cpu, tcmalloc; compare_torch
--rounds 8 --k 2): JAX 4084, PyTorch eager 2508, torch.compile 2565 tokens/s (1.63x / 1.59x), 292.2
GFLOP/s of 146.5 GFLOP/step = MFU 61.2% of a 477.4 GFLOP/s float32 matmul measured in the same run.
Details: docs/benchmarks.md; history: docs/results/README.md.
"""
from tformer_jax.config import default_config


def get_config():
  c = default_config()
  m = c.model
  m.vocab_size, m.d_model, m.num_layers, m.num_heads = 256, 384, 6, 6
  m.max_len, m.mlp_ratio = 256, 4.0
  m.position, m.norm, m.norm_position, m.activation = "learned", "layernorm", "pre", "gelu_tanh"
  m.qkv_bias = m.out_bias = m.mlp_bias = True
  m.tie_embeddings, m.scale_residual_init = True, True
  m.embed_dropout = m.attn_dropout = m.resid_dropout = 0.0
  m.dtype = m.param_dtype = "float32"
  c.data.seq_len, c.data.batch_size = 256, 8
  o = c.optim
  o.name, o.peak_lr, o.b1, o.b2, o.eps, o.weight_decay = "adamw", 6e-4, 0.9, 0.95, 1e-8, 0.1
  o.clip_norm, o.warmup_steps, o.schedule, o.grad_accum = 1.0, 10, "cosine", 1
  c.train.precision = "float32"
  c.train.steps = 1000
  # Execution (tformer_jax/backends/cpu/xla_cpu.py), all three C++ kernels required:
  # - chunked attention as the C++ kernel: 4 query chunks of 64, each against only the keys it can
  #   see (10 of 16 tiles), probabilities kept for the backward; one OpenBLAS sgemm per head and
  #   chunk, heads in parallel (+9-10% tokens/s over the XLA 'chunked'). The FLOP formula counts
  #   the full causal-naive term.
  # - weight gradients dW = X^T dY by the C++ matmul (190-205 GFLOP/s on these shapes, XLA 160-190).
  # - clip + AdamW as one C++ pass per parameter array (PyTorch's side runs its fused AdamW too).
  r = c.runtime
  r.backend, r.attention, r.attention_block_q, r.cpu_kernels = "xla_cpu", "chunked", 64, "on"
  return c
