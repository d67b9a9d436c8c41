"""Llama-3-70B-style model (70.6B parameters), FSDP x tensor parallelism over 64 chips (a v5p-128).

d_model 8192, 80 layers, 64 query / 8 KV heads (head_dim 128), SwiGLU d_ff 28672, RoPE theta 500000,
RMSNorm, untied head, vocab 128256; seq 4096, global batch 64. bf16 compute with float32 parameters and
AdamW moments; scanned layers with full remat. Mesh (data, fsdp, tensor) = (1, 16, 4), rules 'fsdp_tp':
'embed' split 16 ways over fsdp, heads / KV heads / mlp / vocab 4 ways over tensor (8 KV heads: tensor
<= 8), so every parameter is split 64 ways; the batch is split 16 ways (4 sequences per fsdp group).

  tformer-aot --config=configs/scale/llama_70b.py --topology=v5p:4x4x4

Predicted MFU 45.1% (70.0% overlapped) at 41.95 GiB a chip (libtpu 0.0.42); MaxText's layout and the other
figures with their dates: docs/scaling.md.
"""
from tformer_jax.config import default_config


def get_config():
  c = default_config()
  m = c.model
  m.vocab_size, m.d_model, m.num_layers, m.num_heads, m.num_kv_heads = 128256, 8192, 80, 64, 8
  m.d_ff, m.activation, m.norm, m.norm_eps = 28672, "swiglu", "rmsnorm", 1e-5
  m.position, m.rope_theta, m.max_len = "rope", 500000.0, 8192
  m.tie_embeddings, m.qkv_bias, m.out_bias, m.mlp_bias = False, False, False, False
  m.scan_layers, m.remat = True, "full"
  c.data.seq_len, c.data.batch_size = 4096, 64
  c.train.precision = "bf16"
  c.mesh.shape, c.mesh.rules = (1, 16, 4), "fsdp_tp"
  o = c.optim
  o.peak_lr, o.b1, o.b2, o.weight_decay, o.clip_norm, o.warmup_steps = 1.5e-4, 0.9, 0.95, 0.1, 1.0, 2000
  c.train.steps = 100_000
  return c
