"""load_hf / save_hf, and the marker-owned, atomically written output directories they and tformer-convert use."""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
from safetensors import SafetensorError

from tformer_jax.config import ModelConfig
from tformer_jax.data.prepared import clean_partials, exchange_dirs, honour_umask, link_target, partial_dir
from tformer_jax.interop.families import HFConfigError, get_family
from tformer_jax.interop.hf.family import hf_config_from_model, infer_family, model_config_from_hf
from tformer_jax.interop.hf.files import _is_model, _read_tensors, _write_safetensors, read_hf_config
from tformer_jax.interop.hf.weights import check_weights, export_tensors, import_tensors, mtp_depth_held, unflatten
from tformer_jax.nn import Transformer

# ----------------------------------------------------------------------------------------------
# Public API


def load_hf(src: str | os.PathLike | Any) -> tuple[Transformer, dict[str, Any]]:
  """(Transformer, params) of a local HF directory or an in-memory transformers model.

  params is a nested dict of float32 jnp arrays; `model.apply({'params': params}, tokens)` gives
  transformers' logits (or, for encoders without an LM head, the final hidden states).
  config.json is translated and checked against the tensor headers before any model is built or weight
  converted; every anticipated problem is an HFConfigError / HFWeightsError in one line naming the file.
  """
  hf_cfg = read_hf_config(src)
  in_memory = _is_model(src)
  where = type(src).__name__ if in_memory else str(src)
  cfg_where = f"{where} config" if in_memory else str(pathlib.Path(src) / "config.json")
  try:
    family = get_family(hf_cfg.get("model_type"))
    cfg = model_config_from_hf(hf_cfg, family)
  except HFConfigError as e:
    raise HFConfigError(f"{cfg_where}: {e}") from None
  tensors, origin = _read_tensors(src)
  if family.mtp:   # multi-token prediction modules: as many as the files hold (not config.json's count)
    cfg = dataclasses.replace(cfg, mtp_depth=mtp_depth_held(family, cfg, tensors))
  check_weights(family, cfg, hf_cfg, {k: tuple(v.shape) for k, v in tensors.items()}, cfg_where, origin)
  flat = import_tensors(family, cfg, tensors, where=where)
  params = unflatten({k: jnp.asarray(v) for k, v in flat.items()})
  return Transformer(cfg), params


EXPORT_MARKER = "tformer_export.json"
EXPORT_FORMAT = "tformer_jax.hf_export/1"


def owned_dir(d: pathlib.Path, marker: str, fmt: str) -> bool:
  """Whether directory `d` is one we wrote whole: `marker` of format `fmt` lists exactly its entries."""
  try:
    info = json.loads((d / marker).read_text())
    names = sorted(p.name for p in d.iterdir())
  except (OSError, ValueError):
    return False
  return isinstance(info, dict) and info.get("format") == fmt and sorted(info.get("files", []) + [marker]) == names


def check_target(d: pathlib.Path, overwrite: bool, marker: str, fmt: str, what: str) -> bool:
  """Whether `d` exists (empty, or with overwrite one of ours to replace); OSError in one line for a
  directory that holds anything else, or one of ours without overwrite."""
  if not d.exists():
    return False
  if not d.is_dir():
    raise NotADirectoryError(f"{d} exists and is not a directory")
  names = sorted(p.name for p in d.iterdir())
  if not names:
    return True
  if not owned_dir(d, marker, fmt):
    try:
      info = json.loads((d / marker).read_text())
      listed = info["files"] + [marker] if info.get("format") == fmt else None
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
      listed = None
    if listed is not None:            # one of ours, with files added since: those are the user's
      extra = [n for n in names if n not in listed]
      raise FileExistsError(f"{d} holds files tformer-convert did not write ({', '.join(extra[:5])}): move them "
                            "away to replace it, or choose another directory")
    held = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
    raise FileExistsError(f"{d} is not empty and is not {what} written by tformer-convert (it holds {held}): "
                          "choose an empty or new directory")
  if not overwrite:
    raise FileExistsError(f"{d} holds {what} written earlier by tformer-convert: pass --overwrite to replace it, "
                          "or choose another directory")
  return True


