r"""Pre-LN vs Post-LN, with and without warmup (article 2, 2.4: "Pre-LN trains without careful warmup,
Post-LN is sensitive"; article 1, 6.3): 4 layers, peak lr 3e-3.

  python scripts/ablate.py --config=configs/experiments/norm_warmup.py \
      --sweep model.norm_position=pre,post --sweep optim.warmup_steps=0,40 --steps 400 --out runs/exp/norm

Measured (400 steps, 402 s; and 381 s at --config.optim.peak_lr=1e-3 with warmup 0/100): at lr 1e-3 warmup
moves Pre-LN by 0.017 val nats and Post-LN by 0.20; at lr 3e-3 Post-LN stays at 3.28 with or without
warmup while Pre-LN reaches 2.33 (no warmup) / 2.00 (warmup 40). docs/experiments.md.
"""
from tformer_jax.experiments.presets import small_shakespeare


def get_config():
  c = small_shakespeare(num_layers=4, num_heads=4, steps=400)
  c.optim.peak_lr, c.optim.warmup_steps, c.optim.clip_norm = 3e-3, 0, 1.0
  return c
