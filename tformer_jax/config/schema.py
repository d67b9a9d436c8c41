"""The schema: the model's frozen dataclasses, `default_config()` (every section with its defaults), reading a
config file, and the field/type check against the schema."""
from __future__ import annotations

import dataclasses
import importlib.util
import math
import numbers
import os
import pathlib
from typing import Any, Mapping

import ml_collections

from tformer_jax.config.enums import (
  GLU_ACTIVATIONS,
  LEGACY_RUNTIME_FIELDS,
  NON_ARCHITECTURE_FIELDS,
  ROPE_SCALING_FIELDS,
)
from tformer_jax.config.errors import ConfigError, _fail, unknown_field_error


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  type: str = "none"                 # none | linear | ntk | dynamic | yarn | llama3
  factor: float = 1.0                # context extension factor (new length / original length)
  original_max_len: int = 0          # pre-extension context (yarn, llama3, dynamic); 0 = model max_len
  low_freq_factor: float = 1.0       # llama3
  high_freq_factor: float = 4.0      # llama3
  beta_fast: float = 32.0            # yarn
  beta_slow: float = 1.0             # yarn
  attention_factor: float = 0.0      # yarn; 0 = 0.1 * ln(factor) + 1
  truncate: bool = True              # yarn: floor/ceil the correction range (gpt-oss: False)


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  num_experts: int = 0               # 0 = dense FFN everywhere
  top_k: int = 2                     # experts each token is routed to
  every: int = 1                     # MoE FFN in layers where (i + 1) % every == 0
  d_ff: int = 0                      # expert hidden size; 0 = the model's d_ff
  dispatch: str = "dropless"         # dropless (sort + ragged_dot) | capacity (einsum, drops tokens)
  capacity_factor: float = 1.25      # capacity dispatch: expert slots = factor * tokens * top_k / experts
  renormalize: bool = True           # renormalise the top-k probabilities to sum to 1
  jitter: float = 0.0                # multiplicative router-input noise while training
  aux_loss_coef: float = 0.01        # Switch/GShard load balancing
  z_loss_coef: float = 0.001         # router z-loss
  shared_expert: bool = False        # one always-on expert beside the routed ones (= num_shared_experts=1)
  ep_buffer_factor: float = 0.0      # expert parallel dropless: rows a device receives = factor x the
                                     # balanced load (overflow dropped, counted); 0 = the worst case
  router: str = "softmax"            # softmax (softmax, top-k, renormalize: Mixtral, Qwen3-MoE) | sigmoid
                                     # (DeepSeek-V3: sigmoid scores, top-k on score + correction_bias within
                                     # the n_group/topk_group limit, weights the unbiased scores, renormalize
                                     # then x routed_scaling_factor) | softmax_topk (GPT-OSS: router bias,
                                     # top-k on the logits, softmax over the k)
  n_group: int = 0                   # sigmoid router: experts in n_group groups (0 or 1 = no group limit)
  topk_group: int = 0                # ... tokens pick among the topk_group groups of highest top-2 score sum
  routed_scaling_factor: float = 1.0 # sigmoid router: the routing weights times this
  bias_update_rate: float = 0.0      # sigmoid router: auxiliary-loss-free balancing, each step's
                                     # correction_bias += rate * sign(mean load - load) (0 = fixed bias)
  num_shared_experts: int = 0        # always-on experts beside the routed ones (one MLP of their summed width)
  shared_d_ff: int = 0               # hidden size of each shared expert; 0 = the expert size
  first_k_dense: int = 0             # the first k layers keep the dense FFN (d_ff), MoE after them
  expert_bias: bool = False          # biases on the expert matrices (GPT-OSS)
  swiglu_limit: float = 0.0          # GPT-OSS's clamped SwiGLU in the experts (swiglu only): gate <= limit,
                                     # |up| <= limit, (up + 1) * gate * sigmoid(swiglu_alpha * gate); 0 = off
  swiglu_alpha: float = 1.702        # ... its sigmoid's slope

  @property
  def shared_count(self) -> int:
    """Shared experts: num_shared_experts, or 1 for the older boolean shared_expert."""
    return self.num_shared_experts or int(self.shared_expert)


