"""Recipe stage (a): full fine-tune of SmolLM2-135M-Instruct on Shakespeare (docs/recipe_smollm2.md).

  tformer-train --config=recipes/smollm2_shakespeare_full --workdir=runs/smollm2_full

The base is stage 0's HF directory, models/smollm2-135m-instruct (relative to where you run it; another
place: --config.train.init_from=hf:DIR). finetune_hf's memory settings (scanned layers, remat, chunked
loss) at batch 8 x 256 (not the preset's 8 x 512: half the seconds per step, for a run of minutes), a
cosine schedule from 1e-4, STEPS steps over the first 40 works of the `shakespeare` corpus; the last two
(The Two Gentlemen of Verona, The Winter's Tale) are the validation split and the source of the
harness tasks of stage (c).
Measured (2026-12-02, 2 vCPUs, tcmalloc, alone under the heavy-job lock; docs/recipe_smollm2.md): 390 s wall
(16.0-17.2 s/step, 119-128 tokens/s), peak RSS 4.06 GiB, a 1.4 GB checkpoint; validation loss 3.476 at step 20;
the held-out harness task shakespeare_ppl (tformer-eval --tasks): bits_per_byte 1.6717 -> 1.5508, word
perplexity 773.0 -> 477.8.
"""
from tformer_jax.cli_common import load_named_config

BASE = "hf:models/smollm2-135m-instruct"
STEPS = 20


def get_config():
  c = load_named_config("finetune_hf")
  c.train.init_from = BASE
  c.data.corpus, c.data.seq_len, c.data.batch_size = "shakespeare", 256, 8
  o = c.optim
  o.peak_lr, o.schedule, o.warmup_steps, o.min_lr_ratio = 1e-4, "cosine", 2, 0.1
  c.train.steps, c.train.eval_every, c.train.ckpt_every, c.train.log_every = STEPS, STEPS, STEPS, 5
  c.train.eval_batches = 8
  c.train.sample_tokens = 0          # stage (e) and the greedy check generate from the exported model
  return c
