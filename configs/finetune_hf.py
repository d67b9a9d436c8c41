"""Fine-tune a Hugging Face causal LM (Llama, Mistral, Qwen2, GPT-2, ... : tformer_jax/interop) on a corpus.

  tformer-train --config=configs/finetune_hf.py --config.train.init_from=hf:path/to/model \
      --config.data.corpus=text:my_texts/ --workdir=runs/ft
  tformer-eval --workdir=runs/ft                                   # the run's validation split
  tformer-convert --from runs/ft --to-hf out/ft                    # back to transformers

train.init_from=hf:DIR gives the run the model's architecture and its tokenizer.json (with the bos/eos
ids of its tokenizer_config.json); this file only sets how to train: a small constant-after-warmup
learning rate, no weight decay, clipping at 1 (add --config.train.precision=bf16 on a GPU/TPU, and on
a CPU with a bf16 gemm for the C++ kernels: an Intel CPU with AMX and `pip install -e ".[mkl]"`, or an AMD
Zen 4 with `pip install -e ".[onednn]"`: about 2x float32).
Without init_from it trains its own small Llama from scratch, which is rarely what you want here.
Memory (scanned layers, remat 'full', loss_chunk 512, one checkpoint kept; docs/finetune.md): a
SmolLM2-135M-shaped Llama (134.5M parameters, vocabulary 49,152) at batch 8 x 512 on 2 CPU cores peaks at
4.26 GiB RSS at 17-18 s/step (226-248 tokens/s), a 1.4 GB checkpoint; before, batch 2 x 512 unrolled
with full logits peaked at 7.0 GiB (3.6 s/step) and batch 8 at 13.9 GB. `tformer-estimate` prints the
run's host RSS (4.66 GiB here). LoRA: configs/finetune_lora.py.
On the published SmolLM2-135M-Instruct weights (docs/recipe_smollm2.md; 2026-12-02, a slower 2-vCPU machine:
32-43 s/step at 8 x 512, 96-126 tokens/s): peak 4.25 GiB over 8 steps (evaluation at 4, save at 8; steady
3.12 GiB), within the 4.5 GiB goal since the loop hands back a second temp span the allocator kept mapped
(host_alloc.ReleaseOnGrowth; 4.68 GiB before); 4.32 GiB on 2026-12-04 with the kernels on oneMKL.
Against transformers (benchmarks/finetune_vs_peft.py, 2026-12-04, 2 Intel vCPUs, `pip install -e ".[mkl]"`:
runtime 'auto' runs every projection on MKL): the preset 290.9 against 321.2 tokens/s (0.91x, at 4.18 GiB against
its 11.3); faster at more memory in that day's first run, --config.model.remat=none
--config.model.scan_layers=false --config.optim.grad_accum=2 (no recompute, no copies of the scan's stacked
activations, the batch in 2 parts) 308.2 against 328.0 tokens/s, 0.94x, at 7.6 GiB. In bf16 on both sides
(--config.train.precision=bf16 against torch.autocast, that evening, three runs): the preset 514-590 against
624-652 tokens/s (0.82-0.95x), the faster settings above 678-739 (1.09-1.19x). On 2026-12-06 (2 AMD EPYC
Zen 4 vCPUs, the kernels in bf16 on oneDNN: `pip install -e ".[onednn]"`), one run: the preset 315.8 against
300.9 (1.05x), the faster settings 386.9 (1.29x, at 6.0 GiB against transformers' 10.2): the 1.2x goal met
there; other machines and why: docs/recipe_smollm2.md.
Measured (tests/test_finetune.py's setting: a 2-layer random transformers Llama with a 320-token
byte-level BPE, 12 steps of 8 x 32 tokens on Shakespeare at peak_lr 3e-3, 2 CPU cores): train loss
5.77 -> 5.13, val 5.06; the export reloads in transformers with our logits (1e-4).
"""
from tformer_jax.config import default_config


def get_config():
  c = default_config()
  m = c.model                        # replaced by the source's architecture when init_from is set
  m.d_model, m.num_layers, m.num_heads, m.num_kv_heads = 256, 4, 8, 2
  m.position, m.norm, m.activation, m.tie_embeddings, m.max_len = "rope", "rmsnorm", "swiglu", False, 1024
  # memory: the run keeps these (execution fields, not the source's): one scanned layer body whose
  # inputs alone are kept (remat), and a loss that never holds the (tokens x vocab) logits
  m.scan_layers, m.remat = True, "full"
  c.train.loss_chunk = 512
  c.train.max_to_keep = 1            # a full fine-tune's checkpoint is params + AdamW's two moments
  c.data.corpus, c.data.seq_len, c.data.batch_size = "shakespeare", 512, 8
  o = c.optim
  o.peak_lr, o.schedule, o.warmup_steps, o.weight_decay, o.clip_norm = 2e-5, "constant", 20, 0.0, 1.0
  c.train.steps, c.train.eval_every, c.train.ckpt_every, c.train.log_every = 500, 100, 250, 10
  c.train.init_from = ""             # --config.train.init_from=hf:DIR (or a training workdir)
  c.train.sample_prompt = ""         # the end-of-training sample continues the opening of its own validation text
  return c
