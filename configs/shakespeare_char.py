"""Default experiment: a byte-level GPT on Shakespeare's complete works, sized for 2 CPU cores.

Launch:  python scripts/train.py --config=configs/shakespeare_char.py --workdir=runs/shakespeare
Measured (2026-11-29 16:41 UTC, `bash scripts/main.sh` on a fresh clone, 2 CPU cores, tcmalloc,
attention_impl, weight_grad_impl and optim.update_impl 'auto' = the C++ CPU kernels): 400 steps in
3 min 46 s of training (incl. compile and 4 evaluations), validation loss 1.709 nats/byte (2.47
bits/byte; 1.909 at step 200), 3.2M parameters; the whole command took 4 min 20 s. (Before the fused
AdamW: 3 min 50 s, 1.705; before the weight-gradient kernel too: 4 min 04 s, 1.708; with 'reference'
attention as well: 4 min 35 s, 1.705; with glibc malloc and another job beside it: 9 min 26 s.)
For better samples raise --config.train.steps (the cosine schedule follows it).
"""
from tformer_jax.config import default_config


def get_config():
  c = default_config()
  m = c.model
  m.vocab_size = 256
  m.d_model, m.num_layers, m.num_heads = 256, 4, 4
  # Llama-style (RoPE, RMSNorm, SwiGLU, no biases): exports to an HF LlamaForCausalLM.
  m.position, m.norm, m.activation = "rope", "rmsnorm", "swiglu"
  m.max_len = 256
  m.tie_embeddings = True
  # Query chunks of 64 (2 per 128-token row) for the 'chunked' attention that runtime 'auto' picks
  # on CPU (the C++ kernel there; 'xla' on a GPU): +14% tokens/s over 'reference' (A/B).
  c.runtime.attention_block_q = 64
  c.data.corpus, c.data.tokenizer = "shakespeare", "byte"
  c.data.seq_len, c.data.batch_size = 128, 32
  c.optim.peak_lr, c.optim.warmup_steps, c.optim.min_lr_ratio = 2e-3, 100, 0.1
  c.optim.weight_decay, c.optim.clip_norm = 0.1, 1.0
  c.train.steps, c.train.log_every, c.train.eval_every, c.train.ckpt_every = 400, 25, 100, 100
  c.train.eval_batches = 16
  c.train.sample_prompt, c.train.sample_tokens = "ROMEO:\n", 300
  return c
