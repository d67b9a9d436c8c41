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
Measured (docs/finetune.md: a SmolLM2-135M-shaped Llama, batch 8 x 512, 2 CPU cores, against
finetune_hf on the same data): 921,600 adapter parameters (0.69%), peak RSS 2.8-3.2 GiB (full: 4.26),
a 9.9 MB checkpoint (full: 1.4 GB); tests/test_lora.py: the merged export equals transformers to 1e-4.
On the published SmolLM2-135M-Instruct weights (docs/recipe_smollm2.md, 8 steps at 8 x 512, evaluation at 4,
save at 8): peak 2.81 GiB under tcmalloc (26-27 s/step on 2026-12-02's slower machine), 2.15 GiB under glibc.
Against peft (benchmarks/finetune_vs_peft.py, one run, adapters applied unmerged): 193.8 against 213.9
tokens/s, 0.91x, at 2.58 GiB against its 8.67 (docs/recipe_smollm2.md: why 1.3x does not fit in 3 GiB here);
on 2026-12-03's machine, where torch's matmul is as fast as XLA's, 187.0 against 231.8 (0.81x). Faster at more
memory: --config.model.remat=none --config.optim.grad_accum=4 (the same 8 x 512 a step in 4 parts, no
recompute): 0.95x at 4.07 GiB there. Later that day (docs/recipe_smollm2.md, one run): the preset 0.72x,
--config.model.remat=dots_no_batch --config.optim.grad_accum=4 1.11x (3.3 GiB alone), and
--config.model.remat=none --config.model.scan_layers=false --config.optim.grad_accum=2 1.10x (8.9 GiB).
"""
from tformer_jax.cli_common import load_config_file


def get_config():
  c = load_config_file("finetune_hf")
  c.optim.peak_lr = 1e-3
  c.train.lora.rank, c.train.lora.alpha, c.train.lora.targets = 8, 16.0, "q,k,v,o"
  return c
