"""Hugging Face interop: import and export weights of gpt2, llama, mistral, mixtral, bloom, gpt_neox, bert.

  model, params = load_hf("path/to/hf_dir")        # or load_hf(transformers_model)
  logits = model.apply({"params": params}, tokens)  # == transformers' logits
  save_hf(model, params, "out_dir")                 # config.json + model.safetensors for from_pretrained

Reading never touches the network and never runs code from the directory: config.json is parsed as
JSON, weights come from *.safetensors (plain or sharded via model.safetensors.index.json) or, only
if there are none, pytorch_model*.bin through `torch.load(..., weights_only=True)` (a file holding
pickled objects is refused, never unpickled). Every size read is bounded before it is used (file and
header lengths, tensor offsets, then config.json's sizes against the tensors present), so a corrupt or
hostile directory gives one HFConfigError / HFWeightsError line naming the file, never a huge
allocation or a long wait. The tensor mapping of each family is data (`families.py`); the config
translation is `hf_config.py`.
Encoder checkpoints (bert) come without an LM head: apply() returns the final hidden states, equal
to transformers' `last_hidden_state` when the padding mask is passed as `attention_mask_BxL`.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import pathlib
import pickle
import re
import shutil
import struct
import tempfile
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import save_file

from tformer_jax.config import ConfigError, ModelConfig, MoEConfig, RopeScaling, validate_model
from tformer_jax.data.prepared import exchange_dirs
from tformer_jax.data.tokenizers import get_tokenizer
from tformer_jax.interop import axes
from tformer_jax.interop.families import FAMILIES, MIXTRAL, Family, OneOf, Rule, get_family
from tformer_jax.interop.hf_config import HFConfigError
from tformer_jax.nn import Transformer
from tformer_jax.nn.moe import expert_hidden

log = logging.getLogger(__name__)
_MAX_LISTED = 20
__all__ = ["HFConfigError", "HFWeightsError", "load_hf", "save_hf", "load_hf_tokenizer", "read_hf",
           "read_hf_config", "read_safetensors", "check_weights", "model_config_from_hf", "hf_config_from_model",
           "infer_family", "mixtral_to_params"]


class HFWeightsError(ValueError):
  """Weights that cannot be imported: a malformed or unsafe file, or tensors that are missing, unexpected,
  mis-shaped or disagree with config.json (one line naming the file and the tensor or field)."""


# ----------------------------------------------------------------------------------------------
# Reading and writing tensors
#
# Everything read from the directory is bounded before it is used: a JSON file's size, the
# safetensors header length (against the file and the format's own cap), every tensor's dtype, shape
# and data_offsets (inside the data section, exactly the bytes its shape needs, the tensors tiling the
# section without overlap or stray bytes), and then the sizes config.json implies against the tensors
# present (`check_weights`), all before a model is built or a weight converted.

_MAX_HEADER_BYTES = 100_000_000   # the safetensors format's own limit on its JSON header
_MAX_JSON_BYTES = 64 << 20        # config.json and *.index.json (real ones are kilobytes)
_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
              "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2, "I64": np.int64,
              "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def _json_kind(v: Any) -> str:
  return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
      type(v), "a number")


def _read_json(path: pathlib.Path, error: type[ValueError]) -> dict:
  """The JSON object in `path`; otherwise `error` (one line naming the path)."""
  size = path.stat().st_size
  if size > _MAX_JSON_BYTES:
    raise error(f"{path}: {size} bytes, more than such a file can plausibly hold ({_MAX_JSON_BYTES})")
  try:
    obj = json.loads(path.read_bytes().decode("utf-8-sig"))
  except UnicodeDecodeError as e:
    raise error(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
  except json.JSONDecodeError as e:
    raise error(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
  except RecursionError:
    raise error(f"{path}: JSON nested too deeply") from None
  if not isinstance(obj, dict):
    raise error(f"{path}: expected a JSON object, found {_json_kind(obj)}")
  return obj


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
  out = {}
  for k, v in pairs:
    if k in out:
      raise ValueError(f"{k!r} appears twice")
    out[k] = v
  return out


def _is_count(v: Any) -> bool:
  return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _st_entry(path: pathlib.Path, name: str, info: Any, data_size: int) -> tuple[np.dtype, tuple[int, ...], int, int]:
  """(dtype, shape, begin, end) of one header entry, every field checked against the data section."""
  what = f"{path}: tensor {name}"
  if not isinstance(info, dict):
    raise HFWeightsError(f"{what}: its header entry is {_json_kind(info)}, not an object")
  dt, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
  if not isinstance(dt, str) or dt not in _ST_DTYPES:
    raise HFWeightsError(f"{what} has unknown dtype {dt!r} (known: {', '.join(_ST_DTYPES)})")
  dtype = np.dtype(_ST_DTYPES[dt])
  if not isinstance(shape, list) or not all(_is_count(s) for s in shape):
    raise HFWeightsError(f"{what} has shape {shape!r}, not a list of non-negative integers")
  if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
    raise HFWeightsError(f"{what} has data_offsets {offsets!r}, not a pair of non-negative integers")
  begin, end = offsets
  if end < begin:
    raise HFWeightsError(f"{what} has data_offsets {offsets}: the end is before the beginning")
  if end > data_size:
    raise HFWeightsError(f"{what} has data_offsets {offsets} past the end of the data section ({data_size} "
                         "bytes; a truncated file?)")
  need = math.prod(shape) * dtype.itemsize
  if end - begin != need:
    raise HFWeightsError(f"{what} has data_offsets {offsets} ({end - begin} bytes), but shape {tuple(shape)} "
                         f"of {dt} takes {need} bytes")
  return dtype, tuple(shape), begin, end


def _st_header(path: pathlib.Path) -> tuple[dict[str, tuple[np.dtype, tuple[int, ...], int, int]], int, int]:
  """({tensor: (dtype, shape, begin, end)}, data start, data size) of a .safetensors file, validated as
  the format requires (safetensors itself refuses the same files)."""
  if not path.is_file():
    raise HFWeightsError(f"{path}: not a regular file")
  size = path.stat().st_size
  if size < 8:
    raise HFWeightsError(f"{path}: not a safetensors file ({size} bytes, less than its 8-byte header length)")
  with open(path, "rb") as f:
    (n,) = struct.unpack("<Q", f.read(8))
    if n > size - 8 or n > _MAX_HEADER_BYTES:
      room = (f"the file has {size - 8} bytes after it" if n > size - 8
              else f"the format allows at most {_MAX_HEADER_BYTES}")
      raise HFWeightsError(f"{path}: safetensors header length {n} is impossible ({room}): not a safetensors "
                           "file, or a corrupt one")
    raw = f.read(n)
  try:
    header = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
  except (UnicodeDecodeError, RecursionError, ValueError) as e:
    raise HFWeightsError(f"{path}: unreadable safetensors header ({' '.join(str(e).split())})") from None
  if not isinstance(header, dict):
    raise HFWeightsError(f"{path}: the safetensors header is {_json_kind(header)}, not an object")
  data_size = size - 8 - n
  entries = {name: _st_entry(path, name, info, data_size) for name, info in header.items()
             if name != "__metadata__"}
  pos, prev = 0, None
  for name, (_, _, begin, end) in sorted(entries.items(), key=lambda kv: kv[1][2:]):
    if begin < pos:
      raise HFWeightsError(f"{path}: tensors {prev} and {name} overlap (data_offsets {list(entries[prev][2:])} "
                           f"and {[begin, end]})")
    if begin > pos:
      raise HFWeightsError(f"{path}: bytes {pos}..{begin} of the data section belong to no tensor (before {name})")
    pos, prev = end, name
  if pos != data_size:
    raise HFWeightsError(f"{path}: {data_size - pos} byte(s) after the last tensor belong to no tensor")
  return entries, 8 + n, data_size


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
  """All tensors of a .safetensors file as (memory-mapped) numpy arrays; bf16 via ml_dtypes. The header is
  validated first (HFWeightsError naming the file and the tensor). Not the safetensors package's reader:
  its numpy API copies every tensor into memory and cannot return bfloat16 (most checkpoints); the package
  writes our exports (`save_file`)."""
  path = pathlib.Path(path)
  entries, start, size = _st_header(path)
  data = (np.memmap(path, dtype=np.uint8, mode="r", offset=start, shape=(size,)) if size > 0
          else np.zeros(0, np.uint8))
  return {name: data[begin:end].view(dtype).reshape(shape) for name, (dtype, shape, begin, end) in entries.items()}


def _torch_to_numpy(t: Any) -> np.ndarray:
  import torch  # noqa: PLC0415 (optional, the 'reference' extra: only for in-memory models and .bin checkpoints)
  t = t.detach().cpu()
  return (t.to(torch.float32) if t.is_floating_point() else t).numpy()


def _read_bin(path: pathlib.Path) -> dict[str, np.ndarray]:
  """A pytorch_model*.bin state dict through torch.load(weights_only=True): tensors only, never code."""
  try:
    import torch  # noqa: PLC0415 (optional, the 'reference' extra: only .bin checkpoints need it)
  except ImportError:
    raise HFWeightsError(f"{path}: reading a PyTorch .bin checkpoint needs torch (not installed); or convert "
                         "it to model.safetensors") from None
  if not path.is_file():
    raise HFWeightsError(f"{path}: not a regular file")
  try:
    sd = torch.load(path, map_location="cpu", weights_only=True)  # never unpickles code
  except pickle.UnpicklingError as e:
    # torch's message advises weights_only=False, i.e. running whatever the file holds: never here.
    reason = "; ".join(ln.strip() for ln in str(e).splitlines() if ln.strip() and not re.search(
        r"weights_only|Weights only|^Please file an issue|^Check the documentation", ln.strip()))[:200]
    what = "holds non-tensor Python objects" if "GLOBAL" in reason else "holds pickled data the safe loader refuses"
    raise HFWeightsError(f"{path}: {what} ({reason or 'unpickling refused'}), which will not be unpickled (that "
                         "could run code from the file); convert the checkpoint to model.safetensors, where you "
                         "trust it, and import that") from None
  except Exception as e:  # on purpose: torch raises EOFError, KeyError, RuntimeError, ... on a corrupt file
    msg = " ".join(str(e).split())[:200]
    raise HFWeightsError(f"{path}: not a readable PyTorch checkpoint ({type(e).__name__}{': ' + msg if msg else ''})"
                         ) from None
  if not isinstance(sd, Mapping):
    raise HFWeightsError(f"{path}: holds a {type(sd).__name__}, not a state dict of tensors")
  bad = [repr(k) for k, v in sd.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
  if bad:
    raise HFWeightsError(f"{path}: entries {_listed(bad)} are not tensors (a state dict holds only tensors)")
  return {k: _torch_to_numpy(v) for k, v in sd.items()}


def _shard_files(d: pathlib.Path, index: pathlib.Path) -> list[pathlib.Path]:
  obj = _read_json(index, HFWeightsError)
  weight_map = obj.get("weight_map")
  if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
    raise HFWeightsError(f"{index}: 'weight_map' is not an object of tensor name -> file name")
  files = []
  for name in sorted(set(weight_map.values())):
    if name in ("", ".", "..") or pathlib.PurePath(name).name != name or "\\" in name:
      raise HFWeightsError(f"{index}: weight_map names {name!r}, which is not a file name (shards lie in {d})")
    if not (d / name).is_file():
      raise HFWeightsError(f"{index}: weight_map names {name}, which is not a file in {d}")
    files.append(d / name)
  return files


def _weight_files(d: pathlib.Path) -> tuple[list[pathlib.Path], str]:
  for index, kind in (("model.safetensors.index.json", "st"), ("pytorch_model.bin.index.json", "bin")):
    if (d / index).is_file():
      return _shard_files(d, d / index), kind
  if (d / "model.safetensors").is_file():
    return [d / "model.safetensors"], "st"
  st = sorted(d.glob("model*.safetensors"))
  if st:
    return st, "st"
  if (d / "pytorch_model.bin").is_file():
    return [d / "pytorch_model.bin"], "bin"
  raise FileNotFoundError(f"{d}: no weights (model.safetensors, model.safetensors.index.json or "
                          "pytorch_model.bin)")


def _is_model(src: Any) -> bool:
  return hasattr(src, "state_dict") and hasattr(src, "config")


def read_hf_config(src: str | os.PathLike | Any) -> dict:
  """The config dict of a local HF directory (config.json, parsed as JSON: HFConfigError naming the path
  if it is not a JSON object) or an in-memory model."""
  if _is_model(src):
    return src.config.to_dict()
  d = pathlib.Path(src)
  if not d.is_dir():
    raise FileNotFoundError(f"{d} is not a directory (load_hf reads local Hugging Face model directories)")
  if not (d / "config.json").is_file():
    raise FileNotFoundError(f"{d}: no config.json")
  return _read_json(d / "config.json", HFConfigError)


def _read_dir(d: pathlib.Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
  """({tensor name: array}, {tensor name: its file's name}) of a local HF directory's weights."""
  files, kind = _weight_files(d)
  tensors: dict[str, np.ndarray] = {}
  origin: dict[str, str] = {}
  for f in files:
    part = read_safetensors(f) if kind == "st" else _read_bin(f)
    dup = sorted(set(part) & set(tensors))
    if dup:
      raise HFWeightsError(f"{d}: tensor(s) {_listed(dup)} appear in more than one shard ({f.name} and "
                           f"{origin[dup[0]]})")
    tensors.update(part)
    origin.update(dict.fromkeys(part, f.name))
  return tensors, origin


def _read_tensors(src: str | os.PathLike | Any) -> tuple[dict[str, np.ndarray], dict[str, str]]:
  """({tensor name: numpy array}, {tensor name: file}) of a local HF directory or an in-memory model."""
  if _is_model(src):
    return {k: _torch_to_numpy(v) for k, v in src.state_dict().items()}, {}
  return _read_dir(pathlib.Path(src))


def read_hf(src: str | os.PathLike | Any) -> tuple[dict, dict[str, np.ndarray]]:
  """(config dict, {tensor name: numpy array}) of a local HF directory or an in-memory model."""
  return read_hf_config(src), _read_tensors(src)[0]


def _write_safetensors(tensors: Mapping[str, np.ndarray], d: pathlib.Path, max_shard_bytes: int) -> None:
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for name, arr in tensors.items():
    if shards[-1] and size + arr.nbytes > max_shard_bytes:
      shards.append({})
      size = 0
    shards[-1][name] = np.ascontiguousarray(arr)
    size += arr.nbytes
  meta = {"format": "pt"}
  if len(shards) == 1:
    save_file(shards[0], str(d / "model.safetensors"), metadata=meta)
    return
  weight_map = {}
  for j, shard in enumerate(shards):
    fname = f"model-{j + 1:05d}-of-{len(shards):05d}.safetensors"
    save_file(shard, str(d / fname), metadata=meta)
    weight_map.update({k: fname for k in shard})
  total = sum(a.nbytes for a in tensors.values())
  (d / "model.safetensors.index.json").write_text(
      json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


# ----------------------------------------------------------------------------------------------
# Configs

def model_config(**kwargs: Any) -> ModelConfig:
  """A validated ModelConfig from kwargs whose rope_scaling / moe may be dicts."""
  if isinstance(kwargs.get("rope_scaling"), Mapping):
    kwargs["rope_scaling"] = RopeScaling(**kwargs["rope_scaling"])
  if isinstance(kwargs.get("moe"), Mapping):
    kwargs["moe"] = MoEConfig(**kwargs["moe"])
  cfg = ModelConfig(**kwargs)
  validate_model(cfg)
  return cfg


def model_config_from_hf(hf_cfg: Mapping[str, Any], family: Family | None = None) -> ModelConfig:
  """The validated ModelConfig of a config.json dict; HFConfigError (one line) for anything it cannot be."""
  family = family or get_family(hf_cfg.get("model_type"))
  try:
    return model_config(**family.to_model(dict(hf_cfg)))
  except HFConfigError:
    raise
  except ConfigError as e:
    raise HFConfigError(f"{family.model_type}: {e}") from None
  except (TypeError, ValueError, KeyError, AttributeError, ArithmeticError) as e:  # malformed nested values
    raise HFConfigError(f"{family.model_type}: malformed config ({type(e).__name__}: {e})") from None


def arch_signature(cfg: ModelConfig) -> dict[str, Any]:
  """The fields that decide what the model computes (`ModelConfig.architecture`)."""
  return cfg.architecture()


_MAX_FIXES = 8


def _mismatches(cfg: ModelConfig, family: Family) -> tuple[dict | None, dict[str, str]]:
  """(config.json dict, {}) if `family` reproduces `cfg` exactly, else (None, {model field: reason})
  naming every architectural field the family cannot hold (a field it refuses is replaced by one it
  can hold, `HFConfigError.fix`, to look for the others)."""
  reasons: dict[str, str] = {}
  probe = dataclasses.replace(cfg, d_ff=cfg.ff)  # a substituted activation must not resize the FFN
  for _ in range(_MAX_FIXES):
    try:
      hf = family.to_hf(probe)
      break
    except HFConfigError as e:
      if not e.field or not e.fix or e.field in reasons:
        return None, {**reasons, e.field or "?": str(e)}
      reasons[e.field] = str(e)
      probe = dataclasses.replace(probe, **e.fix)
  else:
    return None, reasons
  try:
    back = model_config_from_hf(hf, family)
  except (HFConfigError, ValueError) as e:   # a table bug: to_hf wrote what to_model refuses
    return None, {**reasons, "?": f"{family.model_type}: {e}"}
  want, got = arch_signature(cfg), arch_signature(back)
  for k in want:
    if want[k] != got.get(k) and k not in reasons:
      has = f"it would be {got[k]!r}" if got.get(k) is not None else f"{family.model_type} has none"
      reasons[k] = f"{family.model_type} cannot represent model.{k}={want[k]!r} ({has})"
  return (None, reasons) if reasons else (hf, {})


def hf_config_from_model(cfg: ModelConfig, family: str) -> dict:
  """The config.json dict of `cfg` as `family`; HFConfigError (one line) naming every field the
  family cannot represent."""
  hf, reasons = _mismatches(cfg, get_family(family))
  if hf is None:
    raise HFConfigError("; ".join(reasons.values()))
  return hf


# Fields that say what kind of model it is: named for context when a model has no family.
_KIND_FIELDS = ("position", "norm", "activation")
_FOLLOW_POSITION = ("rope_theta", "rotary_fraction", "rope_layout", "rope_scaling", "t5_num_buckets",
                    "t5_max_distance")


def infer_family(cfg: ModelConfig) -> str:
  """The first family (gpt2, llama, mistral, mixtral, bloom, gpt_neox, bert) that reproduces `cfg`.

  None: HFConfigError in one line naming the architectural fields that the nearest families (fewest
  differences) cannot hold, and the fields the next ones differ in."""
  groups: dict[tuple[str, ...], list[str]] = {}   # differing fields -> families, in table order
  reasons: dict[tuple[str, ...], dict[str, str]] = {}
  for name, fam in FAMILIES.items():
    hf, why = _mismatches(cfg, fam)
    if hf is not None:
      return name
    fields = tuple(k for k in why if not ("position" in why and k in _FOLLOW_POSITION))
    groups.setdefault(fields, []).append(name)
    reasons.setdefault(fields, why)
  ranked = sorted(groups, key=len)
  nearest = ranked[0]
  sig = arch_signature(cfg)
  head = ", ".join(f"model.{k}={sig[k]!r}" for k in nearest if k in sig) or "this model"
  kind = [f"{k}={getattr(cfg, k)!r}" for k in _KIND_FIELDS if k not in nearest]
  detail = f"{'/'.join(groups[nearest])}: {'; '.join(reasons[nearest].values())}"
  nxt = [f"{'/'.join(groups[f])} differ(s) in {', '.join(f)}" for f in ranked[1:3]]
  raise HFConfigError(f"{head}" + (f" with {' and '.join(kind)}" if kind else "")
                      + f": no Hugging Face family holds this architecture ({'; '.join([detail] + nxt)})")


# ----------------------------------------------------------------------------------------------
# Parameters

def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  """{'layers_0/attn/wq': shape, ...} of an unscanned Transformer(cfg), without allocating."""
  cfg = dataclasses.replace(cfg, scan_layers=False)
  shapes = jax.eval_shape(Transformer(cfg).init, jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32))
  return {k: tuple(v.shape) for k, v in flatten(nn.unbox(shapes["params"])).items()}


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  out = {}
  for k, v in tree.items():
    if isinstance(v, Mapping):
      out.update(flatten(v, f"{prefix}{k}/"))
    else:
      out[f"{prefix}{k}"] = v
  return out


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
  out: dict[str, Any] = {}
  for path, v in flat.items():
    node = out
    *parents, leaf = path.split("/")
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = v
  return out


def _sizes(cfg: ModelConfig) -> dict[str, int]:
  return dict(d=cfg.d_model, h=cfg.num_heads, g=cfg.kv_heads, k=cfg.hd, f=cfg.ff, v=cfg.vocab_size,
              e=cfg.moe.num_experts, x=expert_hidden(cfg) if cfg.moe.num_experts else 0, p=cfg.max_len,
              t=cfg.type_vocab_size)


def _expand(template: str, layer: int | None) -> str:
  return template if layer is None else template.replace("{i}", str(layer))


def _hf_names(rule: Rule, layer: int | None, cfg: ModelConfig) -> list[str]:
  name = _expand(rule.hf, layer)
  return [name.replace("{e}", str(e)) for e in range(cfg.moe.num_experts)] if "{e}" in name else [name]


def _instances(item: Rule | OneOf, cfg: ModelConfig) -> list[tuple[int | None, tuple[tuple[Rule, ...], ...]]]:
  """(layer, options) pairs: every rule (set) once per layer if it is per-layer, else once."""
  options = item.options if isinstance(item, OneOf) else ((item,),)
  per_layer = any("{i}" in r.hf for opt in options for r in opt)
  return [(i, options) for i in (range(cfg.num_layers) if per_layer else [None])]


def _applicable(rules: tuple[Rule, ...], layer: int | None, have: Mapping[str, Any]) -> list[Rule]:
  """The rules whose parameters our model has (all targets, or none: anything else is a table bug)."""
  out = []
  for r in rules:
    present = [_expand(t, layer) in have for t in r.targets]
    if all(present):
      out.append(r)
    elif any(present):
      raise AssertionError(f"family table: rule {r.hf} targets only partly exist in the model")
  return out


def _normalise_names(family: Family, tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
  out: dict[str, np.ndarray] = {}
  for name, arr in tensors.items():
    n = name[len(family.strip):] if family.strip and name.startswith(family.strip) else name
    for pattern, repl in family.renames:
      n = re.sub(pattern, repl, n)
    if n in out:
      raise HFWeightsError(f"tensor {name} duplicates {n} (two spellings of the same weight)")
    out[n] = arr
  if family.prefix and out and not any(n.startswith(family.prefix) for n in out):
    out = {family.prefix + n: a for n, a in out.items()}  # a headless base-model checkpoint
  return out


def _listed(names: list[str]) -> str:
  more = f" ... and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else ""
  return ", ".join(names[:_MAX_LISTED]) + more


# What config.json calls each size (the first key present is named in errors), and the size each layout
# letter stands for.
_CONFIG_KEYS = {"num_layers": ("n_layer", "num_hidden_layers"), "d_model": ("n_embd", "hidden_size", "n_embed"),
                "num_heads": ("n_head", "num_attention_heads"), "num_kv_heads": ("num_key_value_heads",),
                "head_dim": ("head_dim",), "d_ff": ("n_inner", "intermediate_size"), "vocab_size": ("vocab_size",),
                "moe.num_experts": ("num_local_experts",), "moe.d_ff": ("intermediate_size",),
                "max_len": ("n_positions", "max_position_embeddings", "seq_length"),
                "type_vocab_size": ("type_vocab_size",)}
_LETTER_FIELDS = {"d": "d_model", "h": "num_heads", "g": "num_kv_heads", "k": "head_dim", "f": "d_ff",
                  "v": "vocab_size", "e": "moe.num_experts", "x": "moe.d_ff", "p": "max_len", "t": "type_vocab_size"}
_MAX_INDEX_DIGITS = 9


def _config_key(hf_cfg: Mapping[str, Any], field: str, value: int) -> str:
  key = next((k for k in _CONFIG_KEYS.get(field, ()) if hf_cfg.get(k) is not None), None)
  return f"{key}={hf_cfg[key]!r}" if key else f"{field}={value} (derived)"


def _spans(indices: set[int]) -> str:
  """{0, 1, 2, 5} -> '0-2, 5' (the first few runs)."""
  runs: list[list[int]] = []
  for i in sorted(indices):
    if runs and i == runs[-1][1] + 1:
      runs[-1][1] = i
    else:
      runs.append([i, i])
  text = [f"{a}-{b}" if b > a else f"{a}" for a, b in runs[:4]]
  return ", ".join(text) + (", ..." if len(runs) > 4 else "")


def _is_range(indices: set[int], n: int) -> bool:
  """indices == {0, ..., n-1}, without building that set (n comes from config.json)."""
  return len(indices) == n and (not indices or (min(indices) == 0 and max(indices) == n - 1))


def _all_rules(family: Family) -> list[Rule]:
  return [r for item in family.rules
          for opt in (item.options if isinstance(item, OneOf) else ((item,),)) for r in opt]


_INDEX_PATTERNS: dict[str, re.Pattern] = {}


def _index_pattern(family: Family) -> re.Pattern:
  """One regex matching every per-layer / per-expert tensor name of the family; its groups i<n> / e<n>
  capture the layer and expert numbers."""
  if family.model_type not in _INDEX_PATTERNS:
    num = f"[0-9]{{1,{_MAX_INDEX_DIGITS}}}"
    alts = [re.escape(r.hf).replace(r"\{i\}", f"(?P<i{n}>{num})").replace(r"\{e\}", f"(?P<e{n}>{num})")
            for n, r in enumerate(_all_rules(family)) if "{i}" in r.hf or "{e}" in r.hf]
    _INDEX_PATTERNS[family.model_type] = re.compile("|".join(alts) or "(?!)")
  return _INDEX_PATTERNS[family.model_type]


def check_weights(family: Family, cfg: ModelConfig, hf_cfg: Mapping[str, Any],
                  shapes: Mapping[str, tuple[int, ...]], where: str = "config.json",
                  origin: Mapping[str, str] | None = None) -> None:
  """The sizes config.json implies against the tensors present, before any model is built: the number
  of layers and of experts (from the tensor names), then every dimension of every tensor present
  (from the family's layouts). Costs O(tensors + layers * rules), never more than the files hold;
  HFWeightsError in one line naming config.json's key (`where`), the tensor and its file."""
  origin = origin or {}
  names = _normalise_names(family, shapes)
  files = _normalise_names(family, {n: origin.get(n, "") for n in shapes})
  layers: set[int] = set()
  experts: set[int] = set()
  pattern = _index_pattern(family)
  for n in names:
    m = pattern.fullmatch(n)
    if m:
      for g, v in m.groupdict().items():
        if v is not None:
          (layers if g[0] == "i" else experts).add(int(v))
  per_layer = [r.hf for r in _all_rules(family) if "{i}" in r.hf]
  if per_layer and not _is_range(layers, cfg.num_layers):
    held = (f"{len(layers)} layer(s) (numbered {_spans(layers)})" if layers
            else f"no per-layer tensors (such as {_expand(per_layer[0], 0)})")
    raise HFWeightsError(f"{where}: {_config_key(hf_cfg, 'num_layers', cfg.num_layers)} does not match the "
                         f"weights, which hold {held}")
  n_experts = cfg.moe.num_experts
  per_expert = [r.hf for r in _all_rules(family) if "{e}" in r.hf]
  if per_expert and experts and not _is_range(experts, n_experts):
    raise HFWeightsError(f"{where}: {_config_key(hf_cfg, 'moe.num_experts', n_experts)} does not match the "
                         f"weights, which hold {len(experts)} expert(s) (numbered {_spans(experts)})")
  sizes = _sizes(cfg)
  seen: set[str] = set()      # letters some present tensor confirmed
  wrong: dict[str, list[tuple[str, str]]] = {}   # config keys -> (mismatch, file)
  for rule in _all_rules(family):
    if "{e}" in rule.hf and not experts:
      continue
    groups = axes.parse(rule.hf_axes)
    want = axes.shape_of(rule.hf_axes, sizes)
    for layer in (range(cfg.num_layers) if "{i}" in rule.hf else [None]):
      for n in _hf_names(rule, layer, cfg):
        if n not in names:
          continue
        got = tuple(names[n])
        if len(got) != len(want):
          bad = [a for g in groups for a in g]
        else:
          bad = [a for g, w, s in zip(groups, want, got) if w != s for a in g]
        letters = [a for g in groups for a in g if not a.isdigit()]
        if not bad:
          seen.update(letters)
          continue
        keys = ", ".join(_config_key(hf_cfg, _LETTER_FIELDS[a], sizes[a])
                         for a in dict.fromkeys(bad) if not a.isdigit()) or "the family's layout"
        file = f" (in {files[n]})" if files.get(n) else ""
        wrong.setdefault(keys, []).append((f"tensor {n} has shape {got}, expected {want}", file))
  if wrong:
    parts = [f"{items[0][0]} from {keys}{items[0][1]}" + (f" (and {len(items) - 1} more)" if len(items) > 1 else "")
             for keys, items in list(wrong.items())[:_MAX_LISTED]]
    raise HFWeightsError(f"{where} does not match the weights: " + "; ".join(parts))
  if per_expert and n_experts and not experts and "e" not in seen:
    example = _expand(per_expert[0], 0).replace("{e}", "0")
    raise HFWeightsError(f"{where}: {_config_key(hf_cfg, 'moe.num_experts', n_experts)} does not match the "
                         f"weights, which hold no expert tensors (such as {example})")


def import_tensors(family: Family, cfg: ModelConfig, tensors: Mapping[str, np.ndarray],
                   where: str = "checkpoint") -> dict[str, np.ndarray]:
  """HF tensors -> our flat float32 params {'layers_0/attn/wq': array}. Raises HFWeightsError naming
  every missing, unexpected and mis-shaped tensor, before converting any."""
  tensors = _normalise_names(family, tensors)
  try:
    want = expected_shapes(cfg)
  except (OverflowError, ValueError, TypeError) as e:
    raise HFConfigError(f"{where}: the config's sizes describe no model that can be built "
                        f"({' '.join(str(e).split())[:200]})") from None
  sizes = _sizes(cfg)
  plan: list[tuple[Rule, list[str], list[str]]] = []
  used: set[str] = set()
  missing: list[str] = []
  bad_shape: list[str] = []
  for item in family.rules:
    for layer, options in _instances(item, cfg):
      rule_sets = [_applicable(opt, layer, want) for opt in options]
      present = [all(n in tensors for r in rs for n in _hf_names(r, layer, cfg)) for rs in rule_sets]
      chosen = rule_sets[present.index(True)] if any(present) else rule_sets[0]
      for rule in chosen:
        names = _hf_names(rule, layer, cfg)
        absent = [n for n in names if n not in tensors]
        if absent:
          missing += absent
          continue
        used.update(names)
        shape = axes.shape_of(rule.hf_axes, sizes)
        bad = [f"tensor {n} has shape {tuple(tensors[n].shape)}, expected {shape}" for n in names
               if tuple(tensors[n].shape) != shape]
        if bad:
          bad_shape += bad
          continue
        plan.append((rule, names, [_expand(t, layer) for t in rule.targets]))
  tied = "head" not in want
  unexpected, dropped = [], []
  for n in sorted(set(tensors) - used):
    skip = family.ignore + (family.ignore_tied if tied else ())
    if any(re.search(p, n) for p in skip):
      continue
    (dropped if any(re.search(p, n) for p in family.drop) else unexpected).append(n)
  problems = []
  if missing:
    problems.append(f"missing tensor(s): {_listed(missing)}")
  if unexpected:
    problems.append(f"unexpected tensor(s): {_listed(unexpected)}")
  if bad_shape:
    problems.append("shape mismatch: " + "; ".join(bad_shape[:_MAX_LISTED]))
  if problems:
    raise HFWeightsError(f"{family.model_type} {where}: " + " | ".join(problems))
  if dropped:
    log.warning("%s: dropping %d tensor(s) our %s model has no place for: %s", where, len(dropped),
                family.model_type, _listed(dropped))
  # Every tensor fits: only now read and convert them.
  out: dict[str, np.ndarray] = {}
  for rule, names, targets in plan:
    results = axes.rearrange([tensors[n] for n in names], rule.hf_axes, rule.ours_axes, sizes,
                             what=f"tensor {names[0]}")
    for t, r in zip(targets, results):
      if tuple(r.shape) != want[t]:
        raise AssertionError(f"family table {family.model_type}: {rule.hf} gives {t} the shape {r.shape}, "
                             f"the model has {want[t]}")
      out[t] = np.asarray(r, dtype=np.float32)
  unfilled = sorted(set(want) - set(out))
  if unfilled:
    raise AssertionError(f"family table {family.model_type} has no source for {_listed(unfilled)}")
  return out


def _unscan(params: Mapping[str, Any], cfg: ModelConfig) -> dict[str, Any]:
  """A scan_layers params tree ('layers' with a leading layer axis) as layers_0 .. layers_{L-1}."""
  params = dict(params)
  if "layers" not in params:
    return params
  stacked = params.pop("layers")
  for i in range(cfg.num_layers):
    params[f"layers_{i}"] = jax.tree.map(lambda a, i=i: a[i], stacked)
  return params


def export_tensors(family: Family, cfg: ModelConfig, params: Mapping[str, Any]) -> dict[str, np.ndarray]:
  """Our params -> {HF tensor name: float32 array} in the layout save_pretrained writes."""
  flat = {k: np.asarray(v, dtype=np.float32) for k, v in flatten(_unscan(nn.unbox(params), cfg)).items()}
  want = expected_shapes(cfg)
  wrong = [f"{k} has shape {flat[k].shape}, expected {s}" for k, s in want.items()
           if k in flat and flat[k].shape != s]
  absent = sorted(set(want) - set(flat))
  if wrong or absent:
    raise HFWeightsError(f"params do not match the model config: missing {absent[:_MAX_LISTED]}; "
                         + "; ".join(wrong[:_MAX_LISTED]))
  sizes = _sizes(cfg)
  out: dict[str, np.ndarray] = {}
  used: set[str] = set()
  for item in family.rules:
    for layer, options in _instances(item, cfg):
      for rule in _applicable(options[0], layer, flat):
        targets = [_expand(t, layer) for t in rule.targets]
        names = _hf_names(rule, layer, cfg)
        arrays = [flat[t] for t in targets]
        if rule.hf_axes or rule.ours_axes:
          results = axes.rearrange(arrays, rule.ours_axes, rule.hf_axes, sizes, what=f"param {targets[0]}")
        else:
          results = arrays
        used.update(targets)
        out.update({n: np.ascontiguousarray(r) for n, r in zip(names, results)})
  left = sorted(set(flat) - used)
  if left:
    raise HFWeightsError(f"{family.model_type} has no place for param(s) {_listed(left)}")
  return out


def mixtral_to_params(state_dict: Mapping[str, Any], prefix: str = "") -> dict[str, np.ndarray]:
  """transformers-5 MixtralSparseMoeBlock weights (numpy; `prefix` stripped) -> our MoEFFN params.

  HF stores gate.weight (E, H), experts.gate_up_proj (E, 2I, H) (gate rows first, then up) and
  experts.down_proj (E, H, I); ours are router (H, E), w_gate/w_up (E, H, I), w_down (E, I, H):
  the layouts of the Mixtral family table's fused (in-memory module) option."""
  sd = {k[len(prefix):]: np.asarray(v) for k, v in state_dict.items() if k.startswith(prefix)}
  e, two_x, d = sd["experts.gate_up_proj"].shape
  sizes = dict(e=e, x=two_x // 2, d=d)
  fused = next(item for item in MIXTRAL if isinstance(item, OneOf)).options[1]
  block = "model.layers.{i}.mlp."
  out: dict[str, np.ndarray] = {}
  for rule in fused:
    name = rule.hf[len(block):]
    arrays = axes.rearrange([sd[name]], rule.hf_axes, rule.ours_axes, sizes, what=f"tensor {name}")
    out.update({t.rsplit("/", 1)[-1]: a for t, a in zip(rule.targets, arrays)})
  return out


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
  failure (a full disk) nothing is left: OSError in one line."""
  d = d.absolute()
  d.parent.mkdir(parents=True, exist_ok=True)
  tmp = pathlib.Path(tempfile.mkdtemp(dir=d.parent, prefix=f".{d.name}.partial-"))
  try:
    write(tmp)
    files = sorted(p.name for p in tmp.iterdir())
    (tmp / marker).write_text(json.dumps({"format": fmt, **info, "files": files}, indent=2) + "\n")
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


# Files beside an HF model that describe its tokenizer (chat template included) and generation: carried by
# tformer-convert (`tokenizer_files` also takes any other tokenizer*.json/*.model of the directory).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt",
                   "tokenizer.model", "spiece.model", "generation_config.json")
_TOKENIZER_GLOBS = ("tokenizer*.json", "tokenizer*.model", "*.tiktoken")


def tokenizer_files(d: str | os.PathLike) -> dict[str, pathlib.Path]:
  """{relative name: file} of every tokenizer, chat-template and generation file in the HF directory `d`
  (`TOKENIZER_FILES` and the tokenizer*.json / tokenizer*.model / *.tiktoken beside them)."""
  d = pathlib.Path(d)
  names = [n for n in TOKENIZER_FILES if (d / n).is_file()]
  for pattern in _TOKENIZER_GLOBS:
    names += sorted(str(f.relative_to(d)) for f in d.glob(pattern) if f.is_file())
  return {n: d / n for n in dict.fromkeys(names)}


def byte_tokenizer_files(out_dir: str | os.PathLike, max_len: int) -> dict[str, pathlib.Path]:
  """tokenizer.json + tokenizer_config.json in `out_dir` for the byte tokenizer (id = the byte's value),
  which transformers' PreTrainedTokenizerFast loads with the same ids: a byte-level BPE with no merges."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: PLC0415 (only for a byte-level export)
  from tokenizers.pre_tokenizers import ByteLevel  # noqa: PLC0415

  chars = ByteLevel.alphabet()                       # the 256 printable stand-ins of the bytes, GPT-2's map
  table = _bytes_to_unicode()
  assert set(chars) == set(table.values())
  tok = Tokenizer(models.BPE(vocab={table[b]: b for b in range(256)}, merges=[]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  tok.decoder = decoders.ByteLevel()
  out = pathlib.Path(out_dir)
  tok.save(str(out / "tokenizer.json"))
  (out / "tokenizer_config.json").write_text(json.dumps(
      {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": int(max_len), "clean_up_tokenization_spaces":
       False}, indent=2) + "\n")
  return {"tokenizer.json": out / "tokenizer.json", "tokenizer_config.json": out / "tokenizer_config.json"}


def _bytes_to_unicode() -> dict[int, str]:
  """GPT-2's byte -> printable character map (what the ByteLevel pre-tokenizer emits)."""
  keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + list(
      range(ord("\xae"), ord("\xff") + 1))
  chars, n = dict(zip(keep, keep)), 0
  for b in range(256):
    if b not in chars:
      chars[b] = 256 + n
      n += 1
  return {b: chr(c) for b, c in chars.items()}


def special_token_ids(tokenizer: Any, hf_dir: str | os.PathLike | None = None) -> dict[str, int | None]:
  """{'bos_token_id', 'eos_token_id', 'pad_token_id'}: an HF directory's own (config.json,
  generation_config.json) where it states them, else the tokenizer's bos/eos ids; pad falls back to
  eos (what Llama-style models use), None where there is nothing to say."""
  out: dict[str, int | None] = {"bos_token_id": getattr(tokenizer, "bos_id", None),
                                "eos_token_id": getattr(tokenizer, "eos_id", None), "pad_token_id": None}
  for name in ("config.json", "generation_config.json"):
    f = pathlib.Path(hf_dir) / name if hf_dir is not None else None
    if f is not None and f.is_file():
      try:
        stated = json.loads(f.read_text())
      except (OSError, ValueError):
        continue
      for key in out:
        value = stated.get(key) if isinstance(stated, dict) else None
        if isinstance(value, list):          # generation_config may list several eos ids
          value = value[0] if value else None
        if isinstance(value, int):
          out[key] = value
  if out["pad_token_id"] is None:
    out["pad_token_id"] = out["eos_token_id"]
  return out


def load_hf_tokenizer(path: str | os.PathLike) -> Any:
  """Our tokenizer (tformer_jax.data.tokenizers) of an HF directory's tokenizer.json."""
  return get_tokenizer("hf:" + os.fspath(path))
