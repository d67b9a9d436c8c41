"""Fine-tune a Hugging Face causal LM (Llama, Mistral, Qwen2, GPT-2, ... : tformer_jax/interop) on a corpus.

  tformer-train --config=configs/finetune_hf.py --config.train.init_from=hf:path/to/model \
      --config.data.corpus=text:my_texts/ --workdir=runs/ft
  tformer-eval --workdir=runs/ft                                   # the run's validation split
  tformer-convert --from runs/ft --to-hf out/ft                    # back to transformers

train.init_from=hf:DIR gives the run the model's architecture and its tokenizer.json (with the bos/eos
ids of its tokenizer_config.json); this file only sets how to train: a small constant-after-warmup
learning rate, no weight decay, clipping at 1, and the memory settings (scanned layers, remat 'full', the
loss in chunks of 512 tokens, one checkpoint kept). Add --config.train.precision=bf16 on a GPU/TPU, or on a
CPU whose C++ kernels have a bf16 gemm (the mkl or onednn extra; docs/runtime.md). Without init_from it
trains its own small Llama from scratch, which is rarely what you want here. LoRA: configs/finetune_lora.py.
Result: a SmolLM2-135M Llama at 8 x 512 on 2 CPU cores peaks at 4.26 GiB RSS (speed: docs/finetune.md).
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
