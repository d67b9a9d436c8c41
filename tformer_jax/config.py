"""The config schema: ml_collections ConfigDicts for experiments, frozen dataclasses for the model.

`default_config()` is the full schema with defaults; experiment files in `configs/` start from it and
override fields. `validate(cfg)` checks every rule before anything compiles and raises `ConfigError`
naming the field. `ModelConfig.from_config(cfg.model)` is what the linen modules receive.

Two kinds of settings: `model` is the architecture (the function the network computes: what
checkpoints and HF export care about); `runtime` is how this run executes it (backend, attention
implementation and tiles, C++ CPU kernels), resolved once per run by `backends.resolve_runtime`.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import pathlib
from typing import Any

import ml_collections

ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu", "swiglu", "geglu")
GLU_ACTIVATIONS = ("swiglu", "geglu")
NORMS = ("layernorm", "rmsnorm")
NORM_POSITIONS = ("pre", "post")
POSITIONS = ("none", "sinusoidal", "learned", "rope", "alibi", "t5")
ROPE_LAYOUTS = ("half", "interleaved")
ROPE_SCALINGS = ("none", "linear", "ntk", "dynamic", "yarn", "llama3")
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")
DTYPES = ("float32", "bfloat16", "float16")
MOE_DISPATCH = ("dropless", "capacity")
RUNTIME_BACKENDS = ("auto", "reference", "xla_cpu")
RUNTIME_ATTENTION = ("auto", "reference", "chunked", "blockwise", "xla", "cudnn")
TILED_ATTENTION = ("chunked", "blockwise")   # no dense bias, no global tokens, no dropout
AUTO_ON_OFF = ("auto", "on", "off")

# ModelConfig fields that change neither the function the model computes at inference nor what its
# parameters mean: training-time regularisation and initialisation, dtypes, how layers are traced
# (scan/remat), and mlp_ratio (a default for d_ff, compared resolved). The architecture signature
# (HF export, `interop.hf`) leaves them out.
NON_ARCHITECTURE_FIELDS = ("embed_dropout", "attn_dropout", "resid_dropout", "init_std",
                           "scale_residual_init", "dtype", "param_dtype", "scan_layers", "remat",
                           "mlp_ratio")
# Execution fields that older versions kept in `model` (still found in saved config.json files);
# now in the runtime section, and dropped when such a file is read.
LEGACY_RUNTIME_FIELDS = ("attention_impl", "attention_block_q", "attention_block_k",
                         "residual_grad_barrier", "weight_grad_impl")


class ConfigError(ValueError):
  """An invalid configuration; the message names the field and the rule it breaks."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  type: str = "none"                 # none | linear | ntk | dynamic | yarn | llama3
  factor: float = 1.0
  original_max_len: int = 0          # pre-extension context (yarn, llama3, dynamic); 0 = model max_len
  low_freq_factor: float = 1.0       # llama3
  high_freq_factor: float = 4.0      # llama3
  beta_fast: float = 32.0            # yarn
  beta_slow: float = 1.0             # yarn
  attention_factor: float = 0.0      # yarn; 0 = 0.1 * ln(factor) + 1


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  num_experts: int = 0               # 0 = dense FFN everywhere
  top_k: int = 2
  every: int = 1                     # MoE FFN in layers where (i + 1) % every == 0
  d_ff: int = 0                      # expert hidden size; 0 = the model's d_ff
  dispatch: str = "dropless"         # dropless (sort + ragged_dot) | capacity (einsum, drops tokens)
  capacity_factor: float = 1.25
  renormalize: bool = True           # renormalise the top-k probabilities to sum to 1
  jitter: float = 0.0                # multiplicative router-input noise while training
  aux_loss_coef: float = 0.01        # Switch/GShard load balancing
  z_loss_coef: float = 0.001         # router z-loss
  shared_expert: bool = False


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  vocab_size: int = 256
  d_model: int = 256
  num_layers: int = 4
  num_heads: int = 4
  num_kv_heads: int = 0              # 0 = num_heads (MHA); 1 = MQA; in between = GQA
  head_dim: int = 0                  # 0 = d_model // num_heads
  d_ff: int = 0                      # 0 = mlp_ratio * d_model (x 2/3 for GLU, rounded up to 8)
  mlp_ratio: float = 4.0
  activation: str = "gelu"
  norm: str = "layernorm"
  norm_eps: float = 1e-5
  norm_position: str = "pre"         # pre | post (original Transformer, BERT)
  final_norm: bool = True            # a norm before the head (Pre-LN models)
  parallel_residual: bool = False    # GPT-J/NeoX: x + attn(ln1 x) + mlp(ln2 x)
  embed_norm: bool = False           # Bloom/BERT: a norm right after the embeddings
  embed_scale: bool = False          # multiply token embeddings by sqrt(d_model) (original Transformer;
                                     # pairs with sinusoidal positions, whose amplitude is 1)
  position: str = "learned"
  max_len: int = 256
  rope_theta: float = 10000.0
  rotary_fraction: float = 1.0
  rope_layout: str = "half"
  rope_scaling: RopeScaling = RopeScaling()
  t5_num_buckets: int = 32
  t5_max_distance: int = 128
  causal: bool = True                # False = bidirectional encoder
  type_vocab_size: int = 0           # BERT token types; 0 = none
  tie_embeddings: bool = True
  lm_head: bool = True               # False: apply() returns final hidden states (B, L, d_model)
  qkv_bias: bool = False
  out_bias: bool = False
  mlp_bias: bool = False
  norm_bias: bool = True             # LayerNorm bias (RMSNorm has none)
  embed_dropout: float = 0.0
  attn_dropout: float = 0.0
  resid_dropout: float = 0.0
  init_std: float = 0.02
  scale_residual_init: bool = True   # GPT-2: residual output projections std / sqrt(2 * num_layers)
  attention_scale: float = 0.0       # 0 = 1/sqrt(head_dim)
  window: int = 0                    # sliding window (each query sees the last `window` keys); 0 = full
  num_global_tokens: int = 0         # Longformer-style global tokens (dense attention paths)
  dtype: str = "float32"             # compute dtype
  param_dtype: str = "float32"
  scan_layers: bool = False          # one scanned block (params stacked on a 'layers' axis)
  remat: str = "none"                # none | full | dots | dots_no_batch: recompute in the backward
  moe: MoEConfig = MoEConfig()

  @classmethod
  def from_config(cls, cd: Any) -> "ModelConfig":
    d = dict(cd.to_dict() if hasattr(cd, "to_dict") else cd)
    for name in LEGACY_RUNTIME_FIELDS:
      d.pop(name, None)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
      raise ConfigError(f"model: unknown field(s) {unknown}")
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