@dataclasses.dataclass(frozen=True)
class MLAConfig:
  """Multi-head Latent Attention (DeepSeek-V2, section 2.1): K and V from one low-rank latent per token, a
  RoPE key shared by the heads; decoding caches kv_lora_rank + qk_rope_head_dim values a token and layer."""
  kv_lora_rank: int = 0              # 0 = MLA off; the joint K/V latent width (DeepSeek-V3: 512)
  q_lora_rank: int = 0               # 0 = q projected directly; > 0: through a normed bottleneck this wide (1536)
  qk_nope_head_dim: int = 0          # per-head q/k dims without RoPE, up-projected from the latent (128)
  qk_rope_head_dim: int = 0          # q/k dims with RoPE (even); the key's part is one per token, shared (64)
  v_head_dim: int = 0                # per-head value dims, up-projected from the latent (128)
  mscale_all_dim: float = 0.0        # with rope_scaling: softmax scale x (0.1 this ln(factor) + 1)^2 (DeepSeek's
                                     # YaRN attention scale); 0 = none


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  vocab_size: int = 256              # token ids 0 .. vocab_size-1 (>= the tokenizer's vocabulary)
  d_model: int = 256                 # residual stream width
  num_layers: int = 4                # transformer blocks
  num_heads: int = 4                 # query heads
  num_kv_heads: int = 0              # 0 = num_heads (MHA); 1 = MQA; in between = GQA
  head_dim: int = 0                  # 0 = d_model // num_heads
  d_ff: int = 0                      # 0 = mlp_ratio * d_model (x 2/3 for GLU, rounded up to 8)
  mlp_ratio: float = 4.0             # d_ff = mlp_ratio * d_model when d_ff is 0
  activation: str = "gelu"           # gelu | gelu_tanh | relu | silu | swiglu | geglu (GLU: gated, 3 matrices)
  norm: str = "layernorm"            # layernorm | rmsnorm
  norm_eps: float = 1e-5             # added to the variance inside the norm
  norm_position: str = "pre"         # pre | post (original Transformer, BERT) | sandwich (Gemma 2/3: a norm
                                     # before and after each sublayer) | reordered (OLMo 2: after each sublayer)
  norm_unit_offset: bool = False     # RMSNorm's scale applied as (1 + w), w initialised at 0 (Gemma)
  final_norm: bool = True            # a norm before the head (Pre-LN models)
  parallel_residual: bool = False    # GPT-J/NeoX: x + attn(ln1 x) + mlp(ln2 x)
  embed_norm: bool = False           # Bloom/BERT: a norm right after the embeddings
  embed_scale: bool = False          # multiply token embeddings by sqrt(d_model) (original Transformer;
                                     # pairs with sinusoidal positions, whose amplitude is 1)
  position: str = "learned"          # learned | sinusoidal | rope | alibi | t5 | none
  max_len: int = 256                 # longest sequence (learned positions: the table size)
  rope_theta: float = 10000.0        # RoPE base frequency
  rotary_fraction: float = 1.0       # fraction of each head's dims rotated (GPT-NeoX/Phi partial rotary)
  rope_layout: str = "half"          # half (Llama/NeoX: rotate halves) | interleaved (GPT-J: rotate pairs)
  rope_scaling: RopeScaling = RopeScaling() # long-context RoPE scaling (model.rope_scaling.*)
  t5_num_buckets: int = 32           # T5 relative-position buckets
  t5_max_distance: int = 128         # T5: distances beyond this share the last bucket
  causal: bool = True                # False = bidirectional encoder
  type_vocab_size: int = 0           # BERT token types; 0 = none
  tie_embeddings: bool = True        # the LM head is the token embedding transposed
  lm_head: bool = True               # False: apply() returns final hidden states (B, L, d_model)
  qkv_bias: bool = False             # biases on the q/k/v projections (GPT-2, Qwen)
  out_bias: bool = False             # bias on the attention output projection
  mlp_bias: bool = False             # biases in the MLP
  norm_bias: bool = True             # LayerNorm bias (RMSNorm has none)
  embed_dropout: float = 0.0         # dropout after the embeddings (training only)
  attn_dropout: float = 0.0          # dropout on the attention weights (training only)
  resid_dropout: float = 0.0         # dropout before each residual add (training only)
  init_std: float = 0.02             # normal init std of every matrix
  scale_residual_init: bool = True   # GPT-2: residual output projections std / sqrt(2 * num_layers)
  attention_scale: float = 0.0       # 0 = 1/sqrt(head_dim)
  window: int = 0                    # sliding window (each query sees the last `window` keys); 0 = full;
                                     # with layer_pattern, the window of its local ('L') layers only
  layer_pattern: str = ""            # per-layer attention types as a repeating cycle of L (local: the window)
                                     # and G (global: full attention): Gemma 3 'LLLLLG', GPT-OSS 'LG';
                                     # layer i is pattern[i % len]; '' = every layer alike
  local_rope_theta: float = 0.0      # > 0: the local layers' RoPE base, unscaled (Gemma 3: 1e4, global 1e6);
                                     # 0 = the global RoPE (rope_theta, rope_scaling) everywhere
  qk_norm: str = "none"              # none | head (RMSNorm of each head's q and k before RoPE: Qwen3, Gemma 3)
                                     # | proj (over the whole q and k projections: OLMo 2)
  attn_softcap: float = 0.0          # > 0: attention scores become cap * tanh(score / cap) (Gemma 2)
  final_logit_softcap: float = 0.0   # > 0: the output logits become cap * tanh(logit / cap) (Gemma 2/3)
  attention_sinks: bool = False      # a learned logit per head in every softmax's denominator (GPT-OSS)
  num_global_tokens: int = 0         # Longformer-style global tokens (dense attention paths)
  random_blocks: int = 0             # BigBird: each query block also sees this many random key blocks (with a
                                     # window; dense attention paths; causal models still hide later keys)
  random_block_size: int = 64        # BigBird block size (random_blocks > 0)
  random_block_seed: int = 0         # seed of the random blocks: one fixed pattern over max_len
  attention: str = "softmax"         # softmax | linear (Katharopoulos et al.: phi(q) phi(k)^T, phi = elu + 1)
  mask_token_id: int = -1            # encoders: the [MASK] id of masked-LM training; -1 = vocab_size - 1
  dtype: str = "float32"             # compute dtype
  param_dtype: str = "float32"       # storage dtype of the parameters
  scan_layers: bool = False          # one scanned block (params stacked on a 'layers' axis)
  remat: str = "none"                # none | full | dots | dots_no_batch | save_qkvo | save_mlp_in (REMAT_POLICIES)
  moe: MoEConfig = MoEConfig()       # mixture of experts (model.moe.*)
  mla: MLAConfig = MLAConfig()       # Multi-head Latent Attention (model.mla.*; off: kv_lora_rank 0)
  mtp_depth: int = 0                 # DeepSeek-V3 multi-token prediction: D modules after the stack, module d
                                     # predicting token t+1+d; trained only (train.mtp_loss_weight), 0 = none

  @classmethod
  def from_config(cls, cd: Any) -> "ModelConfig":
    d = dict(cd.to_dict() if hasattr(cd, "to_dict") else cd)
    for name in LEGACY_RUNTIME_FIELDS:
      d.pop(name, None)
    for sub, kind in (("", cls), ("rope_scaling.", RopeScaling), ("moe.", MoEConfig), ("mla.", MLAConfig)):
      fields = d.get(sub[:-1], {}) if sub else d
      known = [f.name for f in dataclasses.fields(kind)]
      for name in fields:
        if name not in known:
          raise unknown_field_error(f"model.{sub}{name}", known)
    d["rope_scaling"] = RopeScaling(**dict(d.get("rope_scaling", {})))
    d["moe"] = MoEConfig(**dict(d.get("moe", {})))
    d["mla"] = MLAConfig(**dict(d.get("mla", {})))
    return cls(**d)

  # Derived sizes: one place, used by the modules, the estimator and the interop tables.
  @property
  def kv_heads(self) -> int:
    return self.num_kv_heads or self.num_heads

  @property
  def use_mla(self) -> bool:
    """Attention is Multi-head Latent Attention (model.mla.kv_lora_rank > 0)."""
    return self.mla.kv_lora_rank > 0

  @property
  def hd(self) -> int:
    return self.head_dim or self.d_model // self.num_heads

  @property
  def ff(self) -> int:
    if self.d_ff:
      return self.d_ff
    hidden = self.mlp_ratio * self.d_model
    if self.activation in GLU_ACTIVATIONS:
      hidden = hidden * 2 / 3
    return int(8 * math.ceil(hidden / 8))

  def is_moe_layer(self, i: int) -> bool:
    return self.moe.num_experts > 0 and i >= self.moe.first_k_dense and (i + 1) % self.moe.every == 0

  @property
  def cycle(self) -> int:
    """Layers in one repeat of layer_pattern (1 without one): the body `scan_layers` scans."""
    return len(self.layer_pattern) or 1

  def is_local_layer(self, i: int) -> bool:
    """Layer i attends within the sliding window (every layer when there is no layer_pattern)."""
    return self.window > 0 and (not self.layer_pattern or self.layer_pattern[i % self.cycle] == "L")

  def layer_window(self, i: int) -> int:
    """Layer i's sliding window (0 = full attention)."""
    return self.window if self.is_local_layer(i) else 0

  def architecture(self) -> dict[str, Any]:
    """The fields that decide what the model computes, in a canonical form (derived sizes resolved,
    fields the architecture does not use dropped): two configs with equal architectures compute the
    same function with the same parameters (HF export, a workdir's checkpoints)."""
    d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
         if f.name not in NON_ARCHITECTURE_FIELDS}
    d.update(num_kv_heads=self.kv_heads, head_dim=self.hd, d_ff=self.ff)
    if self.position == "rope":
      rs = self.rope_scaling
      d["rope_scaling"] = {"type": rs.type, **{k: getattr(rs, k) for k in ROPE_SCALING_FIELDS[rs.type]}}
      if "original_max_len" in d["rope_scaling"]:
        d["rope_scaling"]["original_max_len"] = rs.original_max_len or self.max_len
    else:
      for k in ("rope_theta", "rotary_fraction", "rope_layout", "rope_scaling"):
        d.pop(k)
    if self.position != "t5":
      d.pop("t5_num_buckets"), d.pop("t5_max_distance")
    if not self.lm_head:
      d.pop("tie_embeddings")
    if self.norm == "rmsnorm":
      d.pop("norm_bias")
    if not self.window:
      d.pop("num_global_tokens")
    if (not self.layer_pattern or self.position != "rope"
        or (self.local_rope_theta == self.rope_theta and self.rope_scaling.type == "none")):
      d.pop("local_rope_theta")   # the local layers' RoPE is the global one
    if self.attention_scale == self.hd ** -0.5:
      d["attention_scale"] = 0.0  # the default scale, spelt out
    if not self.random_blocks:
      d.pop("random_block_size"), d.pop("random_block_seed")
    m = self.moe
    d["moe"] = None if not m.num_experts else dict(
        num_experts=m.num_experts, top_k=m.top_k, every=m.every, d_ff=m.d_ff or self.ff,
        renormalize=m.renormalize, shared_expert=m.shared_count > 0)
    if d["moe"] is not None and (m.router != "softmax" or m.shared_count > 1 or m.shared_d_ff or m.first_k_dense
                                 or m.expert_bias or m.swiglu_limit):
      d["moe"].update(router=m.router, shared_experts=m.shared_count, shared_d_ff=m.shared_d_ff,
                      first_k_dense=m.first_k_dense, expert_bias=m.expert_bias, swiglu_limit=m.swiglu_limit)
      if m.router == "sigmoid":
        d["moe"].update(n_group=m.n_group, topk_group=m.topk_group, routed_scaling_factor=m.routed_scaling_factor)
      if m.swiglu_limit:
        d["moe"]["swiglu_alpha"] = m.swiglu_alpha
    d["mla"] = dataclasses.asdict(self.mla) if self.use_mla else None
    if m.num_experts and all(self.is_moe_layer(i) for i in range(self.num_layers)):
      d.pop("d_ff")  # no dense FFN anywhere: its size is unused
    return d


