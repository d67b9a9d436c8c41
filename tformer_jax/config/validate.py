"""`validate(cfg)`: the whole experiment config, section by section (data, optim, train, LoRA, mesh, decode,
runtime)."""
from __future__ import annotations

import dataclasses
import importlib.util
import numbers
import pathlib
from typing import Any

import ml_collections

from tformer_jax.config.attention import supports
from tformer_jax.config.enums import (
  AUTO_ON_OFF,
  CONTEXT_STRATEGIES,
  CORPORA,
  CORPUS_PREFIXES,
  CORPUS_SHOWN,
  DECAY_SHAPES,
  DECODE_LAYOUTS,
  LOGGERS,
  OPTIMIZERS,
  PACKINGS,
  PARALLELISMS,
  PRECISIONS,
  RULE_PRESETS,
  RUNTIME_ATTENTION,
  RUNTIME_BACKENDS,
  RUNTIME_CPU_BLAS,
  RUNTIME_CPU_MATMUL,
  RUNTIME_MOE_EXCHANGE,
  RUNTIME_MOE_GMM,
  SAMPLINGS,
  SCHEDULES,
  TOKENIZER_PREFIXES,
  TOKENIZERS,
)
from tformer_jax.config.errors import ConfigError, _check_choice, _check_path, _check_spec, _either, _fail
from tformer_jax.config.mixture import parse_mixture
from tformer_jax.config.model_rules import validate_model
from tformer_jax.config.schema import ModelConfig, check_fields
from tformer_jax.config.vocab import resolved


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
  _check_wsd(o, t)
  _check_muon(o, t)
  if d is not None and d.batch_size % o.grad_accum:
    _fail("optim.grad_accum", f"data.batch_size={d.batch_size} must be divisible by grad_accum={o.grad_accum}")


def _check_wsd(o: Any, t: Any) -> None:
  """optim.decay_fraction / decay_shape (the wsd schedule): a decay that starts after the warmup ends."""
  frac = o.get("decay_fraction", 0.2)
  if not 0.0 <= frac < 1.0:
    _fail("optim.decay_fraction", f"must be in [0, 1) (wsd: the last fraction of train.steps; 0 = none), got {frac}")
  _check_choice("optim.decay_shape", o.get("decay_shape", "linear"), DECAY_SHAPES)
  if o.schedule != "wsd" or t is None or t.steps <= 0:
    return
  path, step = parse_branch_from(t.get("branch_from", ""))
  start = step if path and step is not None else t.steps - int(round(frac * t.steps))
  field, warm = _warmup(o, t.steps)
  if field == "optim.warmup_steps" and warm >= t.steps:
    warm = t.steps // 10                          # clamped (warmup_note), as train/optim.py does
  if warm > start:
    where = f"the branch's step {start}" if path and step is not None else f"step {start} (decay_fraction={frac})"
    _fail(field, f"the wsd warmup ({warm} steps) would end after its decay starts at {where}; shorten the warmup")


def _check_muon(o: Any, t: Any) -> None:
  """optim.muon_*: Muon's momentum, Newton-Schulz steps and update RMS; Muon trains whole matrices (no LoRA)."""
  if not 0.0 <= o.get("muon_beta", 0.95) < 1.0:
    _fail("optim.muon_beta", f"must be in [0, 1), got {o.muon_beta}")
  if o.get("muon_ns_steps", 5) < 1:
    _fail("optim.muon_ns_steps", f"must be >= 1, got {o.muon_ns_steps}")
  if o.get("muon_rms", 0.2) < 0:
    _fail("optim.muon_rms", f"must be >= 0 (0 = width scaling sqrt(max(1, out / in))), got {o.muon_rms}")
  lora = t.get("lora") if t is not None else None
  if o.get("name") == "muon" and lora is not None and lora.get("rank", 0) > 0:
    _fail("optim.name", "muon orthogonalises whole weight matrices; LoRA adapters (train.lora.rank > 0) train "
          "with adamw")