def write_dir_atomically(d: pathlib.Path, write: Any, marker: str, fmt: str, info: Mapping[str, Any]) -> None:
  """`write(tmp)` into a new directory beside `d`, then `marker` (listing every file), then the directory
  takes d's place (renamed onto a missing or empty d, exchanged with an old one of ours, which goes). On a
  failure (a full disk) nothing is left: OSError in one line; a killed write's partial directory goes at the
  next write of `d` (`clean_partials`)."""
  d = link_target(d).absolute()                   # a symlinked output: its target is replaced, not the link
  d.parent.mkdir(parents=True, exist_ok=True)
  clean_partials(d)                               # a killed write's (kill -9: its pid gone)
  tmp = partial_dir(d)
  try:
    write(tmp)
    files = sorted(p.name for p in tmp.iterdir())
    (tmp / marker).write_text(json.dumps({"format": fmt, **info, "files": files}, indent=2) + "\n")
    honour_umask(tmp)                             # not mkdtemp's 0700 nor save_file's 0600: 0755 / 0644 (umask 022)
    for p in tmp.iterdir():
      if p.is_file():
        with open(p, "rb+") as f:
          os.fsync(f.fileno())
    if d.exists() and any(d.iterdir()):
      exchange_dirs(tmp, d)
    else:
      os.rename(tmp, d)
  except (OSError, SafetensorError) as e:
    shutil.rmtree(tmp, ignore_errors=True)
    reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    raise OSError(f"{d}: writing failed ({reason}); nothing was written there") from None
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  shutil.rmtree(tmp, ignore_errors=True)       # the replaced directory (one of ours), if any


def save_hf(model: Transformer | ModelConfig, params: Mapping[str, Any], path: str | os.PathLike,
            family: str | None = None, *, max_shard_bytes: int = 4 << 30,
            token_ids: Mapping[str, int | None] | None = None, files: Mapping[str, os.PathLike] | None = None,
            overwrite: bool = False, source: Mapping[str, Any] | None = None) -> pathlib.Path:
  """Write config.json + model.safetensors (sharded with an index above `max_shard_bytes`) that
  transformers' AutoModelForCausalLM (AutoModel for bert) loads. `family` defaults to the first one
  that reproduces the model exactly; a family that cannot raises HFConfigError naming the field.
  token_ids ({'bos_token_id', 'eos_token_id', 'pad_token_id'}: `special_token_ids`) go into
  config.json and a generation_config.json (what `generate` stops and pads with); `files` ({name: path},
  e.g. the tokenizer's) are copied in after them.
  The directory is written whole and atomically (`write_dir_atomically`, with tformer_export.json listing
  its files): `path` must be missing, empty, or (overwrite=True) an earlier export of ours, which it
  replaces; anything else is refused before a byte is written, and a failure leaves nothing."""
  cfg = model.cfg if isinstance(model, Transformer) else model
  family = family or infer_family(cfg)
  fam = get_family(family)
  hf_cfg = hf_config_from_model(cfg, family)
  tensors = export_tensors(fam, dataclasses.replace(cfg, scan_layers=False), params)
  d = pathlib.Path(path)
  check_target(d, overwrite, EXPORT_MARKER, EXPORT_FORMAT, "an HF export")
  ids = {k: v for k, v in (token_ids or {}).items() if v is not None}
  hf_cfg = {**hf_cfg, "dtype": "float32", **ids}

  def write(tmp: pathlib.Path) -> None:
    (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=2, sort_keys=True) + "\n")
    if ids:
      (tmp / "generation_config.json").write_text(json.dumps(ids, indent=2, sort_keys=True) + "\n")
    _write_safetensors(tensors, tmp, max_shard_bytes)
    for name, src in (files or {}).items():
      shutil.copyfile(src, tmp / name)

  write_dir_atomically(d, write, EXPORT_MARKER, EXPORT_FORMAT, {"family": family, **(source or {})})
  return d
