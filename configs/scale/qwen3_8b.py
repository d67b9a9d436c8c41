"""Qwen3-8B-shaped dense model (8.2B parameters), FSDP over a v5p-128 (64 chips).

d_model 4096, 36 layers, 32 query / 8 KV heads of head_dim 128 with QK-norm (RMSNorm of each head's q and
k before RoPE), SwiGLU d_ff 12288, RoPE theta 1e6, RMSNorm, untied head, vocab 151936; seq 8192, one
sequence a chip. bf16 compute, float32 parameters and AdamW moments, scanned layers with full remat.

  tformer-aot --config=configs/scale/qwen3_8b.py --topology=v5p:4x4x4

Fits at 12.2 GiB a chip, HLO FLOPs 1.00x the formula, roofline MFU 62.6% (75.5% with perfect overlap).
"""
from tformer_jax.config import default_config


def get_config():
  c = default_config()
  m = c.model
  m.vocab_size, m.d_model, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim = 151936, 4096, 36, 32, 8, 128
  m.d_ff, m.activation, m.norm, m.norm_eps, m.qk_norm = 12288, "swiglu", "rmsnorm", 1e-6, "head"
  m.position, m.rope_theta, m.max_len = "rope", 1e6, 32768
  m.tie_embeddings, m.qkv_bias, m.out_bias, m.mlp_bias = False, False, False, False
  m.scan_layers, m.remat = True, "full"
  c.data.seq_len, c.data.batch_size = 8192, 64
  c.train.precision = "bf16"   # the full logits (8192 x 151936 float32, 5 GiB) fit: no loss_chunk
  c.mesh.shape, c.mesh.rules = (1, -1, 1), "fsdp"
  o = c.optim
  o.peak_lr, o.b1, o.b2, o.weight_decay, o.clip_norm, o.warmup_steps = 3e-4, 0.9, 0.95, 0.1, 1.0, 2000
  c.train.steps = 100_000
  return c
