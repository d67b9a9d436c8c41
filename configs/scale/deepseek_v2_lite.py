"""DeepSeek-V2-Lite-shaped MoE (15.7B parameters, 2.4B active) on a v5p-8 (4 chips), expert parallel.

d_model 2048, 27 layers: the first dense (SwiGLU d_ff 10944), then 64 routed experts (width 1408, top 6,
softmax router) plus 2 shared experts; Multi-head Latent Attention with 16 heads (K/V latent 512, no q
bottleneck, 128 no-RoPE + 64 RoPE q/k dims, 128 value dims), vocab 102400. bf16 compute, float32 parameters
and AdamW moments, scanned stacks with full remat; the experts split 4 ways, the batch too (the other weights
whole on each chip).

  tformer-aot --config=configs/scale/deepseek_v2_lite.py --topology=v5p:2x2x1

Fits at 85.1 GiB a chip; HLO FLOPs 1.14x the formula; roofline MFU 29.8% (41.8% overlapped; MaxText logs 29.4%).
"""
from tformer_jax.config import default_config


def get_config():
  c = default_config()
  m = c.model
  m.vocab_size, m.d_model, m.num_layers, m.num_heads = 102400, 2048, 27, 16
  m.d_ff, m.activation, m.norm, m.norm_eps = 10944, "swiglu", "rmsnorm", 1e-6
  m.position, m.rope_theta, m.rope_layout, m.max_len = "rope", 1e4, "interleaved", 32768
  m.mla.kv_lora_rank, m.mla.qk_nope_head_dim, m.mla.qk_rope_head_dim, m.mla.v_head_dim = 512, 128, 64, 128
  m.tie_embeddings, m.scan_layers, m.remat = False, True, "full"
  mo = m.moe
  mo.num_experts, mo.top_k, mo.d_ff, mo.router, mo.renormalize = 64, 6, 1408, "softmax", False
  mo.num_shared_experts, mo.first_k_dense, mo.dispatch = 2, 1, "dropless"
  mo.aux_loss_coef, mo.z_loss_coef, mo.ep_buffer_factor = 0.001, 0.0, 1.25
  c.data.seq_len, c.data.batch_size = 4096, 16
  c.train.precision, c.train.loss_chunk = "bf16", 2048
  c.mesh.axes, c.mesh.shape = ("data", "fsdp", "tensor", "expert"), (1, 1, 1, 4)
  with c.mesh.ignore_type():            # the batch over the expert axis too (mixtral_8x7b.py's layout)
    c.mesh.rules = (("batch", ("data", "fsdp", "expert")), ("embed", "fsdp"), ("expert", "expert"))
  o = c.optim
  o.peak_lr, o.b1, o.b2, o.weight_decay, o.clip_norm, o.warmup_steps = 4.2e-4, 0.9, 0.95, 0.1, 1.0, 2000
  c.train.steps = 100_000
  return c
