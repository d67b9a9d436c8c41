"""Llama-3-8B-style model (8.0B parameters), FSDP over 16 chips: the "does my 8B fit a v5e-16?" preset.

d_model 4096, 32 layers, 32 query / 8 KV heads (head_dim 128), SwiGLU d_ff 14336, RoPE theta 500000,
RMSNorm, untied head, vocab 128256; seq 4096, global batch 16 (one sequence per chip). bf16 compute with
float32 parameters and AdamW moments; scanned layers with full remat (each layer's forward is recomputed
in the backward: only the layer inputs are kept). Mesh (data, fsdp, tensor) = (1, 16, 1), rules 'fsdp':
parameters, gradients and optimizer state split 16 ways along 'embed'.

  tformer-aot --config=configs/scale/llama_8b.py --topology=v5e:4x4

Fits at 13.17 GiB a chip of 15.75 (libtpu 0.0.42); the long-context and context-parallel variants, the
other figures and their dates: docs/scaling.md, docs/long_context.md.
"""
from tformer_jax.config import default_config


def get_config():
  c = default_config()
  m = c.model
  m.vocab_size, m.d_model, m.num_layers, m.num_heads, m.num_kv_heads = 128256, 4096, 32, 32, 8
  m.d_ff, m.activation, m.norm, m.norm_eps = 14336, "swiglu", "rmsnorm", 1e-5
  m.position, m.rope_theta, m.max_len = "rope", 500000.0, 8192
  m.tie_embeddings, m.qkv_bias, m.out_bias, m.mlp_bias = False, False, False, False
  m.scan_layers, m.remat = True, "full"
  c.data.seq_len, c.data.batch_size = 4096, 16
  c.train.precision = "bf16"
  c.mesh.shape, c.mesh.rules = (1, -1, 1), "fsdp"
  o = c.optim
  o.peak_lr, o.b1, o.b2, o.weight_decay, o.clip_norm, o.warmup_steps = 3e-4, 0.9, 0.95, 0.1, 1.0, 2000
  c.train.steps = 100_000
  return c
