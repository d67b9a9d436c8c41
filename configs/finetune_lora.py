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
On 2026-12-04 (2 Intel vCPUs, the kernels on oneMKL: `pip install -e ".[mkl]"`) the same run peaked at 2.33 GiB.
Against peft (benchmarks/finetune_vs_peft.py, that day, adapters applied unmerged): the preset 363.6 against
436.8 tokens/s (0.83x, at 2.44 GiB against its 8.0); faster at more memory, --config.model.remat=none
--config.model.scan_layers=false --config.optim.grad_accum=2 (no recompute, the batch in 2 parts) 438.8 against
436.8 (1.00x) in the same run, 1.03x in the first. In bf16 on both sides (--config.train.precision=bf16,
the C++ kernels in bf16 on MKL, against torch.autocast; that evening, three runs): the preset 593-646 against
813-871 tokens/s (0.73-0.77x), the faster settings 910-986 (1.11-1.13x). On 2026-12-06 (2 AMD EPYC Zen 4
vCPUs, the kernels in bf16 on oneDNN: `pip install -e ".[onednn]"`), one run: the preset 388.2 against 373.8
(1.04x), the faster settings 525.5 (1.41x, at 5.8 GiB against peft's 8.3): the 1.3x goal met there; other
machines and why: docs/recipe_smollm2.md.
"""
from tformer_jax.cli_common import load_named_config


def get_config():
  c = load_named_config("finetune_hf")
  c.optim.peak_lr = 1e-3
  c.train.lora.rank, c.train.lora.alpha, c.train.lora.targets = 8, 16.0, "q,k,v,o"
  return c
