"""Fine-tuning: `train.init_from` = a training workdir or `hf:DIR` (a Hugging Face model directory).

The run takes its architecture from the source: `with_source_architecture(cfg)` replaces every
architecture field of cfg.model (`ModelConfig.architecture`) by the source's and keeps the run's own
execution fields (dtype, scan_layers, remat, dropout, init: `config.NON_ARCHITECTURE_FIELDS`); the
data tokenizer becomes the source's (its token ids are what the weights know); on a prepared corpus the
source's tokenizer must be the one the data was prepared with, and `check_data_tokenizer` records the
corpus's own tokenizer as data.tokenizer. `load_params` then reads the weights, stacks unscanned layers
when the run scans them, and checks every shape.

  tformer-train --config=configs/finetune_hf.py --config.train.init_from=hf:path/to/llama --workdir=runs/ft
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
from typing import Any, Mapping

import jax
import ml_collections
import numpy as np

from tformer_jax import checkpoint, config as config_lib, decode
from tformer_jax.checkpoint import CheckpointError, restore_params
from tformer_jax.data import pipeline, prepared
from tformer_jax.interop import hf
from tformer_jax.nn.stacking import cycle_of, dense_of

log = logging.getLogger("tformer_jax")
HF_PREFIX = "hf:"


def source_model_config(source: str) -> tuple[config_lib.ModelConfig, str | None]:
  """(the source's ModelConfig, its tokenizer spec or None), read without loading any weights."""
  if source.startswith(HF_PREFIX):
    path = pathlib.Path(source[len(HF_PREFIX):]).expanduser()
    hf_cfg = hf.read_hf_config(path)
    try:
      model = hf.model_config_from_hf(hf_cfg, hf.get_family(hf_cfg.get("model_type")))
    except hf.HFConfigError as e:
      raise hf.HFConfigError(f"train.init_from={source}: {e}") from None
    return model, (f"hf:{path}" if (path / "tokenizer.json").is_file() else None)
  cfg_path = pathlib.Path(source).expanduser() / "config.json"
  if not cfg_path.is_file():
    raise CheckpointError(f"train.init_from={source}: no config.json (not a training workdir)")
  try:
    saved = json.loads(cfg_path.read_text())
  except (OSError, ValueError) as e:
    raise CheckpointError(f"train.init_from={source}: {cfg_path} is not a readable run config ({e})") from None
  if isinstance(saved, dict) and "model" not in saved and ("model_type" in saved or "architectures" in saved):
    raise config_lib.ConfigError(f"train.init_from={source}: a Hugging Face model directory (its config.json has "
                                 f"model_type {saved.get('model_type')!r}); prefix it with hf: "
                                 f"(train.init_from=hf:{source})")
  if not isinstance(saved, dict) or not isinstance(saved.get("model"), dict):
    raise CheckpointError(f"train.init_from={source}: {cfg_path} has no model section (not a training workdir)")
  src = ml_collections.ConfigDict(saved)
  tok = src.get("data", {}).get("tokenizer")
  return config_lib.ModelConfig.from_config(src.model), (str(tok) if tok else None)


def _prepared_corpus(data: Any) -> prepared.PreparedDataset | None:
  """The prepared dataset of data.corpus (the first of a mixture) when it is `prepared:DIR`, else None."""
  mixture = data.get("mixture")
  spec = str(pipeline.parse_mixture(mixture)[0][0] if mixture else data.get("corpus", "")).strip()
  if not spec.startswith("prepared:"):
    return None
  return prepared.open_prepared(spec[len("prepared:"):].strip())


def source_tokenizer_sha256(source: str, tokenizer: str | None) -> str | None:
  """The sha256 identifying train.init_from's tokenizer (as prepared manifests record it): its
  tokenizer.json for hf:DIR, the tokenizer its data was prepared with for a workdir (WORKDIR/data.json),
  else its data.tokenizer's; None when it says none."""
  if not source.startswith(HF_PREFIX):
    run = prepared.read_run_data(source)
    if run and run["datasets"]:
      return run["datasets"][0]["tokenizer"].get("sha256")
  return prepared.tokenizer_sha256(tokenizer) if tokenizer else None


def check_data_tokenizer(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """A prepared corpus brings its tokenizer: cfg with data.tokenizer the spec of that tokenizer (so
  config.json records the one used). An explicit data.tokenizer (other than the default) that is another
  tokenizer is a one-line ConfigError naming both; a matching one is fine."""
  ds = _prepared_corpus(cfg.data)
  if ds is None:
    return cfg
  given = str(cfg.data.get("tokenizer", "")).strip()
  used, info = prepared.tokenizer_spec(ds), ds.manifest["tokenizer"]
  if given and given != used and given != config_lib.default_config().data.tokenizer:
    same = (given == info.get("spec") == "bpe") or prepared.tokenizer_sha256(given) == info.get("sha256")
    if not same:
      raise config_lib.ConfigError(
          f"data.tokenizer: {given} is not the tokenizer {ds.path} was prepared with ({info.get('spec')}, sha256 "
          f"{str(info.get('sha256'))[:12]}): a prepared corpus brings its own; drop data.tokenizer, or prepare "
          f"the data with --tokenizer={given}")
  if given != used:
    log.info("data.tokenizer: %s -> %s (the prepared corpus's own)", given or "(unset)", used)
  out = cfg.copy_and_resolve_references()
  with out.unlocked():
    out.data.tokenizer = used
  return out


def with_source_architecture(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """cfg with the architecture (and tokenizer) of train.init_from; unchanged without one. On a prepared
  corpus the source's tokenizer must be the one the data was prepared with (one-line ConfigError
  naming both), and the corpus's tokenizer stays."""
  source = str(cfg.train.get("init_from", "") or "")
  if not source:
    return cfg
  theirs, tokenizer = source_model_config(source)
  corpus = _prepared_corpus(cfg.data)
  if corpus is not None:
    want, info = source_tokenizer_sha256(source, tokenizer), corpus.manifest["tokenizer"]
    if want is not None and want != info.get("sha256"):
      raise config_lib.ConfigError(
          f"train.init_from={source}: its tokenizer ({tokenizer}, sha256 {want[:12]}) is not the one "
          f"{corpus.path} was prepared with ({info.get('spec')}, sha256 {str(info.get('sha256'))[:12]}): the "
          f"weights would read other token ids; prepare the data with --tokenizer={tokenizer}")
    tokenizer = None
  ours = config_lib.ModelConfig.from_config(cfg.model)
  keep = {f: getattr(ours, f) for f in config_lib.NON_ARCHITECTURE_FIELDS}
  model = dataclasses.replace(theirs, **keep)
  out = cfg.copy_and_resolve_references()
  with out.unlocked():
    out.model = config_lib.to_configdict(model)
    if tokenizer and tokenizer != out.data.tokenizer:
      log.info("train.init_from: data.tokenizer %s -> %s (the source's)", out.data.tokenizer, tokenizer)
      out.data.tokenizer = tokenizer
    if out.data.seq_len > model.max_len and model.position == "learned":
      out.data.seq_len = model.max_len
  changed = sorted(k for k, v in model.architecture().items() if ours.architecture().get(k) != v)
  if changed:
    log.info("train.init_from: architecture from %s (%s)", source, ", ".join(changed[:12])
             + (" ..." if len(changed) > 12 else ""))
  return out


def _source_present(source: str) -> bool:
  """Whether train.init_from names something to read here (a local source that is missing is left to
  `config.validate`, which names it in one line; a remote one is read, and its error is Orbax's)."""
  if source.startswith(HF_PREFIX):
    return (pathlib.Path(source[len(HF_PREFIX):]).expanduser() / "config.json").is_file()
  if "://" in source:
    return True
  return (pathlib.Path(source).expanduser() / "config.json").is_file()


def _absolute(source: str) -> str:
  """A local source as an absolute path (a run's config.json, which a LoRA run reads its base from,
  then names the same source from any directory); a remote one unchanged."""
  if "://" in source:
    return source
  prefix = HF_PREFIX if source.startswith(HF_PREFIX) else ""
  return prefix + str(pathlib.Path(source[len(prefix):]).expanduser().resolve())


def resolve(cfg: ml_collections.ConfigDict, overrides: Mapping[str, Any] | None = None
            ) -> ml_collections.ConfigDict:
  """The config a run with train.init_from really runs: the source's architecture, max_len and
  tokenizer (`with_source_architecture`, the prepared corpus's tokenizer checked), then the command
  line's `overrides` ({'model.max_len': 4096, ...}: those of model.*, data.tokenizer and data.seq_len)
  on top; a local source is recorded as an absolute path.
  Every command resolves once, before anything reads the config (cli_common.parse); unchanged without
  init_from or when the source is missing here (validate reports that)."""
  source = str(cfg.get("train", {}).get("init_from", "") or "")
  if not source or not _source_present(source):
    return cfg
  config_lib.check_fields(cfg)          # an unknown field is named before the source is read
  out = check_data_tokenizer(with_source_architecture(cfg))
  again = {k: v for k, v in (overrides or {}).items()
           if k.startswith("model.") or k in ("data.tokenizer", "data.seq_len")}
  out = out.copy_and_resolve_references()
  with out.unlocked():
    out.train.init_from = _absolute(source)
    if again:
      out.update_from_flattened_dict(again)
  return out


def load_params(source: str, abstract_params: Any, num_layers: int) -> Any:
  """The source's parameters in the layout and shardings of `abstract_params`, checked shape by shape."""
  if source.startswith(HF_PREFIX):
    _, params = hf.load_hf(pathlib.Path(source[len(HF_PREFIX):]).expanduser())
  else:
    _, params = restore_params(source)
  return fit_params(source, jax.tree.map(np.asarray, params), abstract_params, num_layers)


def load_lora_base(source: str, abstract_params: Any, num_layers: int, workdir: str | os.PathLike,
                   resuming: bool) -> tuple[Any, dict[str, Any]]:
  """(a LoRA run's frozen base in the layout of `abstract_params`, the record of it for WORKDIR/lora_base.json).
  A resumed run reads the step its record pins and refuses a base whose weights changed since the run started
  (`checkpoint.check_base`: one line naming both); a new run records the base's latest step and sha256."""
  record = checkpoint.read_base_record(workdir) if resuming else None
  step = checkpoint.pinned_step(record)
  try:
    params, used = checkpoint.read_base(source, step)
  except CheckpointError as e:
    if step is None:
      raise
    raise CheckpointError(f"the LoRA base train.init_from={source} at step {step}, the step this run trained "
                          f"on, cannot be read: {e}") from None
  if record is not None:
    checkpoint.check_base(workdir, record, source, params, used)
  return fit_params(source, params, abstract_params, num_layers), checkpoint.base_identity(source, params, used)


def fit_params(source: str, params: Any, abstract_params: Any, num_layers: int) -> Any:
  """Host `params` of train.init_from in the layout and shardings of `abstract_params`, checked shape by shape."""
  if "layers" in abstract_params and "layers" not in params and "layers_0" in params:
    # an unscanned source, a scanned run
    params = decode.stack_layers(params, num_layers, cycle_of(abstract_params), dense_of(abstract_params))
  flat = lambda t: {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(t)[0]}  # noqa: E731
  ours, theirs = flat(abstract_params), flat(params)
  diffs = [f"{k}: ours {a.shape} vs {theirs[k].shape if k in theirs else 'missing'}"
           for k, a in ours.items() if k not in theirs or tuple(theirs[k].shape) != tuple(a.shape)]
  diffs += [f"{k}: not in this model" for k in theirs if k not in ours]
  if diffs:
    raise CheckpointError(f"train.init_from={source}: parameters do not match this config: " + "; ".join(diffs[:8])
                          + (f" (+{len(diffs) - 8} more)" if len(diffs) > 8 else ""))
  leaves = [jax.device_put(np.asarray(theirs[k], a.dtype), a.sharding) for k, a in ours.items()]
  return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(abstract_params), leaves)
