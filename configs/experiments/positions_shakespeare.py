r"""Positions ablation on Shakespeare (article 1, 4; article 2, 2.3): none, sinusoidal, learned, RoPE, ALiBi
on the same small byte-level model (d_model 128, 4 heads, 2 layers, seq 128).

  python scripts/ablate.py --config=configs/experiments/positions_shakespeare.py \
      --sweep model.position=none,sinusoidal,learned,rope,alibi --steps 600 --out runs/exp/positions

Measured (600 steps, 327 s): val loss none 2.522, sinusoidal 3.174, learned 2.373, rope 1.953,
alibi 2.030 (sinusoidal suffers from unit-amplitude encodings on std-0.02 embeddings). docs/experiments.md.
"""
from tformer_jax.config import default_config


def get_config():
  c = default_config()
  m = c.model
  m.vocab_size, m.d_model, m.num_layers, m.num_heads, m.max_len = 256, 128, 2, 4, 128
  m.position, m.norm, m.activation = "rope", "layernorm", "gelu_tanh"
  c.data.corpus, c.data.tokenizer, c.data.seq_len, c.data.batch_size = "shakespeare", "byte", 128, 8
  c.optim.peak_lr, c.optim.warmup_steps, c.optim.min_lr_ratio = 2e-3, 30, 0.1
  c.train.steps, c.train.eval_batches, c.train.sample_tokens = 600, 8, 0
  return c