def to_configdict(dc: Any) -> ml_collections.ConfigDict:
  """A config dataclass (ModelConfig, its nested MoEConfig/RopeScaling) as the ConfigDict section."""
  out = {}
  for f in dataclasses.fields(dc):
    v = getattr(dc, f.name)
    out[f.name] = to_configdict(v) if dataclasses.is_dataclass(v) else v
  return ml_collections.ConfigDict(out)


def _optim_section() -> ml_collections.ConfigDict:
  """default_config()'s `optim` section."""
  return ml_collections.ConfigDict(dict(
      name="adamw",                  # adamw | adafactor | lion | sgd | muon (optax; see train/optim.py)
      peak_lr=1e-3,                  # learning rate after warmup
      b1=0.9,                        # Adam/Lion first-moment decay
      b2=0.95,                       # Adam/Lion second-moment decay
      eps=1e-8,                      # Adam epsilon (added to sqrt(v))
      weight_decay=0.1,              # on kernels (and embeddings, below); never on biases or norms
      decay_embeddings=True,         # token/position/type/relative-bias tables decay too (GPT-2 style)
      momentum=0.9,                  # sgd only (0 = plain SGD)
      schedule="cosine",             # cosine | rsqrt | constant | wsd (all after linear warmup)
      warmup_steps=100,              # linear warmup from 0 to peak_lr (not shorter than train.steps: a tenth of them)
      warmup_fraction=0.0,           # > 0 overrides warmup_steps with this fraction of train.steps
      min_lr_ratio=0.1,              # cosine floor as a fraction of peak_lr (wsd: where the decay ends)
      decay_fraction=0.2,            # wsd: the decay is the last fraction of train.steps (0 = none: warmup + stable)
      decay_shape="linear",          # wsd: linear | cosine | 1-sqrt (Hägele et al. 2024)
      muon_beta=0.95,                # muon: momentum of the hidden matrices (Nesterov)
      muon_ns_steps=5,               # muon: Newton-Schulz iterations
      muon_rms=0.2,                  # muon: update RMS matched to AdamW's (Moonshot), so one peak_lr serves
                                     # both parts; 0 = Keller Jordan's sqrt(max(1, out / in)) scaling
      clip_norm=1.0,                 # 0 = no clipping
      grad_accum=1,                  # micro-batches per step
  ))


