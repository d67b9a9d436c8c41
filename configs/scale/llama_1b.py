"""Llama-3.2-1B-style model (1.2B parameters), FSDP over 4 chips.

d_model 2048, 16 layers, 32 query / 8 KV heads (head_dim 64), SwiGLU d_ff 8192, RoPE theta 500000,
RMSNorm, tied embeddings, vocab 128256; seq 4096, global batch 16 in 4 accumulated micro-batches (one
sequence per chip at a time: 4 at once need 26 GiB, XLA:TPU refuses it). bf16 compute with float32
parameters and AdamW moments; scanned layers with full remat. Mesh (data, fsdp, tensor) = (1, 4, 1),
rules 'fsdp'.

  tformer-aot --config=configs/scale/llama_1b.py --topology=v5e:2x2

Fits at 9.24 GiB a chip of 15.75 (libtpu 0.0.42); the other figures and their dates: docs/scaling.md.
"""
from tformer_jax.config import default_config


def get_config():
  c = default_config()
  m = c.model
  m.vocab_size, m.d_model, m.num_layers, m.num_heads, m.num_kv_heads = 128256, 2048, 16, 32, 8
  m.d_ff, m.activation, m.norm, m.norm_eps = 8192, "swiglu", "rmsnorm", 1e-5
  m.position, m.rope_theta, m.max_len = "rope", 500000.0, 8192
  m.tie_embeddings, m.qkv_bias, m.out_bias, m.mlp_bias = True, False, False, False
  m.scan_layers, m.remat = True, "full"
  c.data.seq_len, c.data.batch_size = 4096, 16
  c.optim.grad_accum = 4                # 4 micro-batches of 4 sequences: one sequence per chip at a time
  c.train.precision = "bf16"
  c.mesh.shape, c.mesh.rules = (1, -1, 1), "fsdp"
  o = c.optim
  o.peak_lr, o.b1, o.b2, o.weight_decay, o.clip_norm, o.warmup_steps = 3e-4, 0.9, 0.95, 0.1, 1.0, 2000
  c.train.steps = 100_000
  return c
