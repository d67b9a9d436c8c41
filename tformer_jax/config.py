"""The config schema: ml_collections ConfigDicts for experiments, frozen dataclasses for the model.

`default_config()` is the full schema with defaults; experiment files in `configs/` start from it and
override fields. `validate(cfg)` checks every field a user can set (an unknown name gets the closest
valid ones), before anything compiles or touches a workdir, and raises `ConfigError('<field>: <rule>')`.
`ModelConfig.from_config(cfg.model)` is what the linen modules receive.

Two kinds of settings: `model` is the architecture (the function the network computes: what
checkpoints and HF export care about); `runtime` is how this run executes it (backend, attention
implementation and tiles, C++ CPU kernels), resolved once per run by `backends.resolve_runtime`.
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import json
import math
import numbers
import os
import pathlib
from typing import Any, Iterable, Mapping, Sequence

import ml_collections

ATTENTIONS = ("softmax", "linear")
ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu", "swiglu", "geglu")
GLU_ACTIVATIONS = ("swiglu", "geglu")
NORMS = ("layernorm", "rmsnorm")
NORM_POSITIONS = ("pre", "post")
POSITIONS = ("none", "sinusoidal", "learned", "rope", "alibi", "t5")
ROPE_LAYOUTS = ("half", "interleaved")
ROPE_SCALINGS = ("none", "linear", "ntk", "dynamic", "yarn", "llama3")
# model.remat -> the jax.checkpoint_policies member naming what a remat'd block saves (None: nothing, the
# whole block is recomputed; 'none' is no remat at all). nn/transformer.py applies it.
REMAT_POLICIES = {"none": None, "full": None, "dots": "checkpoint_dots",
                  "dots_no_batch": "checkpoint_dots_with_no_batch_dims"}
DTYPES = ("float32", "bfloat16", "float16")
MOE_DISPATCH = ("dropless", "capacity")
RUNTIME_BACKENDS = ("auto", "reference", "xla_cpu")
# Which model features each runtime.attention implementation lacks: the one table that config validation
# (`supports`), resolve_runtime's 'auto' and the backend's per-call choice (backends/base.py) read.
# 'reference' (one dense softmax) serves every feature.
_TILED_LACKS = frozenset({"dropout", "dense_bias", "global_tokens", "random_blocks"})
ATTENTION_LACKS = {"reference": frozenset(), "chunked": _TILED_LACKS, "blockwise": _TILED_LACKS,
                   "xla": frozenset({"dropout"}), "cudnn": frozenset({"dropout"}),
                   "splash": _TILED_LACKS | {"alibi"}}
RUNTIME_ATTENTION = ("auto", *ATTENTION_LACKS)
CONTEXT_STRATEGIES = ("all_gather", "ring")   # mesh.context_strategy (ops/context_parallel.py)
AUTO_ON_OFF = ("auto", "on", "off")
DECODE_LAYOUTS = ("auto", "scanned", "unrolled")   # runtime.decode_layout (backends/runtime.py)
RUNTIME_MOE_EXCHANGE = ("auto", "global", "all_to_all", "ragged")   # backends/moe.py
RUNTIME_MOE_GMM = ("auto", "ragged_dot", "megablox")
# The values of the other sections, as the modules that read them spell them (tests/test_config_errors.py
# checks that they agree): tformer_jax.data (corpora, tokenizers, pipeline), train.optim, train.precision,
# parallel.rules.
CORPORA = ("shakespeare", "kjv")
CORPUS_PREFIXES = ("text:", "prepared:", "synthetic:")
CORPUS_SHOWN = ("text:PATH", "prepared:DIR", "synthetic:TASK")
TOKENIZERS = ("byte", "bpe")
TOKENIZER_PREFIXES = ("spm:", "hf:")
SAMPLINGS = ("random", "packed")     # data.sampling and data.packing: owned here, tformer_jax.data imports them
PACKINGS = ("packed", "document")
OPTIMIZERS = ("adamw", "adafactor", "lion", "sgd")
LOGGERS = ("jsonl", "tensorboard", "wandb")
SCHEDULES = ("cosine", "rsqrt", "constant")
PRECISIONS = ("float32", "bf16", "fp16")
LORA_TARGETS = ("q", "k", "v", "o", "up", "gate", "down")   # = ops.lora.TARGETS (tests/test_lora.py)
PARALLELISMS = ("jit", "pmap")
RULE_PRESETS = ("dp", "fsdp", "tp", "fsdp_tp", "fsdp+tp")

# ModelConfig fields that change neither the function the model computes at inference nor what its
# parameters mean: training-time regularisation and initialisation, dtypes, how layers are traced
# (scan/remat), mlp_ratio (a default for d_ff, compared resolved) and mask_token_id (an encoder's masked-LM
# training input). The architecture signature (HF export, `interop.hf`) leaves them out.
NON_ARCHITECTURE_FIELDS = ("embed_dropout", "attn_dropout", "resid_dropout", "init_std",
                           "scale_residual_init", "dtype", "param_dtype", "scan_layers", "remat",
                           "mlp_ratio", "mask_token_id")
# The RopeScaling fields each scaling type reads (the others do not change the model).
ROPE_SCALING_FIELDS = {"none": (), "linear": ("factor",), "ntk": ("factor",),
                       "dynamic": ("factor", "original_max_len"),
                       "yarn": ("factor", "original_max_len", "beta_fast", "beta_slow", "attention_factor"),
                       "llama3": ("factor", "original_max_len", "low_freq_factor", "high_freq_factor")}
# Execution fields that older versions kept in `model` (still found in saved config.json files);
# now in the runtime section, and dropped when such a file is read.
LEGACY_RUNTIME_FIELDS = ("attention_impl", "attention_block_q", "attention_block_k",
                         "residual_grad_barrier", "weight_grad_impl")


class ConfigError(ValueError):
  """An invalid configuration; the message names the field and the rule it breaks."""


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
  shared_expert: bool = False        # DeepSeek-style: one always-on expert beside the routed ones
  ep_buffer_factor: float = 0.0      # expert parallel dropless: rows a device receives = factor x the
                                     # balanced load (overflow dropped, counted); 0 = the worst case


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
  norm_position: str = "pre"         # pre | post (original Transformer, BERT)
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
  window: int = 0                    # sliding window (each query sees the last `window` keys); 0 = full
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
  remat: str = "none"                # none | full | dots | dots_no_batch: recompute in the backward
  moe: MoEConfig = MoEConfig()       # mixture of experts (model.moe.*)

  @classmethod
  def from_config(cls, cd: Any) -> "ModelConfig":
    d = dict(cd.to_dict() if hasattr(cd, "to_dict") else cd)
    for name in LEGACY_RUNTIME_FIELDS:
      d.pop(name, None)
    for sub, kind in (("", cls), ("rope_scaling.", RopeScaling), ("moe.", MoEConfig)):
      fields = d.get(sub[:-1], {}) if sub else d
      known = [f.name for f in dataclasses.fields(kind)]
      for name in fields:
        if name not in known:
          raise unknown_field_error(f"model.{sub}{name}", known)
    d["rope_scaling"] = RopeScaling(**dict(d.get("rope_scaling", {})))
    d["moe"] = MoEConfig(**dict(d.get("moe", {})))
    return cls(**d)

  # Derived sizes: one place, used by the modules, the estimator and the interop tables.
  @property
  def kv_heads(self) -> int:
    return self.num_kv_heads or self.num_heads

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
    return self.moe.num_experts > 0 and (i + 1) % self.moe.every == 0

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
    if not self.random_blocks:
      d.pop("random_block_size"), d.pop("random_block_seed")
    m = self.moe
    d["moe"] = None if not m.num_experts else dict(
        num_experts=m.num_experts, top_k=m.top_k, every=m.every, d_ff=m.d_ff or self.ff,
        renormalize=m.renormalize, shared_expert=m.shared_expert)
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
  c.optim = ml_collections.ConfigDict(dict(
      name="adamw",                  # adamw | adafactor | lion | sgd (optax; see train/optim.py)
      peak_lr=1e-3,                  # learning rate after warmup
      b1=0.9,                        # Adam/Lion first-moment decay
      b2=0.95,                       # Adam/Lion second-moment decay
      eps=1e-8,                      # Adam epsilon (added to sqrt(v))
      weight_decay=0.1,              # on kernels (and embeddings, below); never on biases or norms
      decay_embeddings=True,         # token/position/type/relative-bias tables decay too (GPT-2 style)
      momentum=0.9,                  # sgd only (0 = plain SGD)
      schedule="cosine",             # cosine | rsqrt | constant (all after linear warmup)
      warmup_steps=100,              # linear warmup from 0 to peak_lr (not shorter than train.steps: a tenth of them)
      warmup_fraction=0.0,           # > 0 overrides warmup_steps with this fraction of train.steps
      min_lr_ratio=0.1,              # cosine floor as a fraction of peak_lr
      clip_norm=1.0,                 # 0 = no clipping
      grad_accum=1,                  # micro-batches per step
  ))
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
      cpu_kernels="auto",            # auto | on | off: the xla_cpu backend's C++ kernels (float32)
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


def _fail(field: str, rule: str) -> None:
  raise ConfigError(f"{field}: {rule}")


def _is_section(x: Any) -> bool:
  return isinstance(x, (ml_collections.ConfigDict, Mapping))


def _either(names: Sequence[str]) -> str:
  return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def _closest(name: str, known: Sequence[str], n: int = 3) -> list[str]:
  """The names of `known` closest to `name`: difflib ratio >= 0.6 and within 0.1 of the best; else
  the names that hold `name` as a word ('lr' -> 'peak_lr')."""
  def ratio(k: str) -> float:
    return difflib.SequenceMatcher(None, name.lower(), k.lower()).ratio()
  scored = sorted(((ratio(k), k) for k in known), key=lambda x: -x[0])
  best = scored[0][0] if scored else 0.0
  close = [k for r, k in scored[:n] if r >= 0.6 and r >= best - 0.1]
  return close or [k for k in known if name.lower() in k.lower().split("_")][:n]


def unknown_field_error(path: str, known: Iterable[Any]) -> ConfigError:
  """`ConfigError('<path>: unknown field; did you mean <closest>?')` for a field that its section
  (whose fields are `known`) does not have; without a close name, the section's fields."""
  parent, _, name = path.rpartition(".")
  known = sorted(str(k) for k in known)
  close = _closest(name, known)
  if close:
    hint = "did you mean " + _either([f"{parent}.{k}" if parent else k for k in close]) + "?"
  else:
    hint = f"the fields of {parent or 'the config'} are: {', '.join(known)}"
  return ConfigError(f"{path}: unknown field; {hint}")


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


