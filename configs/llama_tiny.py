"""Llama-style tiny model: RoPE (half-split), RMSNorm, SwiGLU, GQA (8 query heads, 2 KV heads), untied head.

Launch:  python scripts/train.py --config=configs/llama_tiny.py --workdir=runs/llama_tiny
"""
from tformer_jax.config import default_config


def get_config():
  c = default_config()
  m = c.model
  m.d_model, m.num_layers, m.num_heads, m.num_kv_heads = 256, 4, 8, 2
  m.position, m.rope_theta, m.rope_layout = "rope", 10000.0, "half"
  m.norm, m.norm_eps, m.activation = "rmsnorm", 1e-6, "swiglu"
  m.tie_embeddings = False
  m.max_len = 1024
  c.data.seq_len = 256
  return c