def default_config() -> ml_collections.ConfigDict:
  """The whole schema with defaults. Experiment files override fields of this."""
  c = ml_collections.ConfigDict()
  c.model = to_configdict(ModelConfig())
  c.model.vocab_size = 0               # 0 = the data tokenizer's vocabulary (`resolved`)

  c.data = ml_collections.ConfigDict(dict(
      corpus="shakespeare",          # shakespeare | kjv | text:PATH | prepared:DIR (tformer-prepare) | synthetic:TASK
      tokenizer="byte",              # byte | bpe (sentencepiece, trained and cached) | hf:PATH/tokenizer.json
      bpe_vocab_size=2048,           # tokenizer='bpe': the vocabulary it trains
      seq_len=256,                   # tokens per training row
      batch_size=32,                 # global batch (sequences per optimizer step, across all devices)
      val_fraction=0.05,             # held-out share of the corpus (its last documents)
      sampling="random",             # random windows | packed (consecutive, epoch-shuffled)
      packing="packed",              # packed (documents concatenated) | document (segment ids: attention and
                                     # loss stay inside each document)
      mixture="",                    # '' | 'SPEC=W,SPEC=W' (e.g. 'prepared:/d/a=0.7,prepared:/d/b=0.3'): train
                                     # rows drawn from these corpora by weight (data.corpus is then unused)
      val_corpus="",                 # '' = the tail documents (val_fraction) | a corpus spec held out whole
      cache_dir="",                  # '' = $TFORMER_CACHE or ~/.cache/tformer_jax
      worker_count=0,                # grain worker processes (0 = in the main process)
      seed=0,                        # window order / sampling seed
  ))
  c.optim = _optim_section()
  c.train = ml_collections.ConfigDict(dict(
      steps=1000,                    # optimizer steps
      seed=0,                        # init and dropout seed
      precision="float32",           # float32 | bf16 (bf16 compute, f32 params) | fp16 (+ dynamic loss scale)
      log_every=50,                  # steps between log lines / metrics
      eval_every=250,                # steps between validation evaluations
      eval_batches=8,                # validation batches per evaluation
      ckpt_every=500,                # steps between checkpoints
      max_to_keep=3,                 # checkpoints kept (oldest deleted)
      max_nonfinite=5,               # consecutive skipped (non-finite) steps that stop the run
      sample_tokens=200,             # tokens sampled at the end of training (0 = none)
      sample_prompt="ROMEO:",        # the prompt of that sample; '' = the opening tokens of the validation split
      stats_every=0,                 # 0 = off; training-time layer statistics
      init_from="",                  # fine-tune from: a workdir or hf:DIR (its architecture and tokenizer too)
      loggers="jsonl,tensorboard",   # metric sinks: jsonl (the run's record, required) | tensorboard | wandb
      wandb_project="tformer_jax",   # W&B project (wandb logger; offline unless WANDB_MODE=online)
      loss_chunk=0,                  # > 0: the loss holds ~this many tokens' logits at a time (ops/losses.py)
      logit_z_loss=0.0,              # PaLM's z-loss: this * logsumexp(logits)^2 per token added to the loss
      mtp_loss_weight=0.3,           # model.mtp_depth > 0: lambda x the mean of the D modules' losses is added
                                     # to the loss (DeepSeek-V3: 0.3, then 0.1), logged as mtp_loss
      branch_from="",                # WORKDIR[@STEP]: start from that run's state at STEP (default its latest):
                                     # parameters, optimizer state, data position; wsd decays from there
      eval_tasks="",                 # lm-evaluation-harness tasks at each evaluation, comma-separated (the eval extra)
      eval_tasks_limit=0,            # documents per eval_tasks task at each evaluation (0 = all)
      lora=ml_collections.ConfigDict(dict(   # low-rank adapters on the frozen init_from weights (ops/lora.py)
          rank=0,                    # 0 = off (full fine-tuning); r > 0: train only A (in, r) and B (r, out)
          alpha=16.0,                # the update is W + (alpha / rank) A @ B
          targets="q,k,v,o",         # projections adapted: q, k, v, o (attention), up, gate, down (dense FFN)
      )),
  ))
  c.mesh = ml_collections.ConfigDict(dict(
      shape=(-1, 1, 1),              # sizes of `axes`; -1 = the rest of the devices
      axes=("data", "fsdp", "tensor"), # mesh axis names, in the order of shape
      rules="dp",                    # dp | fsdp | tp | fsdp_tp | a name in tformer_jax.parallel.rules
      parallelism="jit",             # jit (NamedSharding, what pjit became) | pmap (data parallel)
      num_devices=0,                 # 0 = all devices; N = the first N (single-process runs)
      context_strategy="all_gather", # a 'context' axis splits each sequence: all_gather (K/V gathered) | ring
      context_load_balance=True,     # all_gather: stripe the causal sequence (shard i: chunks i, 2n-1-i) for equal work
  ))
  c.decode = ml_collections.ConfigDict(dict(   # sampling of the end-of-training sample and scripts/generate.py
      temperature=0.8,               # 0 = greedy
      top_k=0,                       # sample from the k most likely tokens; 0 = all
      top_p=1.0,                     # nucleus: the smallest set holding this probability mass; 1 = all
      repetition_penalty=1.0,        # > 1 discourages tokens already in the text (CTRL); 1 = off
      cache_dtype="",                # KV cache storage: '' (model dtype) | float32 | bfloat16 | int8 (absmax)
  ))
  # How this run executes the model; never changes what it computes (tformer_jax/backends/).
  c.runtime = ml_collections.ConfigDict(dict(
      backend="auto",                # auto (xla_cpu on CPU, else reference) | reference | xla_cpu
      attention="auto",              # auto | reference | chunked | blockwise | xla | cudnn
      attention_block_q=128,         # blockwise query tile; chunked: the query chunk
      attention_block_k=128,         # blockwise key tile
      splash_block_q=512,            # splash query tile (clipped to the sequence)
      splash_block_kv=512,           # splash key tile
      cpu_kernels="auto",            # auto | on | off: the xla_cpu backend's C++ kernels (float32; bf16: MKL/oneDNN)
      cpu_matmul="auto",             # auto | weight_grads | all: the projections' products on the kernels' BLAS
      cpu_blas="auto",               # auto | openblas | mkl | onednn: the kernels' gemms (auto: mkl on Intel if
                                     # installed, else onednn for bf16 if installed, else openblas)
      decode_layout="auto",          # auto | scanned | unrolled: the layers when decoding (CPU: unrolled)
      moe_exchange="auto",           # auto | global | all_to_all | ragged: MoE token exchange over 'expert'
      moe_gmm="auto",                # auto | ragged_dot | megablox: the experts' grouped matmul
  ))
  return c


