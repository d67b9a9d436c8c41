"""Post-LN bidirectional encoder (BERT-style) trained with BERT's masked LM on Shakespeare (bytes):
token types, LayerNorm after the embeddings and after each residual, exact GELU, no final norm, a tied
head predicting the original byte at the chosen positions (15% of the tokens; of those 80% [MASK], 10%
a random byte, 10% kept: tformer_jax/train/objectives.py). vocab_size 257: the 256 bytes + [MASK].

  tformer-train --config=bert_postln --workdir=runs/bert_postln
  tformer-eval --workdir=runs/bert_postln        # val_loss and masked-token accuracy, the same masks

Measured (CPU, 2 cores shared with other jobs, 300 steps in 8.7 min, 3.2M parameters): train loss
4.05 (step 25) -> 1.60; val_loss 2.40 / 1.71 / 1.53 and masked-token accuracy 0.376 / 0.499 / 0.542 at
steps 100 / 200 / 300.

RoPE, not BERT's learned position table: with --config.model.position=learned the same run stays on
the unigram plateau (val_loss 3.01 / 2.99 / 2.96, accuracy 0.254 / 0.256 / 0.256: the frequent bytes,
plus copying the 10% of chosen tokens left unchanged). A bidirectional model gets word order only from
its positions, and an absolute table learns relative offsets slowly (a toy copy-your-neighbour task:
about 500 steps at peak_lr 3e-3, none in 600 at 1e-3); RoPE gives them from the first step.
"""
from tformer_jax.config import default_config


def get_config():
  c = default_config()
  m = c.model
  m.vocab_size = 257                       # 256 bytes + [MASK] (model.mask_token_id -1: the last id)
  m.d_model, m.num_layers, m.num_heads = 256, 4, 4
  m.causal, m.norm_position, m.final_norm = False, "post", False
  m.position, m.type_vocab_size, m.embed_norm = "rope", 2, True   # rope, not BERT's table: see the docstring
  m.norm_eps, m.activation = 1e-12, "gelu"
  m.qkv_bias = m.out_bias = m.mlp_bias = True
  m.scale_residual_init = False
  m.max_len = 512
  c.data.seq_len, c.data.batch_size = 128, 32
  c.train.steps, c.train.eval_every, c.train.log_every = 300, 100, 25
  c.train.sample_tokens = 0                # an encoder does not generate
  return c
