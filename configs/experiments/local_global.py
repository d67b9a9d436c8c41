r"""Gemma 3's 5:1 local/global layers against all-global attention at the same steps: validation loss, and the
KV cache each keeps (a local layer's ring holds `window` slots). 6 layers, d_model 128, seq 128, window 16
(an eighth of the context, as 1024 is of Gemma 3's 8192 pre-training context), 400 steps.

  tformer-ablate --config=configs/experiments/local_global.py --sweep train.seed=0,1 --steps 400 \
      --out runs/exp/local_global
  tformer-ablate --config=configs/experiments/local_global.py --config.model.layer_pattern= \
      --config.model.window=0 --config.model.local_rope_theta=0 --sweep train.seed=0,1 --steps 400 \
      --out runs/exp/all_global
"""
from tformer_jax.experiments.presets import small_shakespeare


def get_config():
  c = small_shakespeare(num_layers=6, num_heads=4, steps=400)
  c.model.norm, c.model.activation = "rmsnorm", "swiglu"
  c.model.layer_pattern, c.model.window, c.model.local_rope_theta, c.model.rope_theta = "LLLLLG", 16, 1e4, 1e5
  return c
