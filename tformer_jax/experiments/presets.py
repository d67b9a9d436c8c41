"""The small byte-level Shakespeare model the articles' ablations share (configs/experiments/*)."""
from __future__ import annotations

from typing import Any

from tformer_jax.config import default_config


def small_shakespeare(num_layers: int = 2, num_heads: int = 4, steps: int = 600) -> Any:
  """d_model 128, RoPE, LayerNorm, GELU (tanh), byte tokens, seq 128 x batch 8, peak lr 2e-3 with 30
  warmup steps and a cosine to 10%, no samples; each experiment file changes what it studies."""
  c = default_config()
  m = c.model
  m.vocab_size, m.d_model, m.num_layers, m.num_heads, m.max_len = 256, 128, num_layers, num_heads, 128
  m.position, m.norm, m.activation = "rope", "layernorm", "gelu_tanh"
  c.data.corpus, c.data.tokenizer, c.data.seq_len, c.data.batch_size = "shakespeare", "byte", 128, 8
  c.optim.peak_lr, c.optim.warmup_steps, c.optim.min_lr_ratio = 2e-3, 30, 0.1
  c.train.steps, c.train.eval_batches, c.train.sample_tokens = steps, 8, 0
  return c
