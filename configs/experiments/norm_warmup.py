r"""Pre-LN vs Post-LN, with and without warmup (article 2, 2.4: "Pre-LN trains without careful warmup,
Post-LN is sensitive"; article 1, 6.3): 4 layers, peak lr 3e-3.

  python scripts/ablate.py --config=configs/experiments/norm_warmup.py \
      --sweep model.norm_position=pre,post --sweep optim.warmup_steps=0,40 --steps 400 --out runs/exp/norm

Measured (400 steps, 402 s; and 381 s at --config.optim.peak_lr=1e-3 with warmup 0/100): at lr 1e-3 warmup
moves Pre-LN by 0.017 val nats and Post-LN by 0.20; at lr 3e-3 Post-LN stays at 3.28 with or without
warmup while Pre-LN reaches 2.33 (no warmup) / 2.00 (warmup 40). docs/experiments.md.
"""
from tformer_jax.config import default_config


def get_config():
  c = default_config()
  m = c.model
  m.vocab_size, m.d_model, m.num_layers, m.num_heads, m.max_len = 256, 128, 4, 4, 128
  m.position, m.norm, m.activation = "rope", "layernorm", "gelu_tanh"
  c.data.corpus, c.data.tokenizer, c.data.seq_len, c.data.batch_size = "shakespeare", "byte", 128, 8
  c.optim.peak_lr, c.optim.warmup_steps, c.optim.min_lr_ratio, c.optim.clip_norm = 3e-3, 0, 0.1, 1.0
  c.train.steps, c.train.eval_batches, c.train.sample_tokens = 400, 8, 0
  return c
