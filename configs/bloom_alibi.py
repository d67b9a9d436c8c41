"""Bloom-style ALiBi model: no position embeddings, linear attention biases (6 heads: the paper's
non-power-of-two slope rule), LayerNorm after the embeddings, GELU (tanh), biases everywhere.

Launch:  python scripts/train.py --config=configs/bloom_alibi.py --workdir=runs/bloom_alibi
"""
from tformer_jax.config import default_config


def get_config():
  c = default_config()
  m = c.model
  m.d_model, m.num_layers, m.num_heads = 192, 4, 6
  m.position, m.embed_norm = "alibi", True
  m.norm, m.activation = "layernorm", "gelu_tanh"
  m.qkv_bias = m.out_bias = m.mlp_bias = True
  m.max_len = 4096
  c.data.seq_len = 256
  return c