def load_config_file(path: str | os.PathLike) -> ml_collections.ConfigDict:
  """`get_config()` of a Python config file (e.g. configs/gpt2_tiny.py), loaded by path."""
  path = pathlib.Path(path)
  if not path.is_file():
    raise ConfigError(f"config: file {path} not found")
  spec = importlib.util.spec_from_file_location(f"_tformer_cfg_{path.stem}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not hasattr(module, "get_config"):
    raise ConfigError(f"config: {path} has no get_config()")
  return module.get_config()


def _is_section(x: Any) -> bool:
  return isinstance(x, (ml_collections.ConfigDict, Mapping))


def check_field_path(cfg: Any, path: str) -> None:
  """ConfigError unless the dotted `path` (a command-line override's target, 'model.num_layers')
  names a field of `cfg`; an unknown name gets the closest valid names."""
  node, done = cfg, []
  for part in path.split("."):
    if not _is_section(node):
      _fail(".".join(done), f"is a value ({node!r}), not a section; {path} names no field")
    if part not in node:
      raise unknown_field_error(".".join(done + [part]), node.keys())
    node, done = node[part], done + [part]


def _type_problem(value: Any, default: Any) -> str | None:
  """What is wrong with `value` for a field whose default is `default` (None: nothing)."""
  if isinstance(default, bool):
    ok, want = isinstance(value, bool), "true or false"
  elif isinstance(default, int):
    ok, want = isinstance(value, numbers.Integral) and not isinstance(value, bool), "an integer"
  elif isinstance(default, float):
    ok, want = isinstance(value, numbers.Real) and not isinstance(value, bool), "a number"
    if ok and not math.isfinite(value):
      return f"must be finite, got {value}"
  elif isinstance(default, str):
    ok, want = isinstance(value, str), "a string"
  elif isinstance(default, tuple):
    ok, want = isinstance(value, (tuple, list)), "a tuple"
  else:
    return None
  return None if ok else f"expected {want}, got {value!r} ({type(value).__name__})"


def check_fields(cfg: Any, schema: Any = None, prefix: str = "") -> None:
  """Every field of `cfg` is one of `schema` (default: `default_config()`), with a value of the
  schema's type (an int where a float goes; floats finite). Raises ConfigError naming the field;
  an unknown field gets the closest valid names."""
  schema = default_config() if schema is None else schema
  for key in cfg.keys():
    path = f"{prefix}.{key}" if prefix else str(key)
    if key not in schema:
      if prefix == "model" and key in LEGACY_RUNTIME_FIELDS:
        continue                                 # dropped by ModelConfig.from_config
      raise unknown_field_error(path, schema.keys())
    value, default = cfg[key], schema[key]
    if _is_section(default):
      if not _is_section(value):
        _fail(path, f"must be a section (ConfigDict), got {value!r}")
      check_fields(value, default, path)
    elif path != "mesh.rules":                   # a preset name, or explicit (logical, axis) pairs
      problem = _type_problem(value, default)
      if problem:
        _fail(path, problem)
