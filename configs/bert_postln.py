"""Post-LN bidirectional encoder (BERT-style): learned positions, token types, LayerNorm after the
embeddings and after each residual, exact GELU, no final norm, tied MLM-style head.

Forward demo:  python scripts/forward.py --config=configs/bert_postln.py
(An encoder is not a causal LM, so scripts/train.py refuses it.)
"""
from tformer_jax.config import default_config


def get_config():
  c = default_config()
  m = c.model
  m.d_model, m.num_layers, m.num_heads = 256, 4, 4
  m.causal, m.norm_position, m.final_norm = False, "post", False
  m.position, m.type_vocab_size, m.embed_norm = "learned", 2, True
  m.norm_eps, m.activation = 1e-12, "gelu"
  m.qkv_bias = m.out_bias = m.mlp_bias = True
  m.scale_residual_init = False
  m.max_len = 512
  c.data.seq_len = 128
  return c