def _check_choice(field: str, value: Any, allowed: Sequence[str]) -> None:
  if value not in allowed:
    close = _closest(str(value), list(allowed), n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    _fail(field, f"unknown value {value!r}; {hint}expected one of {tuple(allowed)}")


def _check_spec(field: str, value: str, names: Sequence[str], prefixes: Mapping[str, str]) -> str:
  """A corpus/tokenizer spec: one of `names`, or a key of `prefixes` ('text:' -> 'text:PATH', its
  spelled-out form) with something after it. Returns the text after the prefix ('' for a name)."""
  if value in names:
    return ""
  for prefix, shown in prefixes.items():
    if value.startswith(prefix):
      if not value[len(prefix):].strip():
        _fail(field, f"{value!r} needs something after {prefix!r}: {shown}")
      return value[len(prefix):]
  heads = list(names) + [p.rstrip(":") for p in prefixes]
  close = _closest(value.split(":")[0].strip(), heads, n=1)
  hint = ""
  if close:
    hint = f"did you mean {close[0]!r}? " if close[0] in names else f"did you mean '{close[0]}:...'? "
  _fail(field, f"unknown value {value!r}; {hint}expected {_either(list(names) + list(prefixes.values()))}")
  return ""


def _check_path(field: str, spec: str, path: str, what: str) -> None:
  p = pathlib.Path(path).expanduser()
  if not p.exists():
    _fail(field, f"{spec}: no such {what} ({p.resolve()})")


def validate_model(m: ModelConfig, prefix: str = "model") -> None:
  """Every model rule, on a ModelConfig. Raises ConfigError('<field>: <rule>')."""
  p = prefix + "."
  _check_sizes(m, p)
  _check_choices(m, p)
  _check_positions(m, p)
  _check_sparsity(m, p)
  _check_linear(m, p)
  _check_layout(m, p)
  _check_moe(m, p)


def _check_sizes(m: ModelConfig, p: str) -> None:
  """Sizes: positive, non-negative, and the head counts dividing each other."""
  if m.vocab_size == 0:
    _fail(p + "vocab_size", "is 0 (= the data tokenizer's vocabulary) and nothing resolved it: set it, or pass the "
          "whole config through tformer_jax.config.resolved(cfg)")
  for name in ("vocab_size", "d_model", "num_layers", "num_heads", "max_len"):
    if getattr(m, name) <= 0:
      _fail(p + name, f"must be a positive integer, got {getattr(m, name)}")
  for name in ("num_kv_heads", "head_dim", "d_ff", "window", "num_global_tokens", "type_vocab_size"):
    if getattr(m, name) < 0:
      _fail(p + name, f"must be >= 0, got {getattr(m, name)}")
  if not m.head_dim and m.d_model % m.num_heads:
    _fail(p + "d_model", f"d_model={m.d_model} must be divisible by num_heads={m.num_heads} "
          "(or set head_dim explicitly)")
  if m.num_heads % m.kv_heads:
    _fail(p + "num_kv_heads", f"num_heads={m.num_heads} must be divisible by num_kv_heads={m.kv_heads}")
  if m.mlp_ratio <= 0:
    _fail(p + "mlp_ratio", f"must be > 0, got {m.mlp_ratio}")


def _check_choices(m: ModelConfig, p: str) -> None:
  """Enum fields, eps, dropout rates and init scales."""
  choices = dict(attention=ATTENTIONS, activation=ACTIVATIONS, norm=NORMS, norm_position=NORM_POSITIONS,
                 position=POSITIONS, rope_layout=ROPE_LAYOUTS, remat=REMAT_POLICIES, dtype=DTYPES, param_dtype=DTYPES)
  for name, allowed in choices.items():
    _check_choice(p + name, getattr(m, name), allowed)
  if m.norm_eps <= 0:
    _fail(p + "norm_eps", f"must be > 0, got {m.norm_eps}")
  for name in ("embed_dropout", "attn_dropout", "resid_dropout"):
    v = getattr(m, name)
    if not 0.0 <= v < 1.0:
      _fail(p + name, f"dropout must be in [0, 1), got {v}")
  if m.init_std <= 0:
    _fail(p + "init_std", f"must be > 0, got {m.init_std}")
  if m.attention_scale < 0:
    _fail(p + "attention_scale", f"must be >= 0 (0 = 1/sqrt(head_dim)), got {m.attention_scale}")


def _check_positions(m: ModelConfig, p: str) -> None:
  """RoPE, sinusoidal and T5 position settings (and the RoPE scaling rule)."""
  if m.position == "rope":
    if not 0.0 < m.rotary_fraction <= 1.0:
      _fail(p + "rotary_fraction", f"must be in (0, 1], got {m.rotary_fraction}")
    rot = m.hd * m.rotary_fraction
    if rot != int(rot) or int(rot) % 2:
      _fail(p + "rotary_fraction", f"rotary dims head_dim*rotary_fraction={rot} must be an even integer")
    if m.rope_theta <= 0:
      _fail(p + "rope_theta", f"must be > 0, got {m.rope_theta}")
  if m.position == "sinusoidal" and m.d_model % 2:
    _fail(p + "d_model", f"sinusoidal positions need an even d_model, got {m.d_model}")
  _check_rope_scaling(m, p)
  if m.position == "t5":
    if m.t5_num_buckets <= 0 or m.t5_max_distance <= 0:
      _fail(p + "t5_num_buckets", "t5_num_buckets and t5_max_distance must be positive")
    exact = (m.t5_num_buckets // (1 if m.causal else 2)) // 2    # ops/relative_bias.py: exact buckets
    if exact < 1:
      _fail(p + "t5_num_buckets", f"must be >= {2 if m.causal else 4} (causal={m.causal}), got {m.t5_num_buckets}")
    if m.t5_max_distance <= exact:
      _fail(p + "t5_max_distance", f"must exceed the {exact} exact buckets (log-spaced buckets reach it), "
            f"got {m.t5_max_distance}")


def _check_rope_scaling(m: ModelConfig, p: str) -> None:
  """model.rope_scaling: its type, factor and per-type parameters."""
  rs = m.rope_scaling
  _check_choice(p + "rope_scaling.type", rs.type, ROPE_SCALINGS)
  if rs.original_max_len < 0:
    _fail(p + "rope_scaling.original_max_len", f"must be >= 0 (0 = model.max_len), got {rs.original_max_len}")
  if rs.type != "none":
    if m.position != "rope":
      _fail(p + "rope_scaling.type", f"{rs.type!r} needs position='rope', got {m.position!r}")
    if rs.factor < 1.0:
      _fail(p + "rope_scaling.factor", f"must be >= 1, got {rs.factor}")
  if rs.type == "llama3" and not 0 < rs.low_freq_factor < rs.high_freq_factor:
    _fail(p + "rope_scaling.high_freq_factor", f"llama3 needs 0 < low_freq_factor < high_freq_factor, got "
          f"low_freq_factor={rs.low_freq_factor}, high_freq_factor={rs.high_freq_factor}")
  if rs.type == "yarn":
    if not 0 < rs.beta_slow < rs.beta_fast:
      _fail(p + "rope_scaling.beta_fast", f"yarn needs 0 < beta_slow < beta_fast, got beta_slow={rs.beta_slow}, "
            f"beta_fast={rs.beta_fast}")
    if rs.attention_factor < 0:
      _fail(p + "rope_scaling.attention_factor", f"must be >= 0 (0 = 0.1 ln(factor) + 1), got "
            f"{rs.attention_factor}")


def _check_sparsity(m: ModelConfig, p: str) -> None:
  """The sliding window, global tokens and BigBird random blocks."""
  if m.window > m.max_len:
    _fail(p + "window", f"window={m.window} > max_len={m.max_len} is the same as no window (every query "
          f"already sees all its keys); use window=0 for full attention, or a window <= {m.max_len}")
  if m.num_global_tokens and not m.window:
    _fail(p + "num_global_tokens", "global tokens only matter with a window > 0")
  if m.num_global_tokens >= m.max_len:
    _fail(p + "num_global_tokens", f"must be < max_len={m.max_len}, got {m.num_global_tokens}")
  if m.random_blocks < 0 or m.random_block_size < 1 or m.random_block_seed < 0:
    _fail(p + "random_blocks", f"random_blocks >= 0, random_block_size >= 1 and random_block_seed >= 0, got "
          f"{m.random_blocks}, {m.random_block_size}, {m.random_block_seed}")
  if m.random_blocks and not m.window:
    _fail(p + "random_blocks", "random blocks widen a sliding window (BigBird = window + global + random); "
          "set model.window > 0 (without one every key is already visible)")
  n_blocks = -(-m.max_len // m.random_block_size)
  if m.random_blocks >= n_blocks:
    _fail(p + "random_blocks", f"{m.random_blocks} random blocks of {m.random_block_size} cover all {n_blocks} "
          f"blocks of max_len={m.max_len}: use fewer (or window=0 for full attention)")


def _check_linear(m: ModelConfig, p: str) -> None:
  """What linear attention has no use for (sparsity, logit biases, softmax scale/dropout)."""
  if m.attention == "linear":
    sparse = [f"{k}={getattr(m, k)}" for k in ("window", "num_global_tokens", "random_blocks") if getattr(m, k)]
    if sparse:
      _fail(p + "attention", f"'linear' sums over all (earlier) keys: it has no {', '.join(sparse)}")
    if m.position in ("alibi", "t5"):
      _fail(p + "attention", f"'linear' has no attention logits to bias: position={m.position!r} needs "
            "'softmax' (use rope, learned or sinusoidal positions)")
    for name in ("attn_dropout", "attention_scale"):
      if getattr(m, name):
        _fail(p + name, "'linear' attention has no softmax weights to scale or drop; set it to 0")


def _check_layout(m: ModelConfig, p: str) -> None:
  """The mask token id and the residual layout."""
  if not -1 <= m.mask_token_id < m.vocab_size:
    _fail(p + "mask_token_id", f"must be -1 (= vocab_size - 1) or an id in [0, {m.vocab_size}), got {m.mask_token_id}")
  if m.norm_position == "post" and m.parallel_residual:
    _fail(p + "parallel_residual", "parallel residual is a Pre-LN layout; set norm_position='pre'")


def _check_moe(m: ModelConfig, p: str) -> None:
  """The mixture-of-experts sub-config."""
  moe = m.moe
  for name in ("num_experts", "d_ff"):
    if getattr(moe, name) < 0:
      _fail(p + "moe." + name, f"must be >= 0, got {getattr(moe, name)}")
  if moe.num_experts and not 1 <= moe.top_k <= moe.num_experts:
    _fail(p + "moe.top_k", f"must be in [1, num_experts={moe.num_experts}], got {moe.top_k}")
  if moe.every < 1:
    _fail(p + "moe.every", f"must be >= 1, got {moe.every}")
  _check_choice(p + "moe.dispatch", moe.dispatch, MOE_DISPATCH)
  if moe.ep_buffer_factor < 0:
    _fail(p + "moe.ep_buffer_factor", f"must be >= 0 (0 = the worst case, never drops), got {moe.ep_buffer_factor}")
  if moe.capacity_factor <= 0:
    _fail(p + "moe.capacity_factor", f"must be > 0, got {moe.capacity_factor}")
  if not 0.0 <= moe.jitter < 1.0:
    _fail(p + "moe.jitter", f"must be in [0, 1) (router inputs times U(1 - jitter, 1 + jitter)), got {moe.jitter}")
  for name in ("aux_loss_coef", "z_loss_coef"):
    if getattr(moe, name) < 0:
      _fail(p + "moe." + name, f"loss coefficients must be >= 0, got {getattr(moe, name)}")
  if moe.num_experts and m.scan_layers and moe.every != 1:
    _fail(p + "moe.every", "scan_layers needs identical layers: use moe.every=1 or scan_layers=False")


def parse_mixture(mixture: str | Sequence[Any]) -> list[tuple[str, float]]:
  """data.mixture 'SPEC=W,SPEC=W' (or a list of 'SPEC=W' / (SPEC, W)) -> [(spec, weight)], the weights
  normalised to sum 1: the one reader of the syntax (validate and the data pipeline). ConfigError naming an
  item that is not SPEC=WEIGHT, a weight that is not a positive number, or a synthetic task."""
  items = mixture.split(",") if isinstance(mixture, str) else list(mixture)
  out = []
  for item in items:
    if isinstance(item, (tuple, list)) and len(item) == 2:
      spec, weight = str(item[0]).strip(), item[1]
    else:
      spec, sep, weight = str(item).strip().rpartition("=")
      spec = spec.strip()
      if not sep or not spec:
        _fail("data.mixture", f"{str(item).strip()!r} is not SPEC=WEIGHT "
              "(e.g. 'prepared:/data/a=0.7,prepared:/data/b=0.3')")
    try:
      w = float(weight)
    except (TypeError, ValueError):
      w = math.nan
    if not (math.isfinite(w) and w > 0):
      _fail("data.mixture", f"weight {weight!r} of {spec!r} must be a positive number")
    if spec.startswith("synthetic:"):
      _fail("data.mixture", f"{spec!r}: synthetic tasks cannot be mixed with text")
    out.append((spec, w))
  if not out:
    _fail("data.mixture", "is empty; give 'SPEC=WEIGHT,SPEC=WEIGHT'")
  total = sum(w for _, w in out)
  return [(s, w / total) for s, w in out]


def tokenizer_vocab_size(data: Any) -> int | None:
  """The vocabulary of data.tokenizer (of data.corpus when it is a prepared dataset, of the first
  dataset of a mixture), read from the tokenizer's files without loading any text; None when it
  cannot be known here (a synthetic task's, a file that does not exist yet)."""
  corpus = str(data.get("corpus", "") or "")
  mixture = str(data.get("mixture", "") or "").strip()
  if mixture:
    try:
      corpus = parse_mixture(mixture)[0][0]
    except ConfigError:
      return None    # validate() names it
  if corpus.startswith("synthetic:"):
    return None
  try:
    if corpus.startswith("prepared:"):
      manifest = json.loads((pathlib.Path(corpus[len("prepared:"):]).expanduser() / "manifest.json").read_text())
      return int(manifest["tokenizer"]["vocab_size"])
    spec = str(data.get("tokenizer", "byte")).strip()
    if spec == "byte":
      return 256
    if spec == "bpe":
      return int(data.get("bpe_vocab_size", 2048))
    if spec.startswith("hf:"):
      path = pathlib.Path(spec[3:]).expanduser()
      path = path / "tokenizer.json" if path.is_dir() else path
      tok = json.loads(path.read_text(encoding="utf-8"))
      vocab = tok.get("model", {}).get("vocab", {})
      ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
      ids += [int(t["id"]) for t in tok.get("added_tokens", [])]
      return max(ids) + 1 if ids else None
    if spec.startswith("spm:"):
      import sentencepiece  # noqa: PLC0415 (only for an spm: tokenizer)
      return int(sentencepiece.SentencePieceProcessor(model_file=str(pathlib.Path(spec[4:]).expanduser()))
                 .get_piece_size())
  except (OSError, ValueError, KeyError, TypeError, RuntimeError):
    return None      # validate() and the data pipeline name the missing or broken file
  return None


def resolved(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """cfg with model.vocab_size = 0 replaced by the data tokenizer's vocabulary (a copy; cfg itself if
  there is nothing to resolve). A vocab_size set by hand stays: smaller than the tokenizer's is an
  error where the data is loaded; larger (padding to a multiple of 64, say) is allowed."""
  if "model" not in cfg or cfg.model.get("vocab_size", 0) != 0 or "data" not in cfg:
    return cfg
  n = tokenizer_vocab_size(cfg.data)
  if n is None:
    return cfg
  out = cfg.copy_and_resolve_references()
  with out.unlocked():
    out.model.vocab_size = n
  return out


def validate(cfg: ml_collections.ConfigDict, *, check_paths: bool = True) -> ModelConfig:
  """Check a whole experiment config; returns the ModelConfig. Raises ConfigError('<field>: <rule>').

  Every section present is checked: unknown fields (with the closest names), types, ranges, choices,
  and the rules between fields. With `check_paths`, the files a run reads must exist (data.corpus
  text:PATH, data.tokenizer spm:/hf:PATH, train.init_from). Nothing is compiled or written."""
  check_fields(cfg)
  cfg = resolved(cfg)
  try:
    m = ModelConfig.from_config(cfg.model)
  except TypeError as e:
    raise ConfigError(f"model: {e}") from None
  if m.vocab_size == 0:     # a synthetic task's vocabulary: the training loop takes it from the dataset
    validate_model(dataclasses.replace(m, vocab_size=1))
  else:
    validate_model(m)
  train = cfg.get("train")
  if "data" in cfg:
    _validate_data(cfg.data, m, check_paths)
  if "optim" in cfg:
    _validate_optim(cfg.optim, cfg.get("data"), train)
  if train is not None:
    _validate_train(train, check_paths)
  if "mesh" in cfg:
    _validate_mesh(cfg.mesh)
  if "decode" in cfg:
    _validate_decode(cfg.decode)
  if train is not None and "lora" in train:
    _validate_lora(train, cfg.get("mesh"), check_paths)
  if "runtime" in cfg:
    precision = train.get("precision", "float32") if train is not None else "float32"
    validate_runtime(cfg.runtime, m, precision)
  return m


def _validate_data(d: Any, m: ModelConfig, check_paths: bool) -> None:
  for name in ("seq_len", "batch_size", "bpe_vocab_size"):
    if d.get(name, 1) <= 0:
      _fail("data." + name, f"must be a positive integer, got {d[name]}")
  if d.seq_len > m.max_len:
    why = ("it sizes the learned position table" if m.position == "learned" else
           f"it sizes the KV cache and any rope scaling; {m.position!r} positions may extrapolate beyond "
           "it when evaluating, not in training")
    _fail("data.seq_len", f"seq_len={d.seq_len} exceeds model.max_len={m.max_len}: training windows must fit "
          f"max_len ({why}); set --config.model.max_len={d.seq_len} or --config.data.seq_len={m.max_len}")
  if not 0.0 < d.val_fraction < 0.5:
    _fail("data.val_fraction", f"must be in (0, 0.5), got {d.val_fraction}")
  _check_choice("data.sampling", d.sampling, SAMPLINGS)
  _check_choice("data.packing", d.get("packing", "packed"), PACKINGS)
  for name in ("worker_count", "seed"):
    if d.get(name, 0) < 0:
      _fail("data." + name, f"must be >= 0, got {d[name]}")
  corpus = str(d.get("corpus", "shakespeare"))
  mixture = str(d.get("mixture", "") or "").strip()
  if not mixture:
    _check_corpus("data.corpus", corpus, check_paths)
  else:
    if corpus.startswith("synthetic:"):
      _fail("data.mixture", f"mixes text corpora; data.corpus={corpus!r} is a synthetic task (set one or the other)")
    for spec, _ in parse_mixture(mixture):
      _check_corpus("data.mixture", spec, check_paths)
  val_corpus = str(d.get("val_corpus", "") or "").strip()
  if val_corpus:
    if val_corpus.startswith("synthetic:") or (corpus.startswith("synthetic:") and not mixture):
      _fail("data.val_corpus", "synthetic tasks have their own evaluation stream; val_corpus is for text corpora")
    _check_corpus("data.val_corpus", val_corpus, check_paths)
  tok = str(d.get("tokenizer", "byte")).strip()
  path = _check_spec("data.tokenizer", tok, TOKENIZERS,
                     dict(zip(TOKENIZER_PREFIXES, ("spm:PATH/model.model", "hf:PATH/tokenizer.json"))))
  if check_paths and path and not corpus.startswith("synthetic:"):  # synthetic tasks bring their vocabulary
    _check_path("data.tokenizer", tok, path, "file" if tok.startswith("spm:") else "file or directory")


def _check_corpus(field: str, corpus: str, check_paths: bool) -> None:
  path = _check_spec(field, corpus, CORPORA, dict(zip(CORPUS_PREFIXES, CORPUS_SHOWN)))
  if check_paths and corpus.startswith("text:"):
    _check_path(field, corpus, path, "file or directory")
  if check_paths and corpus.startswith("prepared:"):
    p = pathlib.Path(path.strip()).expanduser()
    if not p.is_dir():
      _fail(field, f"{corpus}: no such directory ({p.resolve()}); make one with tformer-prepare")
    if not (p / "manifest.json").is_file():
      _fail(field, f"{corpus}: {p / 'manifest.json'} is missing: not a complete prepared dataset (an interrupted "
            "tformer-prepare resumes when rerun)")


def _warmup(o: Any, steps: int) -> tuple[str, int]:
  """(the field that sets it, the warmup length): as `train.optim.warmup_steps` computes it."""
  frac = float(o.get("warmup_fraction", 0.0))
  if frac > 0:
    return "optim.warmup_fraction", int(round(frac * steps))
  return "optim.warmup_steps", int(o.warmup_steps)


def warmup_note(o: Any, steps: int) -> str | None:
  """The one-line warning of a run whose optim.warmup_steps is not shorter than train.steps (a short
  smoke run under a long run's warmup): it then warms up over a tenth of the steps
  (`train.optim.warmup_steps`). None otherwise; an explicit warmup_fraction is never clamped."""
  field, warm = _warmup(o, steps)
  if field != "optim.warmup_steps" or warm < steps or warm == 0:
    return None
  return (f"optim.warmup_steps={warm} is not shorter than train.steps={steps}: warming up over {steps // 10} "
          f"steps (a tenth) instead; set optim.warmup_fraction (or a shorter optim.warmup_steps) to choose")


def _check_warmup(o: Any, t: Any) -> None:
  """optim.warmup_steps / warmup_fraction, and a fractional warmup shorter than the run."""
  if o.warmup_steps < 0:
    _fail("optim.warmup_steps", f"must be >= 0, got {o.warmup_steps}")
  if not 0.0 <= o.warmup_fraction < 1.0:
    _fail("optim.warmup_fraction", f"must be in [0, 1) (0 = use warmup_steps), got {o.warmup_fraction}")
  if t is not None and t.steps > 0:
    field, warm = _warmup(o, t.steps)
    if warm >= t.steps and warm > 0 and field == "optim.warmup_fraction":   # warmup_steps is clamped
      _fail(field, f"a warmup of {warm} steps is not shorter than train.steps={t.steps}: the learning rate "
            f"would never reach peak_lr; use a warmup < {t.steps} (or optim.warmup_steps=0)")


def _validate_optim(o: Any, d: Any, t: Any) -> None:
  if o.get("name", "adamw") not in OPTIMIZERS:
    _fail("optim.name", f"unknown value {o.name!r}; expected {_either([repr(n) for n in OPTIMIZERS])} "
          "(tformer_jax/train/optim.py)")
  if o.peak_lr <= 0:
    _fail("optim.peak_lr", f"must be > 0, got {o.peak_lr}")
  if o.get("eps", 1e-8) <= 0:
    _fail("optim.eps", f"must be > 0 (Adam divides by sqrt(v) + eps), got {o.eps}")
  _check_choice("optim.schedule", o.schedule, SCHEDULES)
  _check_warmup(o, t)
  if not 0.0 <= o.min_lr_ratio <= 1.0:
    _fail("optim.min_lr_ratio", f"must be in [0, 1], got {o.min_lr_ratio}")
  for name in ("b1", "b2"):
    if not 0.0 <= o[name] < 1.0:
      _fail("optim." + name, f"Adam betas must be in [0, 1), got {o[name]}")
  if not 0.0 <= o.get("momentum", 0.9) < 1.0:
    _fail("optim.momentum", f"must be in [0, 1) (sgd only; 0 = plain SGD), got {o.momentum}")
  for name in ("weight_decay", "clip_norm"):
    if o[name] < 0:
      _fail("optim." + name, f"must be >= 0 (0 = off), got {o[name]}")
  if o.grad_accum < 1:
    _fail("optim.grad_accum", f"must be >= 1, got {o.grad_accum}")
  if d is not None and d.batch_size % o.grad_accum:
    _fail("optim.grad_accum", f"data.batch_size={d.batch_size} must be divisible by grad_accum={o.grad_accum}")


def _validate_train(t: Any, check_paths: bool) -> None:
  if t.steps <= 0:
    _fail("train.steps", f"must be positive, got {t.steps}")
  _check_choice("train.precision", t.precision, PRECISIONS)
  for name in ("log_every", "eval_every", "ckpt_every", "max_to_keep", "eval_batches", "max_nonfinite"):
    if t[name] <= 0:
      _fail("train." + name, f"must be positive, got {t[name]}")
  for name in ("sample_tokens", "stats_every"):
    if t.get(name, 0) < 0:
      _fail("train." + name, f"must be >= 0 (0 = off), got {t[name]}")
  if t.get("loss_chunk", 0) < 0:
    _fail("train.loss_chunk", f"must be >= 0 (tokens of logits per chunk; 0 = the full logits), got {t.loss_chunk}")
  _check_loggers(t)
  _check_init_from(t, check_paths)


def _check_loggers(t: Any) -> None:
  """train.loggers (jsonl always among them, installed packages) and the eval tasks' harness."""
  loggers = parse_loggers(t.get("loggers", "jsonl,tensorboard"))
  for name in loggers:
    _check_choice("train.loggers", name, LOGGERS)
  if "jsonl" not in loggers:
    _fail("train.loggers", f"{','.join(loggers)!r} lacks jsonl: metrics.jsonl is the run's record (resume, "
          "tformer-eval and the plots read it)")
  if "wandb" in loggers and importlib.util.find_spec("wandb") is None:
    _fail("train.loggers", "'wandb' needs the wandb package (pip install wandb); it is not installed")
  if str(t.get("eval_tasks", "") or "").strip(",\t ") and importlib.util.find_spec("lm_eval") is None:
    _fail("train.eval_tasks", "needs lm-evaluation-harness (pip install 'tformer-jax[eval]'); it is not installed")
  if t.get("eval_tasks_limit", 0) < 0:
    _fail("train.eval_tasks_limit", f"must be >= 0 (0 = every document), got {t.eval_tasks_limit}")


def _check_init_from(t: Any, check_paths: bool) -> None:
  """train.init_from names an HF model directory (hf:DIR) or a training workdir, when paths are checked."""
  init_from = str(t.get("init_from", "") or "")
  if check_paths and init_from.startswith("hf:"):
    src = pathlib.Path(init_from[3:]).expanduser()
    if not (src / "config.json").is_file():
      _fail("train.init_from", f"{init_from}: not a Hugging Face model directory (no config.json in {src.resolve()})")
  elif check_paths and init_from and "://" not in init_from:      # gs://... is checked by Orbax
    src = pathlib.Path(init_from).expanduser()
    if not src.exists():
      _fail("train.init_from", f"{init_from}: no such directory or file ({src.resolve()}); it must name a "
            "training workdir (config.json + checkpoints/), e.g. one written by scripts/convert.py --from-hf")
    if src.is_dir() and not (src / "config.json").is_file():
      _fail("train.init_from", f"{init_from}: not a training workdir (no config.json in {src.resolve()})")


def _validate_lora(t: Any, mesh: Any, check_paths: bool = True) -> None:
  """train.lora: rank >= 0 (0 = off), alpha > 0, known targets; a run (check_paths: one that reads its
  files, not a preset waiting for --config.train.init_from) needs its base, train.init_from."""
  lo = t.lora
  if not isinstance(lo.rank, int) or lo.rank < 0:
    _fail("train.lora.rank", f"must be an integer >= 0 (0 = off), got {lo.rank!r}")
  if not lo.alpha > 0:
    _fail("train.lora.alpha", f"must be > 0, got {lo.alpha}")
  targets = [s.strip() for s in str(lo.targets).split(",") if s.strip()]
  for name in targets:
    _check_choice("train.lora.targets", name, LORA_TARGETS)
  if lo.rank == 0:
    return
  if not targets:
    _fail("train.lora.targets", "is empty: name at least one projection (e.g. 'q,v')")
  if check_paths and not str(t.get("init_from", "") or ""):
    _fail("train.lora.rank", "LoRA trains adapters on a frozen base: set train.init_from (hf:DIR or a workdir)")
  if mesh is not None and mesh.get("parallelism", "jit") == "pmap":
    _fail("train.lora.rank", "LoRA runs under mesh.parallelism='jit' only")
  if t.get("stats_every", 0) > 0:
    _fail("train.stats_every", "layer statistics are not computed for a LoRA run (train.lora.rank > 0); set 0")


def parse_loggers(value: Any) -> list[str]:
  """train.loggers ('jsonl,tensorboard' or a sequence) as a list of names."""
  items = value.split(",") if isinstance(value, str) else list(value)
  return [str(x).strip() for x in items if str(x).strip()]


def _validate_mesh(mh: Any) -> None:
  shape, axes = tuple(mh.shape), tuple(mh.axes)
  if len(shape) != len(axes):
    _fail("mesh.shape", f"{shape} has {len(shape)} entries for axes {axes}")
  if not all(isinstance(s, numbers.Integral) for s in shape):
    _fail("mesh.shape", f"sizes must be integers, got {shape}")
  if sum(1 for s in shape if s == -1) > 1:
    _fail("mesh.shape", f"at most one -1 allowed, got {shape}")
  if any(s == 0 or s < -1 for s in shape):
    _fail("mesh.shape", f"sizes must be positive or -1, got {shape}")
  if not all(isinstance(a, str) and a for a in axes):
    _fail("mesh.axes", f"axis names must be non-empty strings, got {axes}")
  dups = sorted({a for a in axes if axes.count(a) > 1})
  if dups:
    _fail("mesh.axes", f"axis names must be unique, got {axes} ({', '.join(map(repr, dups))} repeated)")
  rules = mh.get("rules", "dp")
  if isinstance(rules, str):
    _check_choice("mesh.rules", rules, RULE_PRESETS)
  elif not all(isinstance(r, (tuple, list)) and len(r) == 2 and isinstance(r[0], str) for r in rules):
    _fail("mesh.rules", f"a preset name {RULE_PRESETS} or (logical_axis, mesh_axis) pairs, got {rules!r}")
  _check_choice("mesh.parallelism", mh.parallelism, PARALLELISMS)
  _check_choice("mesh.context_strategy", mh.get("context_strategy", "all_gather"), CONTEXT_STRATEGIES)
  if mh.get("num_devices", 0) < 0:
    _fail("mesh.num_devices", f"must be >= 0 (0 = all devices), got {mh.num_devices}")


def _validate_decode(dc: Any) -> None:
  if dc.temperature < 0:
    _fail("decode.temperature", f"must be >= 0 (0 = greedy), got {dc.temperature}")
  if dc.top_k < 0:
    _fail("decode.top_k", f"must be >= 0 (0 = off), got {dc.top_k}")
  if not 0.0 < dc.top_p <= 1.0:
    _fail("decode.top_p", f"must be in (0, 1] (1 = off), got {dc.top_p}")
  if dc.repetition_penalty <= 0:
    _fail("decode.repetition_penalty", f"must be > 0 (1 = off), got {dc.repetition_penalty}")
  if dc.get("cache_dtype", "") not in ("", "float32", "bfloat16", "int8"):
    _fail("decode.cache_dtype", f"'' (the model dtype) | float32 | bfloat16 | int8, got {dc.cache_dtype!r}")


def attention_features(m: ModelConfig) -> frozenset[str]:
  """The model's features that not every attention implementation has (keys of `_LACKS_RULE`)."""
  return frozenset(name for name, on in (
      ("dropout", m.attn_dropout > 0), ("dense_bias", m.position == "t5"),
      ("global_tokens", m.num_global_tokens > 0), ("random_blocks", m.random_blocks > 0),
      ("alibi", m.position == "alibi")) if on)


# The rule broken when an implementation lacks a feature ({impl}: it, {servers}: those that have it).
_LACKS_RULE = {
    "dropout": "model.attn_dropout > 0 is implemented by the {servers} attention only, got {impl!r}",
    "dense_bias": "{impl!r} takes no dense bias; T5 relative bias needs {servers}",
    "global_tokens": "{impl!r} has no global tokens; model.num_global_tokens needs {servers}",
    "random_blocks": "{impl!r} has no random blocks; model.random_blocks needs {servers}",
    "alibi": "{impl!r} takes no ALiBi bias; position='alibi' needs {servers}",
}


def attention_unsupported(impl: str, features: Iterable[str]) -> str | None:
  """Why attention implementation `impl` cannot serve a model (or call) with these features, as the
  rule it breaks; None when it can."""
  for feature in _LACKS_RULE:   # one order, so the message is stable
    if feature in features and feature in ATTENTION_LACKS[impl]:
      servers = [repr(i) for i, lacks in ATTENTION_LACKS.items() if feature not in lacks]
      return _LACKS_RULE[feature].format(impl=impl, servers=_either(servers))
  return None


def supports(impl: str, m: ModelConfig) -> None:
  """Raises ConfigError('runtime.attention: ...') when attention implementation `impl` cannot serve
  model `m` (its dropout, T5 bias, global tokens, random blocks or ALiBi)."""
  why = attention_unsupported(impl, attention_features(m))
  if why:
    _fail("runtime.attention", why)


def validate_runtime(r: Any, m: ModelConfig, precision: str = "float32") -> None:
  """The runtime section against the model; the platform-dependent rules (cudnn needs a GPU, ...)
  are `backends.resolve_runtime`'s."""
  for name, allowed in dict(moe_exchange=RUNTIME_MOE_EXCHANGE, moe_gmm=RUNTIME_MOE_GMM,
                            decode_layout=DECODE_LAYOUTS).items():
    if name in r:
      _check_choice("runtime." + name, r[name], allowed)
  for name, allowed in dict(backend=RUNTIME_BACKENDS, attention=RUNTIME_ATTENTION,
                            cpu_kernels=AUTO_ON_OFF).items():
    _check_choice("runtime." + name, r[name], allowed)
  for name in ("attention_block_q", "attention_block_k"):
    if r[name] <= 0:
      _fail("runtime." + name, f"must be a positive integer, got {r[name]}")
  if r.attention != "auto":
    supports(r.attention, m)
  for name in ("splash_block_q", "splash_block_kv"):
    if r.get(name, 512) <= 0 or r.get(name, 512) % 128:
      _fail("runtime." + name, f"must be a positive multiple of 128 (the TPU lane width), got {r[name]}")
  if r.cpu_kernels == "on":
    if r.backend == "reference":
      _fail("runtime.cpu_kernels", "'on' needs runtime.backend 'xla_cpu' (or 'auto' on CPU)")
    half = [f"{k}={v!r}" for k, v in (("model.dtype", m.dtype), ("model.param_dtype", m.param_dtype))
            if v != "float32"] + ([f"train.precision={precision!r}"] if precision != "float32" else [])
    if half:
      _fail("runtime.cpu_kernels", f"'on': the C++ kernels are float32 only, got {', '.join(half)}; "
            "use 'auto' or 'off'")
