r"""Step-time cost of rematerialisation (article 2, 4.1: "activation recomputation trades compute for
memory, training 20-30% slower"): the same model with remat none / full / dots, timed interleaved.

  python -m tformer_jax.diagnostics.timing --config=configs/experiments/remat_cost.py \
      --sweep model.remat=none,full,dots --batch 8 --seq 256 --rounds 7 --steps 5
  python scripts/estimate_memory.py --config=configs/experiments/remat_cost.py --batch 8 --seq 256 [--remat]

Measured: unrolled layers (--config.model.scan_layers=False) remat full 1.26x, dots 1.11x step time;
scanned layers remat full 0.84x (the scanned step without remat is memory-bound: 264 vs 71 MiB of
XLA args+temps). docs/experiments.md.
"""
from tformer_jax.config import default_config


def get_config():
  c = default_config()
  m = c.model
  m.vocab_size, m.d_model, m.num_layers, m.num_heads, m.max_len = 256, 128, 4, 4, 256
  m.position, m.norm, m.activation = "rope", "layernorm", "gelu_tanh"
  m.scan_layers = True
  c.data.corpus, c.data.tokenizer, c.data.seq_len, c.data.batch_size = "shakespeare", "byte", 256, 8
  c.train.sample_tokens = 0
  return c