def parse_branch_from(value: Any) -> tuple[str, int | None]:
  """train.branch_from 'WORKDIR[@STEP]' -> (WORKDIR, STEP or None for its latest); ('', None) when unset."""
  text = str(value or "").strip()
  path, at, step = text.rpartition("@")
  if at and step.isdigit() and path:
    return path, int(step)
  if at and not step.isdigit() and "/" not in step:
    _fail("train.branch_from", f"{text!r}: the step after '@' must be a non-negative integer (WORKDIR[@STEP])")
  return text, None


def _check_branch_from(t: Any, check_paths: bool) -> None:
  """train.branch_from names a training workdir (with checkpoints, when paths are checked), a step before
  train.steps, and no train.init_from beside it."""
  path, step = parse_branch_from(t.get("branch_from", ""))
  if not path:
    return
  if str(t.get("init_from", "") or ""):
    _fail("train.branch_from", "takes a run's whole state (weights, optimizer, data position); train.init_from "
          "takes weights only: set one of them")
  if step is not None and step >= t.steps:
    _fail("train.branch_from", f"step {step} is not before train.steps={t.steps}: the branch would train no step")
  if check_paths and "://" not in path:
    src = pathlib.Path(path).expanduser()
    if not (src / "config.json").is_file() or not (src / "checkpoints").is_dir():
      _fail("train.branch_from", f"{path}: not a training workdir with checkpoints ({src.resolve()})")


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
  if t.get("logit_z_loss", 0.0) < 0:
    _fail("train.logit_z_loss", f"must be >= 0 (0 = off; PaLM used 1e-4), got {t.logit_z_loss}")
  if t.get("mtp_loss_weight", 0.0) < 0:
    _fail("train.mtp_loss_weight", f"must be >= 0 (DeepSeek-V3: 0.3), got {t.mtp_loss_weight}")
  _check_branch_from(t, check_paths)
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
  # ops.lora.TARGETS is the one list of targets (imported here only: config itself stays free of jax)
  from tformer_jax.ops.lora import TARGETS  # noqa: PLC0415 (the ops layer's table; jax loads on first use)
  targets = [s.strip() for s in str(lo.targets).split(",") if s.strip()]
  for name in targets:
    _check_choice("train.lora.targets", name, tuple(TARGETS))
  if lo.rank == 0:
    return
  if not targets:
    _fail("train.lora.targets", "is empty: name at least one projection (e.g. 'q,v')")
  if check_paths and not str(t.get("init_from", "") or ""):
    _fail("train.lora.rank", "LoRA trains adapters on a frozen base: set train.init_from (hf:DIR or a workdir)")
  if mesh is not None and mesh.get("parallelism", "jit") == "pmap":
    _fail("train.lora.rank", "LoRA runs under mesh.parallelism='jit' only")


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


def validate_runtime(r: Any, m: ModelConfig, precision: str = "float32") -> None:
  """The runtime section against the model; the platform-dependent rules (cudnn needs a GPU, ...)
  are `backends.resolve_runtime`'s."""
  for name, allowed in dict(moe_exchange=RUNTIME_MOE_EXCHANGE, moe_gmm=RUNTIME_MOE_GMM,
                            decode_layout=DECODE_LAYOUTS, cpu_matmul=RUNTIME_CPU_MATMUL,
                            cpu_blas=RUNTIME_CPU_BLAS).items():
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
    compute = {"bf16": "bfloat16", "fp16": "float16"}.get(precision, m.dtype)
    if m.param_dtype != "float32" or compute not in ("float32", "bfloat16"):
      _fail("runtime.cpu_kernels", f"'on': the C++ kernels take float32 parameters and float32 or bfloat16 "
            f"compute, got model.param_dtype={m.param_dtype!r}, compute {compute!r} (model.dtype={m.dtype!r}, "
            f"train.precision={precision!r}); use 'auto' or 'off'")
