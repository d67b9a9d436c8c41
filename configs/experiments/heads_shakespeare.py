r"""Heads ablation on Shakespeare (article 2, 2.2: 8 heads vs 1 head of equal parameters, ~15% perplexity;
article 1, 3.2: head_dim below 32 hurts). d_model 128 fixed, so every head count has the same parameters.

  python scripts/ablate.py --config=configs/experiments/heads_shakespeare.py \
      --sweep model.num_heads=1,2,4,8,16 --steps 600 --out runs/exp/heads

Measured (600 steps, 522 s + 327 s for a second seed): val perplexity 1 head 7.48, 2 heads 7.12,
4 heads 7.08, 8 heads 6.78, 16 heads 6.94 (mean of 2 seeds; 2 heads one seed): 8 heads are 9.4% below
1 head; head_dim 16 is the best, head_dim 8 slightly worse. Details: docs/experiments.md.
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
