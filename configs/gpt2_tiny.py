"""GPT-2-style tiny model: learned positions, Pre-LN LayerNorm, GELU (tanh) MLP 4x, tied embeddings.

Launch:  python scripts/train.py --config=configs/gpt2_tiny.py --workdir=runs/gpt2_tiny
"""
from tformer_jax.config import default_config


def get_config():
  c = default_config()
  m = c.model
  m.d_model, m.num_layers, m.num_heads = 256, 4, 4
  m.position, m.norm, m.activation = "learned", "layernorm", "gelu_tanh"
  m.qkv_bias = m.out_bias = m.mlp_bias = True
  m.tie_embeddings, m.scale_residual_init = True, True
  m.max_len = 256
  c.data.seq_len = 256
  return c
