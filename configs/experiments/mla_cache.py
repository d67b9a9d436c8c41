r"""Multi-head Latent Attention against GQA at equal KV-cache bytes (DeepSeek-V2, section 2.1: MLA performs
better than MHA with a cache of a fraction of its size). 4 layers, d_model 128, 4 heads of 32, RMSNorm,
SwiGLU, Shakespeare bytes; MHA caches 2 x 4 x 32 = 256 values a token and layer, MQA (num_kv_heads=1: the GQA
of MLA's cache) 64, MLA (latent 48 + RoPE key 16) 64.

  tformer-ablate --config=configs/experiments/mla_cache.py --sweep model.num_kv_heads=1 \
      --sweep train.seed=0,1 --steps 400 --out runs/exp/mla_mqa
  tformer-ablate --config=configs/experiments/mla_cache.py --config.model.mla.kv_lora_rank=48 \
      --config.model.mla.qk_nope_head_dim=32 --config.model.mla.qk_rope_head_dim=16 \
      --config.model.mla.v_head_dim=32 --sweep train.seed=0,1 --steps 400 --out runs/exp/mla_mla
  tformer-ablate --config=configs/experiments/mla_cache.py --sweep train.seed=0 --steps 400 --out runs/exp/mla_mha
"""
from tformer_jax.experiments.presets import small_shakespeare


def get_config():
  c = small_shakespeare(num_layers=4, num_heads=4, steps=400)
  c.model.norm, c.model.activation = "rmsnorm", "swiglu"
  return c
