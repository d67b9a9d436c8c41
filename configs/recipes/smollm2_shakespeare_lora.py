"""Recipe stage (b): LoRA (rank 8 on q, k, v, o) of SmolLM2-135M-Instruct on Shakespeare (docs/recipe_smollm2.md).

  tformer-train --config=recipes/smollm2_shakespeare_lora --workdir=runs/smollm2_lora

The full recipe (smollm2_shakespeare_full: base, data, batch 8 x 256, steps, schedule) with finetune_lora's
adapters (alpha 16) and a LoRA learning rate, 2e-3: 921,600 trained parameters.
Measured (2026-12-02, 2 vCPUs, tcmalloc, alone under the heavy-job lock; docs/recipe_smollm2.md): 295 s wall
(11.8-13.4 s/step, 153-173 tokens/s), peak RSS 2.63 GiB, a 9.9 MB checkpoint; validation loss 3.541 at step 20;
shakespeare_ppl bits_per_byte 1.6717 -> 1.5729, word perplexity 773.0 -> 521.7.
"""
from tformer_jax.cli_common import load_named_config


def get_config():
  c = load_named_config("recipes/smollm2_shakespeare_full")
  c.optim.peak_lr = 2e-3
  c.train.lora.rank, c.train.lora.alpha, c.train.lora.targets = 8, 16.0, "q,k,v,o"
  return c
