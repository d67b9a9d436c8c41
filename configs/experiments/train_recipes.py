r"""Training as current research runs train (issue 55): Muon vs AdamW, warmup-stable-decay vs cosine, cooldowns
branched from one stable run, and the z-loss at a high learning rate; 2 layers, d_model 128, byte-level
Shakespeare, seq 128 x batch 8, evaluated every 25 steps. One run:

  tformer-train --config=configs/experiments/train_recipes.py --config.optim.name=muon --workdir=runs/muon

The grid (each arm over 3 peak learning rates x 2 seeds) and its JSON (docs/results/):
  python benchmarks/train_recipes.py --steps 200 --out runs/exp/recipes
Measured (200 steps, 2 seeds): Muon reaches AdamW's best final val loss in 1.8x fewer steps; docs/experiments.md.
"""
from tformer_jax.experiments.presets import small_shakespeare


def get_config():
  c = small_shakespeare(num_layers=2, num_heads=4, steps=300)
  c.optim.warmup_steps = 30
  c.train.eval_every, c.train.eval_batches, c.train.log_every = 25, 4, 25
  c.train.ckpt_every = 10_000   # the runner asks for the checkpoints it branches from
  c.train.loggers = "jsonl"
  return c
