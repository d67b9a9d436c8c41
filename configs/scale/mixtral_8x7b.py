"""Mixtral-8x7B-style MoE (46.7B parameters, 12.9B active per token), expert parallelism over 64 chips.

d_model 4096, 32 layers, 32 query / 8 KV heads (head_dim 128), 8 SwiGLU experts of d_ff 14336 in every
layer, top-2 routing (renormalised), dropless dispatch, RoPE theta 1e6, RMSNorm, untied head, vocab
32000; seq 4096, global batch 64. bf16 compute with float32 parameters and AdamW moments; scanned layers
with full remat. Mesh (data, fsdp, tensor, expert) = (1, 8, 1, 8), rules: the experts split 8 ways over
the 'expert' axis and every weight 8 ways along 'embed' over fsdp (64 ways in all for the expert
weights); the batch split over all 64 devices (the expert axis is data parallel outside the experts).

  tformer-aot --config=configs/scale/mixtral_8x7b.py --topology=v5p:4x4x4

Predicted MFU 49.3% (60.9% overlapped) at 20.69 GiB a chip (libtpu 0.0.42); the other figures and their dates:
docs/scaling.md.
"""
from tformer_jax.config import default_config


def get_config():
  c = default_config()
  m = c.model
  m.vocab_size, m.d_model, m.num_layers, m.num_heads, m.num_kv_heads = 32000, 4096, 32, 32, 8
  m.d_ff, m.activation, m.norm, m.norm_eps = 14336, "swiglu", "rmsnorm", 1e-5
  m.position, m.rope_theta, m.max_len = "rope", 1e6, 32768
  m.tie_embeddings, m.qkv_bias, m.out_bias, m.mlp_bias = False, False, False, False
  m.moe.num_experts, m.moe.top_k, m.moe.every, m.moe.d_ff = 8, 2, 1, 14336
  m.moe.dispatch, m.moe.renormalize = "dropless", True
  m.moe.ep_buffer_factor = 1.1          # each chip receives up to 1.1x its balanced share of rows
  m.moe.aux_loss_coef, m.moe.z_loss_coef = 0.02, 0.001
  m.scan_layers, m.remat = True, "full"
  c.data.seq_len, c.data.batch_size = 4096, 64
  c.train.precision = "bf16"
  c.mesh.axes, c.mesh.shape = ("data", "fsdp", "tensor", "expert"), (1, 8, 1, 8)
  # 'fsdp' with the batch split over the expert axis too: outside the experts, the expert axis is
  # data parallel (the activations between layers are split 64 ways, not 8)
  with c.mesh.ignore_type():            # explicit (logical, mesh axes) pairs instead of a preset name
    c.mesh.rules = (("batch", ("data", "fsdp", "expert")), ("embed", "fsdp"), ("expert", "expert"))
  o = c.optim
  o.peak_lr, o.b1, o.b2, o.weight_decay, o.clip_norm, o.warmup_steps = 1e-4, 0.9, 0.95, 0.1, 1.0, 2000
  c.train.steps = 100_000
  return c
