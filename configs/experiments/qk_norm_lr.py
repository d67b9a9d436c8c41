r"""QK-norm and the learning rate (OLMo 2, Gemma 3; Dehghani et al. 2023): RMSNorm of each head's q and k keeps
the attention logits bounded, so training survives learning rates at which the baseline's loss spikes or
diverges. 4 layers, d_model 128, RMSNorm, 300 steps, no clipping (clipping would hide the instability).

  tformer-ablate --config=configs/experiments/qk_norm_lr.py --sweep model.qk_norm=none,head \
      --sweep optim.peak_lr=3e-3,1e-2,3e-2 --sweep train.seed=0,1 --steps 300 --out runs/exp/qk_norm
"""
from tformer_jax.experiments.presets import small_shakespeare


def get_config():
  c = small_shakespeare(num_layers=4, num_heads=4, steps=300)
  c.model.norm, c.model.activation = "rmsnorm", "swiglu"
  c.optim.warmup_steps, c.optim.clip_norm = 30, 0.0
  return c
