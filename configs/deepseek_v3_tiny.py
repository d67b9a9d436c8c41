"""DeepSeek-V3-shaped tiny MoE (its FFN half): a dense first layer (moe.first_k_dense=1), then MoE layers of
16 fine-grained experts (top-4) in 4 groups routed by sigmoid scores within the best 2 groups (group-limited
top-k), one always-on shared expert, routing weights renormalised and scaled (routed_scaling_factor), and
auxiliary-loss-free balancing: each layer's correction bias moves by bias_update_rate * sign(mean load -
load) after every step, outside the optimizer (aux_loss_coef 0; docs/moe.md). RoPE, RMSNorm, SwiGLU,
GQA, untied head; both layer stacks scanned.

Launch:  python scripts/train.py --config=configs/deepseek_v3_tiny.py --workdir=runs/deepseek_v3_tiny
"""
from tformer_jax.config import default_config


def get_config():
  c = default_config()
  m = c.model
  m.vocab_size = 256
  m.d_model, m.num_layers, m.num_heads, m.num_kv_heads = 128, 3, 8, 2
  m.position, m.rope_theta = "rope", 1e4
  m.norm, m.norm_eps, m.activation = "rmsnorm", 1e-6, "swiglu"
  m.d_ff = 384                          # the dense first layer's FFN
  m.tie_embeddings, m.scan_layers = False, True
  m.max_len = 1024
  mo = m.moe
  mo.num_experts, mo.top_k, mo.d_ff = 16, 4, 64
  mo.router, mo.n_group, mo.topk_group = "sigmoid", 4, 2
  mo.renormalize, mo.routed_scaling_factor = True, 2.5
  mo.num_shared_experts, mo.first_k_dense = 1, 1
  mo.bias_update_rate = 1e-3
  mo.aux_loss_coef, mo.z_loss_coef = 0.0, 0.0
  c.data.corpus, c.data.tokenizer = "shakespeare", "byte"
  c.data.seq_len, c.data.batch_size = 128, 16
  c.optim.peak_lr, c.optim.warmup_steps = 2e-3, 30
  c.train.steps, c.train.log_every, c.train.eval_every, c.train.ckpt_every = 300, 25, 100, 300
  c.train.eval_batches = 8
  c.train.sample_prompt, c.train.sample_tokens = "ROMEO:\n", 0
  return c
