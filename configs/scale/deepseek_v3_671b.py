"""DeepSeek-V3-shaped MoE (671B parameters, 37B active) in MaxText's deepseek_v3_ep_256_v5p_512 layout: 256
v5p chips (a v5p-512 counts TensorCores), every chip one of the 256 experts, 2 sequences of 8192 tokens a chip.

d_model 7168, 61 layers: the first 3 dense (SwiGLU d_ff 18432), then 256 routed experts (width 2048, top 8,
sigmoid router with a correction bias, 8 groups of which 4 are kept, weights x 2.5, auxiliary-loss-free
balancing) plus one shared expert; Multi-head Latent Attention with 128 heads (q through a 1536 bottleneck,
K/V latent 512, 128 no-RoPE + 64 RoPE q/k dims, 128 value dims); vocab 129280. bf16 compute, float32
parameters and AdamW moments, scanned stacks with full remat, the loss in chunks of 2048 tokens; the expert
axis also splits the batch, every other weight's d_model axis and MLA's latent axes (FSDP over the experts'
chips).

  tformer-aot --config=configs/scale/deepseek_v3_671b.py --topology=v5p:8x8x4

Fits at 88.7 GiB a chip of 95 (4 sequences a chip ask 127 GiB); predicted MFU 34.5% (50.3% overlapped), libtpu
0.0.42, docs/scaling.md.
"""
from tformer_jax.config import default_config


def get_config():
  c = default_config()
  m = c.model
  m.vocab_size, m.d_model, m.num_layers, m.num_heads = 129280, 7168, 61, 128
  m.d_ff, m.activation, m.norm, m.norm_eps = 18432, "swiglu", "rmsnorm", 1e-6
  m.position, m.rope_theta, m.rope_layout, m.max_len = "rope", 1e4, "interleaved", 8192
  m.mla.q_lora_rank, m.mla.kv_lora_rank = 1536, 512
  m.mla.qk_nope_head_dim, m.mla.qk_rope_head_dim, m.mla.v_head_dim = 128, 64, 128
  m.tie_embeddings, m.scan_layers, m.remat = False, True, "full"
  mo = m.moe
  mo.num_experts, mo.top_k, mo.d_ff, mo.router, mo.renormalize = 256, 8, 2048, "sigmoid", True
  mo.n_group, mo.topk_group, mo.routed_scaling_factor, mo.bias_update_rate = 8, 4, 2.5, 1e-3
  mo.num_shared_experts, mo.first_k_dense, mo.dispatch = 1, 3, "dropless"
  mo.aux_loss_coef, mo.z_loss_coef, mo.ep_buffer_factor = 1e-4, 0.0, 1.25
  c.data.seq_len, c.data.batch_size = 8192, 512
  c.train.precision, c.train.loss_chunk = "bf16", 2048
  c.mesh.axes, c.mesh.shape = ("data", "fsdp", "tensor", "expert"), (1, 1, 1, 256)
  with c.mesh.ignore_type():            # the batch and the weights' embed and MLA latent dims over the experts' chips
    fsdp = ("fsdp", "expert")
    c.mesh.rules = (("batch", ("data", *fsdp)), ("embed", fsdp), ("q_lora", fsdp), ("kv_lora", fsdp),
                    ("expert", "expert"))
  o = c.optim
  o.peak_lr, o.b1, o.b2, o.weight_decay, o.clip_norm, o.warmup_steps = 2.2e-4, 0.9, 0.95, 0.1, 1.0, 2000
  c.train.steps = 100_000
  return c
