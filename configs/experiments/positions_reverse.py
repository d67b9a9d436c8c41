r"""Positions on the reverse task (article 1, 8: "without positions the model could not learn anything
order-dependent"): synthetic:reverse with 8 items of 16 symbols, loss on the answer span only.

  python scripts/ablate.py --config=configs/experiments/positions_reverse.py \
      --sweep model.position=none,sinusoidal,learned,rope,alibi --steps 600 --out runs/exp/reverse

Measured (600 steps, 101 s): exact match none 0.00, sinusoidal 0.00 (stuck at ln 16), learned 1.00,
rope 1.00, alibi 0.43; sinusoidal with --config.model.init_std=0.2 reaches 1.00. docs/experiments.md.
"""
from tformer_jax.config import default_config


def get_config():
  c = default_config()
  m = c.model
  m.vocab_size, m.d_model, m.num_layers, m.num_heads, m.max_len = 18, 64, 2, 4, 32
  m.position, m.norm, m.activation = "rope", "layernorm", "gelu_tanh"
  c.data.corpus, c.data.seq_len, c.data.batch_size = "synthetic:reverse:n=8", 24, 32
  c.optim.peak_lr, c.optim.warmup_steps, c.optim.min_lr_ratio, c.optim.weight_decay = 3e-3, 30, 0.1, 0.0
  c.train.steps, c.train.eval_batches, c.train.sample_tokens = 600, 4, 0
  return c
