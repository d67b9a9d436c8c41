r"""Heads ablation on Shakespeare (article 2, 2.2: 8 heads vs 1 head of equal parameters, ~15% perplexity;
article 1, 3.2: head_dim below 32 hurts). d_model 128 fixed, so every head count has the same parameters.

  python scripts/ablate.py --config=configs/experiments/heads_shakespeare.py \
      --sweep model.num_heads=1,2,4,8,16 --steps 600 --out runs/exp/heads

Measured (600 steps, 522 s + 327 s for a second seed): val perplexity 1 head 7.48, 2 heads 7.12,
4 heads 7.08, 8 heads 6.78, 16 heads 6.94 (mean of 2 seeds; 2 heads one seed): 8 heads are 9.4% below
1 head; head_dim 16 is the best, head_dim 8 slightly worse. Details: docs/experiments.md.
"""
from tformer_jax.experiments.presets import small_shakespeare


def get_config():
  return small_shakespeare(num_layers=2, num_heads=4)
