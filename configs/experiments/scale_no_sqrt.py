r"""No 1/sqrt(d_k) at d_k = 64 (article 1, 2.1: "removed it at d_k=64 and after a few hundred steps the loss
started to oscillate"): attention_scale 1.0 against the default 1/sqrt(64), 2 heads of 64 dims.

  python scripts/ablate.py --config=configs/experiments/scale_no_sqrt.py \
      --sweep model.attention_scale=0.0,1.0 --sweep train.seed=0,1 --steps 600 --out runs/exp/scale

Measured (600 steps x 2 seeds, 272 s): val loss 1.982 (1/sqrt(64)) vs 1.999 (no scale), loss roughness
0.051 vs 0.054: no oscillation at this scale. docs/experiments.md.
"""
from tformer_jax.config import default_config


def get_config():
  c = default_config()
  m = c.model
  m.vocab_size, m.d_model, m.num_layers, m.num_heads, m.max_len = 256, 128, 2, 2, 128
  m.position, m.norm, m.activation = "rope", "layernorm", "gelu_tanh"
  c.data.corpus, c.data.tokenizer, c.data.seq_len, c.data.batch_size = "shakespeare", "byte", 128, 8
  c.optim.peak_lr, c.optim.warmup_steps, c.optim.min_lr_ratio = 2e-3, 30, 0.1
  c.train.steps, c.train.eval_batches, c.train.sample_tokens = 600, 8, 0
  return c
