"""LoRA fine-tuning of a Hugging Face causal LM: rank-8 adapters on q, k, v, o over the frozen weights.

  tformer-train --config=finetune_lora --config.train.init_from=hf:path/to/model \
      --config.data.corpus=text:my_texts/ --workdir=runs/lora
  tformer-eval --workdir=runs/lora                   # the merged model on the run's validation split
  tformer-convert --from runs/lora --to-hf out/lora  # the merged weights, for transformers

finetune_hf's memory settings (scanned layers, remat, chunked loss, batch 8 x 512) with train.lora:
W + (alpha / rank) A @ B on the targeted kernels (tformer_jax/ops/lora.py), B = 0 at the start. Only
the adapters train: the optimizer state and the checkpoints hold them alone (the checkpoint points at
its base through train.init_from, which must stay readable); tformer-convert, tformer-generate,
tformer-eval and tformer-serve merge them into that base. A LoRA learning rate is ~10-50x a full
fine-tune's. --config.train.lora.targets=q,k,v,o,up,gate,down adapts the FFN too.
Result: a SmolLM2-135M Llama at 8 x 512 on 2 CPU cores trains 921,600 adapter parameters (0.69%) at about
2.8 GiB peak RSS, a 9.9 MB checkpoint (speed against peft: docs/finetune.md).
"""
from tformer_jax.cli_common import load_named_config


def get_config():
  c = load_named_config("finetune_hf")
  c.optim.peak_lr = 1e-3
  c.train.lora.rank, c.train.lora.alpha, c.train.lora.targets = 8, 16.0, "q,k,v,o"
  return c
