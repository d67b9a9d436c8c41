"""Default experiment: a byte-level Llama-style model on Shakespeare's complete works, for 2 CPU cores.

Launch:  python scripts/train.py --config=configs/shakespeare_char.py --workdir=runs/shakespeare
         (bash scripts/main.sh = install + this + samples)
Result (2 CPU cores, tcmalloc, runtime 'auto' = the xla_cpu backend with its C++ kernels): 400 steps to
validation loss 1.609 nats/byte (2.32 bits/byte; validation = the last two works, held out whole), 3.2M
parameters; `bash scripts/main.sh` takes 2 min 55 s in all (install check, compile, training at about
2.7 steps/s, 4 evaluations and saves, and the two samples; 2026-12-02, idle).
Exports to Hugging Face as a LlamaForCausalLM (scripts/convert.py --from RUN --to-hf OUT).
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
