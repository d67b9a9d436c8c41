"""~0.9B-parameter Llama-style model for the H100/H200 GPU check (scripts/gpu_check.sh).

d_model 2048, 16 layers, 16 query / 8 KV heads (head_dim 128), SwiGLU d_ff 5632, RoPE, RMSNorm,
untied head, vocab 32000, seq 2048; bf16 compute with float32 params and AdamW state
(train.precision='bf16'), cuDNN attention, scanned layers, no remat (stage a retries with
remat 'dots' / a smaller batch if the first choice does not fit), the state donated, the loss over
8192-token chunks (train.loss_chunk: never the 3.9 GiB float32 logits; -7.2 GiB of XLA temp memory,
docs/runtime.md "The GPU training step"). Parameters: 0.89B, of which 0.75B in the layers.
The same shape is the PyTorch peer's (benchmarks/torch_llama.py, benchmarks/torch_generate.py) and
the generation benchmark's (`bench decode --dtype=bfloat16`).

  bash scripts/gpu_check.sh                 # on the GPU machine: stages a-e, table + JSON, non-zero exit on failure
  bash scripts/gpu_check.sh --smoke         # anywhere: a tiny CPU override of the same pipeline
  Earlier H200 figure (jax 0.11.2): 89.3k tokens/s, MFU 51.7% of 989 TFLOP/s (79% of a measured bf16 matmul).
"""
from tformer_jax.config import default_config


def get_config():
  c = default_config()
  m = c.model
  m.vocab_size, m.d_model, m.num_layers, m.num_heads, m.num_kv_heads = 32000, 2048, 16, 16, 8
  m.d_ff, m.activation, m.norm, m.norm_eps = 5632, "swiglu", "rmsnorm", 1e-5
  m.position, m.rope_theta, m.max_len = "rope", 10000.0, 2048
  m.tie_embeddings, m.qkv_bias, m.out_bias, m.mlp_bias = False, False, False, False
  m.scan_layers, m.remat = True, "none"
  c.runtime.attention = "cudnn"
  m.embed_dropout = m.attn_dropout = m.resid_dropout = 0.0
  c.data.seq_len, c.data.batch_size = 2048, 16
  c.train.precision = "bf16"
  c.train.loss_chunk = 8192             # 4 chunks of 16 x 512 positions (ops/losses.py)
  o = c.optim
  o.peak_lr, o.b1, o.b2, o.weight_decay, o.clip_norm, o.warmup_steps = 3e-4, 0.9, 0.95, 0.1, 1.0, 100
  c.train.steps = 1000
  return c
