"""Gemma-3-12B-shaped model (12.2B parameters) at 32,768 tokens a sequence, FSDP over a v6e-256, as MaxText's
published Gemma3-12B recipe lays it out (one sequence a chip).

d_model 3840, 48 layers in cycles of five sliding-window layers (window 1024, RoPE base 1e4) and one global
layer (RoPE base 1e6, linear scaling 8), 16 query / 8 KV heads of head_dim 256, QK-norm, Gemma's sandwich
norms and (1 + w) RMSNorm, GeGLU (tanh) d_ff 15360, the embedding scaled by sqrt(d_model) and tied, vocab
262208. bf16 compute, float32 parameters and AdamW moments, scanned cycles with full remat, the loss over
2048 tokens' logits at a time.

  tformer-aot --config=configs/scale/gemma3_12b.py --topology=v6e:16x16

Fits at 28.7 GiB a chip; HLO FLOPs 1.07x the formula; roofline MFU 46.8% (MaxText measures 38.1%).
"""
from tformer_jax.config import default_config


def get_config():
  c = default_config()
  m = c.model
  m.vocab_size, m.d_model, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim = 262208, 3840, 48, 16, 8, 256
  m.d_ff, m.activation, m.norm, m.norm_eps, m.norm_unit_offset = 15360, "geglu_tanh", "rmsnorm", 1e-6, True
  m.norm_position, m.qk_norm, m.embed_scale, m.tie_embeddings = "sandwich", "head", True, True
  m.position, m.rope_theta, m.local_rope_theta, m.max_len = "rope", 1e6, 1e4, 32768
  m.rope_scaling.type, m.rope_scaling.factor = "linear", 8.0
  m.layer_pattern, m.window = "LLLLLG", 1024
  m.qkv_bias, m.out_bias, m.mlp_bias = False, False, False
  m.scan_layers, m.remat = True, "full"
  c.data.seq_len, c.data.batch_size = 32768, 256
  c.train.precision, c.train.loss_chunk = "bf16", 2048
  c.mesh.shape, c.mesh.rules = (1, -1, 1), "fsdp"
  o = c.optim
  o.peak_lr, o.b1, o.b2, o.weight_decay, o.clip_norm, o.warmup_steps = 3e-4, 0.9, 0.95, 0.1, 1.0, 2000
  c.train.steps = 100_000
  return c
