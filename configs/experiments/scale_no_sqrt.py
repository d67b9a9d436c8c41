r"""No 1/sqrt(d_k) at d_k = 64 (article 1, 2.1: "removed it at d_k=64 and after a few hundred steps the loss
started to oscillate"): attention_scale 1.0 against the default 1/sqrt(64), 2 heads of 64 dims.

  python scripts/ablate.py --config=configs/experiments/scale_no_sqrt.py \
      --sweep model.attention_scale=0.0,1.0 --sweep train.seed=0,1 --steps 600 --out runs/exp/scale

Measured (600 steps x 2 seeds, 272 s): val loss 1.982 (1/sqrt(64)) vs 1.999 (no scale), loss roughness
0.051 vs 0.054: no oscillation at this scale. docs/experiments.md.
"""
from tformer_jax.experiments.presets import small_shakespeare


def get_config():
  return small_shakespeare(num_layers=2, num_heads=2)