def _to_configdict(dc: Any) -> ml_collections.ConfigDict:
  out = {}
  for f in dataclasses.fields(dc):
    v = getattr(dc, f.name)
    out[f.name] = _to_configdict(v) if dataclasses.is_dataclass(v) else v
  return ml_collections.ConfigDict(out)


def default_config() -> ml_collections.ConfigDict:
  """The whole schema with defaults. Experiment files override fields of this."""
  c = ml_collections.ConfigDict()
  c.model = _to_configdict(ModelConfig())

  c.data = ml_collections.ConfigDict(dict(
      corpus="shakespeare",          # shakespeare | kjv | text:PATH | synthetic:TASK
      tokenizer="byte",              # byte | bpe (sentencepiece, trained and cached) | hf:PATH/tokenizer.json
      bpe_vocab_size=2048,
      seq_len=256,
      batch_size=32,                 # global batch (sequences per optimizer step, across all devices)
      val_fraction=0.05,
      sampling="random",             # random windows | packed (consecutive, epoch-shuffled)
      cache_dir="",                  # '' = $TFORMER_CACHE or ~/.cache/tformer_jax
      worker_count=0,
      seed=0,
  ))
  c.optim = ml_collections.ConfigDict(dict(
      name="adamw",
      peak_lr=1e-3,
      b1=0.9,
      b2=0.95,
      eps=1e-8,
      weight_decay=0.1,
      schedule="cosine",             # cosine | rsqrt | constant (all after linear warmup)
      warmup_steps=100,
      warmup_fraction=0.0,           # > 0 overrides warmup_steps with this fraction of train.steps
      min_lr_ratio=0.1,              # cosine floor as a fraction of peak_lr
      clip_norm=1.0,                 # 0 = no clipping
      grad_accum=1,                  # micro-batches per step
  ))
  c.train = ml_collections.ConfigDict(dict(
      steps=1000,
      seed=0,
      precision="float32",           # float32 | bf16 (bf16 compute, f32 params) | fp16 (+ dynamic loss scale)
      log_every=50,
      eval_every=250,
      eval_batches=8,
      ckpt_every=500,
      max_to_keep=3,
      max_nonfinite=5,               # consecutive skipped (non-finite) steps that stop the run
      sample_tokens=200,
      sample_prompt="ROMEO:",
      stats_every=0,                 # 0 = off; training-time layer statistics
      init_from="",                  # an Orbax workdir or checkpoint to fine-tune from
  ))
  c.mesh = ml_collections.ConfigDict(dict(
      shape=(-1, 1, 1),              # sizes of `axes`; -1 = the rest of the devices
      axes=("data", "fsdp", "tensor"),
      rules="dp",                    # dp | fsdp | tp | fsdp_tp | a name in tformer_jax.parallel.rules
      parallelism="jit",             # jit (NamedSharding, what pjit became) | pmap (data parallel)
      num_devices=0,                 # 0 = all devices; N = the first N (single-process runs)
  ))
  c.decode = ml_collections.ConfigDict(dict(
      temperature=0.8, top_k=0, top_p=1.0, repetition_penalty=1.0,
  ))
  # How this run executes the model; never changes what it computes (tformer_jax/backends/).
  c.runtime = ml_collections.ConfigDict(dict(
      backend="auto",                # auto (xla_cpu on CPU, else reference) | reference | xla_cpu
      attention="auto",              # auto | reference | chunked | blockwise | xla | cudnn
      attention_block_q=128,         # blockwise query tile; chunked: the query chunk
      attention_block_k=128,         # blockwise key tile
      cpu_kernels="auto",            # auto | on | off: the xla_cpu backend's C++ kernels (float32)
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


def validate_model(m: ModelConfig, prefix: str = "model") -> None:
  """Every model rule, on a ModelConfig. Raises ConfigError('<field>: <rule>')."""
  p = prefix + "."
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
  choices = dict(activation=ACTIVATIONS, norm=NORMS, norm_position=NORM_POSITIONS, position=POSITIONS,
                 rope_layout=ROPE_LAYOUTS, remat=REMAT_POLICIES, dtype=DTYPES, param_dtype=DTYPES)
  for name, allowed in choices.items():
    if getattr(m, name) not in allowed:
      _fail(p + name, f"unknown value {getattr(m, name)!r}; expected one of {allowed}")
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
  rs = m.rope_scaling
  if rs.type not in ROPE_SCALINGS:
    _fail(p + "rope_scaling.type", f"unknown value {rs.type!r}; expected one of {ROPE_SCALINGS}")
  if rs.type != "none":
    if m.position != "rope":
      _fail(p + "rope_scaling.type", f"{rs.type!r} needs position='rope', got {m.position!r}")
    if rs.factor < 1.0:
      _fail(p + "rope_scaling.factor", f"must be >= 1, got {rs.factor}")
  if m.position == "t5" and (m.t5_num_buckets <= 0 or m.t5_max_distance <= 0):
    _fail(p + "t5_num_buckets", "t5_num_buckets and t5_max_distance must be positive")
  if m.num_global_tokens and not m.window:
    _fail(p + "num_global_tokens", "global tokens only matter with a window > 0")
  if m.norm_position == "post" and m.parallel_residual:
    _fail(p + "parallel_residual", "parallel residual is a Pre-LN layout; set norm_position='pre'")
  moe = m.moe
  if moe.num_experts < 0:
    _fail(p + "moe.num_experts", f"must be >= 0, got {moe.num_experts}")
  if moe.num_experts:
    if not 1 <= moe.top_k <= moe.num_experts:
      _fail(p + "moe.top_k", f"must be in [1, num_experts={moe.num_experts}], got {moe.top_k}")
    if moe.every < 1:
      _fail(p + "moe.every", f"must be >= 1, got {moe.every}")
    if moe.dispatch not in MOE_DISPATCH:
      _fail(p + "moe.dispatch", f"unknown value {moe.dispatch!r}; expected one of {MOE_DISPATCH}")
    if moe.capacity_factor <= 0:
      _fail(p + "moe.capacity_factor", f"must be > 0, got {moe.capacity_factor}")
    if moe.aux_loss_coef < 0 or moe.z_loss_coef < 0:
      _fail(p + "moe.aux_loss_coef", "loss coefficients must be >= 0")
    if m.scan_layers and moe.every != 1:
      _fail(p + "moe.every", "scan_layers needs identical layers: use moe.every=1 or scan_layers=False")


def validate(cfg: ml_collections.ConfigDict) -> ModelConfig:
  """Check a whole experiment config; returns the ModelConfig. Raises ConfigError naming the field."""
  try:
    m = ModelConfig.from_config(cfg.model)
  except TypeError as e:
    raise ConfigError(f"model: {e}") from None
  validate_model(m)
  if "data" in cfg:
    d = cfg.data
    for name in ("seq_len", "batch_size"):
      if d[name] <= 0:
        _fail("data." + name, f"must be a positive integer, got {d[name]}")
    if m.position == "learned" and d.seq_len > m.max_len:
      _fail("data.seq_len", f"seq_len={d.seq_len} exceeds model.max_len={m.max_len} (learned positions)")
    if not 0.0 < d.val_fraction < 0.5:
      _fail("data.val_fraction", f"must be in (0, 0.5), got {d.val_fraction}")
    if d.sampling not in ("random", "packed"):
      _fail("data.sampling", f"unknown value {d.sampling!r}; expected 'random' or 'packed'")
  if "optim" in cfg:
    o = cfg.optim
    if o.peak_lr <= 0:
      _fail("optim.peak_lr", f"must be > 0, got {o.peak_lr}")
    if o.schedule not in ("cosine", "rsqrt", "constant"):
      _fail("optim.schedule", f"unknown value {o.schedule!r}; expected cosine, rsqrt or constant")
    if o.warmup_steps < 0 or not 0.0 <= o.warmup_fraction < 1.0:
      _fail("optim.warmup_steps", "warmup_steps must be >= 0 and warmup_fraction in [0, 1)")
    if not 0.0 <= o.min_lr_ratio <= 1.0:
      _fail("optim.min_lr_ratio", f"must be in [0, 1], got {o.min_lr_ratio}")
    if not (0.0 <= o.b1 < 1.0 and 0.0 <= o.b2 < 1.0):
      _fail("optim.b1", f"Adam betas must be in [0, 1), got b1={o.b1}, b2={o.b2}")
    if o.weight_decay < 0 or o.clip_norm < 0:
      _fail("optim.weight_decay", "weight_decay and clip_norm must be >= 0")
    if o.grad_accum < 1:
      _fail("optim.grad_accum", f"must be >= 1, got {o.grad_accum}")
    if "data" in cfg and cfg.data.batch_size % o.grad_accum:
      _fail("optim.grad_accum", f"data.batch_size={cfg.data.batch_size} must be divisible by "
            f"grad_accum={o.grad_accum}")
  if "train" in cfg:
    t = cfg.train
    if t.steps <= 0:
      _fail("train.steps", f"must be positive, got {t.steps}")
    if t.precision not in ("float32", "bf16", "fp16"):
      _fail("train.precision", f"unknown value {t.precision!r}; expected float32, bf16 or fp16")
    for name in ("log_every", "eval_every", "ckpt_every", "max_to_keep", "eval_batches", "max_nonfinite"):
      if t[name] <= 0:
        _fail("train." + name, f"must be positive, got {t[name]}")
  if "mesh" in cfg:
    mh = cfg.mesh
    if len(mh.shape) != len(mh.axes):
      _fail("mesh.shape", f"{tuple(mh.shape)} has {len(mh.shape)} entries for axes {tuple(mh.axes)}")
    if sum(1 for s in mh.shape if s == -1) > 1:
      _fail("mesh.shape", f"at most one -1 allowed, got {tuple(mh.shape)}")
    if any(s == 0 or s < -1 for s in mh.shape):
      _fail("mesh.shape", f"sizes must be positive or -1, got {tuple(mh.shape)}")
    if mh.parallelism not in ("jit", "pmap"):
      _fail("mesh.parallelism", f"unknown value {mh.parallelism!r}; expected 'jit' or 'pmap'")
    if mh.get("num_devices", 0) < 0:
      _fail("mesh.num_devices", f"must be >= 0 (0 = all devices), got {mh.num_devices}")
  if "runtime" in cfg:
    precision = cfg.train.get("precision", "float32") if "train" in cfg else "float32"
    validate_runtime(cfg.runtime, m, precision)
  return m


def validate_runtime(r: Any, m: ModelConfig, precision: str = "float32") -> None:
  """The runtime section against the model; the platform-dependent rules (cudnn needs a GPU, ...)
  are `backends.resolve_runtime`'s."""
  for name, allowed in dict(backend=RUNTIME_BACKENDS, attention=RUNTIME_ATTENTION,
                            cpu_kernels=AUTO_ON_OFF).items():
    if r[name] not in allowed:
      _fail("runtime." + name, f"unknown value {r[name]!r}; expected one of {allowed}")
  for name in ("attention_block_q", "attention_block_k"):
    if r[name] <= 0:
      _fail("runtime." + name, f"must be a positive integer, got {r[name]}")
  a = r.attention
  if m.attn_dropout > 0 and a not in ("reference", "auto"):
    _fail("runtime.attention", f"model.attn_dropout > 0 is implemented by the 'reference' attention "
          f"only, got {a!r}")
  if m.position == "t5" and a in TILED_ATTENTION:
    _fail("runtime.attention", f"{a!r} takes no dense bias; T5 relative bias needs 'reference' or 'xla'")
  if m.num_global_tokens and a in TILED_ATTENTION:
    _fail("runtime.attention", f"{a!r} has no global tokens; model.num_global_tokens needs 'reference'")
  if r.cpu_kernels == "on":
    if r.backend == "reference":
      _fail("runtime.cpu_kernels", "'on' needs runtime.backend 'xla_cpu' (or 'auto' on CPU)")
    half = [f"{k}={v!r}" for k, v in (("model.dtype", m.dtype), ("model.param_dtype", m.param_dtype))
            if v != "float32"] + ([f"train.precision={precision!r}"] if precision != "float32" else [])
    if half:
      _fail("runtime.cpu_kernels", f"'on': the C++ kernels are float32 only, got {', '.join(half)}; "
            "use 'auto' or 'off'")
