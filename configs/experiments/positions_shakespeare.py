r"""Positions ablation on Shakespeare (article 1, 4; article 2, 2.3): none, sinusoidal, learned, RoPE, ALiBi
on the same small byte-level model (d_model 128, 4 heads, 2 layers, seq 128).

  python scripts/ablate.py --config=configs/experiments/positions_shakespeare.py \
      --sweep model.position=none,sinusoidal,learned,rope,alibi --steps 600 --out runs/exp/positions

Measured (600 steps, 327 s): val loss none 2.522, sinusoidal 3.174, learned 2.373, rope 1.953,
alibi 2.030 (sinusoidal suffers from unit-amplitude encodings on std-0.02 embeddings). docs/experiments.md.
"""
from tformer_jax.experiments.presets import small_shakespeare


def get_config():
  return small_shakespeare(num_layers=2, num_heads=4)
