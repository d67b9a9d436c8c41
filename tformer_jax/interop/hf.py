"""Hugging Face interop: import and export weights of gpt2, llama, mistral, mixtral, bloom, gpt_neox, bert.

  model, params = load_hf("path/to/hf_dir")        # or load_hf(transformers_model)
  logits = model.apply({"params": params}, tokens)  # == transformers' logits
  save_hf(model, params, "out_dir")                 # config.json + model.safetensors for from_pretrained

Reading never touches the network and never runs code from the directory: config.json is parsed as
JSON, weights come from *.safetensors (plain or sharded via model.safetensors.index.json) or, only
if there are none, pytorch_model*.bin through `torch.load(..., weights_only=True)`. The tensor
mapping of each family is data (`families.py`); the config translation is `hf_config.py`.
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
import re
import struct
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from tformer_jax.config import NON_ARCHITECTURE_FIELDS, ModelConfig, MoEConfig, RopeScaling, validate_model
from tformer_jax.data.tokenizers import get_tokenizer
from tformer_jax.interop import axes
from tformer_jax.interop.families import FAMILIES, MIXTRAL, Family, OneOf, Rule, get_family
from tformer_jax.interop.hf_config import HFConfigError
from tformer_jax.nn import Transformer
from tformer_jax.nn.moe import expert_hidden

log = logging.getLogger(__name__)
_MAX_LISTED = 20
__all__ = ["HFConfigError", "HFWeightsError", "load_hf", "save_hf", "load_hf_tokenizer", "read_hf",
           "read_hf_config", "model_config_from_hf", "hf_config_from_model", "infer_family",
           "mixtral_to_params"]


class HFWeightsError(ValueError):
  """Checkpoint tensors that do not fit the model: missing, unexpected or mis-shaped (all named)."""


# ----------------------------------------------------------------------------------------------
# Reading and writing tensors

_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
              "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def _st_dtype(name: str, path: pathlib.Path) -> np.dtype:
  if name in _ST_DTYPES:
    return np.dtype(_ST_DTYPES[name])
  extra = {"BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
  if name not in extra:
    raise HFWeightsError(f"{path}: unsupported safetensors dtype {name!r}")
  return np.dtype(extra[name])


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
  """All tensors of a .safetensors file as (memory-mapped) numpy arrays; bf16 via ml_dtypes."""
  path = pathlib.Path(path)
  with open(path, "rb") as f:
    head = f.read(8)
    if len(head) < 8:
      raise HFWeightsError(f"{path}: not a safetensors file (too short)")
    (n,) = struct.unpack("<Q", head)
    try:
      header = json.loads(f.read(n))
    except ValueError as e:
      raise HFWeightsError(f"{path}: unreadable safetensors header: {e}") from None
  size = path.stat().st_size - 8 - n
  data = (np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n, shape=(size,)) if size > 0
          else np.zeros(0, np.uint8))
  out = {}
  for name, info in header.items():
    if name == "__metadata__":
      continue
    dtype = _st_dtype(info["dtype"], path)
    start, end = info["data_offsets"]
    shape = tuple(info["shape"])
    if end > size or end - start != math.prod(shape) * dtype.itemsize:
      raise HFWeightsError(f"{path}: tensor {name} has bad data offsets {info['data_offsets']} "
                           f"for shape {shape} {info['dtype']} (truncated file?)")
    out[name] = data[start:end].view(dtype).reshape(shape)
  return out


def _torch_to_numpy(t: Any) -> np.ndarray:
  import torch  # noqa: PLC0415 (optional, the 'reference' extra: only for in-memory models and .bin checkpoints)
  t = t.detach().cpu()
  return (t.to(torch.float32) if t.is_floating_point() else t).numpy()


def _read_bin(path: pathlib.Path) -> dict[str, np.ndarray]:
  import torch  # noqa: PLC0415 (optional, the 'reference' extra: only .bin checkpoints need it)
  sd = torch.load(path, map_location="cpu", weights_only=True)  # never unpickles code
  return {k: _torch_to_numpy(v) for k, v in sd.items()}


def _weight_files(d: pathlib.Path) -> tuple[list[pathlib.Path], str]:
  for index, kind in (("model.safetensors.index.json", "st"), ("pytorch_model.bin.index.json", "bin")):
    if (d / index).is_file():
      weight_map = json.loads((d / index).read_text())["weight_map"]
      return [d / f for f in sorted(set(weight_map.values()))], kind
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
  """The config dict of a local HF directory (config.json, parsed as JSON) or an in-memory model."""
  if _is_model(src):
    return src.config.to_dict()
  d = pathlib.Path(src)
  if not d.is_dir():
    raise FileNotFoundError(f"{d} is not a directory (load_hf reads local Hugging Face model directories)")
  if not (d / "config.json").is_file():
    raise FileNotFoundError(f"{d}: no config.json")
  return json.loads((d / "config.json").read_text())


def read_hf(src: str | os.PathLike | Any) -> tuple[dict, dict[str, np.ndarray]]:
  """(config dict, {tensor name: numpy array}) of a local HF directory or an in-memory model."""
  hf_cfg = read_hf_config(src)
  if _is_model(src):
    return hf_cfg, {k: _torch_to_numpy(v) for k, v in src.state_dict().items()}
  d = pathlib.Path(src)
  files, kind = _weight_files(d)
  tensors: dict[str, np.ndarray] = {}
  for f in files:
    part = read_safetensors(f) if kind == "st" else _read_bin(f)
    dup = sorted(set(part) & set(tensors))
    if dup:
      raise HFWeightsError(f"{d}: tensor(s) {dup[:_MAX_LISTED]} appear in more than one shard")
    tensors.update(part)
  return hf_cfg, tensors


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

_SCALING_FIELDS = {"none": (), "linear": ("factor",), "ntk": ("factor",),
                   "dynamic": ("factor", "original_max_len"),
                   "yarn": ("factor", "original_max_len", "beta_fast", "beta_slow", "attention_factor"),
                   "llama3": ("factor", "original_max_len", "low_freq_factor", "high_freq_factor")}


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
  family = family or get_family(hf_cfg.get("model_type"))
  return model_config(**family.to_model(dict(hf_cfg)))


def arch_signature(cfg: ModelConfig) -> dict[str, Any]:
  """The fields that decide what the model computes, in a canonical form (derived sizes resolved)."""
  d = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
       if f.name not in NON_ARCHITECTURE_FIELDS}
  d.update(num_kv_heads=cfg.kv_heads, head_dim=cfg.hd, d_ff=cfg.ff)
  if cfg.position == "rope":
    rs = cfg.rope_scaling
    d["rope_scaling"] = {"type": rs.type, **{k: getattr(rs, k) for k in _SCALING_FIELDS[rs.type]}}
    if "original_max_len" in d["rope_scaling"]:
      d["rope_scaling"]["original_max_len"] = rs.original_max_len or cfg.max_len
  else:
    for k in ("rope_theta", "rotary_fraction", "rope_layout", "rope_scaling"):
      d.pop(k)
  if cfg.position != "t5":
    d.pop("t5_num_buckets"), d.pop("t5_max_distance")
  if not cfg.lm_head:
    d.pop("tie_embeddings")
  if cfg.norm == "rmsnorm":
    d.pop("norm_bias")
  if not cfg.window:
    d.pop("num_global_tokens")
  m = cfg.moe
  d["moe"] = None if not m.num_experts else dict(
      num_experts=m.num_experts, top_k=m.top_k, every=m.every, d_ff=expert_hidden(cfg),
      renormalize=m.renormalize, shared_expert=m.shared_expert)
  if m.num_experts and all(cfg.is_moe_layer(i) for i in range(cfg.num_layers)):
    d.pop("d_ff")  # no dense FFN anywhere: its size is unused
  return d


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
              e=cfg.moe.num_experts, x=expert_hidden(cfg) if cfg.moe.num_experts else 0)


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


def import_tensors(family: Family, cfg: ModelConfig, tensors: Mapping[str, np.ndarray],
                   where: str = "checkpoint") -> dict[str, np.ndarray]:
  """HF tensors -> our flat float32 params {'layers_0/attn/wq': array}. Raises HFWeightsError naming
  every missing, unexpected and mis-shaped tensor."""
  tensors = _normalise_names(family, tensors)
  want = expected_shapes(cfg)
  sizes = _sizes(cfg)
  out: dict[str, np.ndarray] = {}
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
        targets = [_expand(t, layer) for t in rule.targets]
        arrays = [tensors[n] for n in names]
        try:
          if rule.hf_axes or rule.ours_axes:
            results = axes.rearrange(arrays, rule.hf_axes, rule.ours_axes, sizes, what=f"tensor {names[0]}")
          else:
            if tuple(arrays[0].shape) != want[targets[0]]:
              raise axes.LayoutError(f"tensor {names[0]} has shape {tuple(arrays[0].shape)}, "
                                     f"expected {want[targets[0]]}")
            results = [np.asarray(arrays[0])]
        except axes.LayoutError as e:
          bad_shape.append(str(e))
          continue
        for t, r in zip(targets, results):
          out[t] = np.asarray(r, dtype=np.float32)
  tied = "head" not in want
  unexpected, dropped = [], []
  for n in sorted(set(tensors) - used):
    skip = family.ignore + (family.ignore_tied if tied else ())
    if any(re.search(p, n) for p in skip):
      continue
    (dropped if any(re.search(p, n) for p in family.drop) else unexpected).append(n)
  if dropped:
    log.warning("%s: dropping %d tensor(s) our %s model has no place for: %s", where, len(dropped),
                family.model_type, _listed(dropped))
  problems = []
  if missing:
    problems.append(f"missing tensor(s): {_listed(missing)}")
  if unexpected:
    problems.append(f"unexpected tensor(s): {_listed(unexpected)}")
  if bad_shape:
    problems.append("shape mismatch: " + "; ".join(bad_shape[:_MAX_LISTED]))
  if problems:
    raise HFWeightsError(f"{family.model_type} {where}: " + " | ".join(problems))
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
  """
  family = get_family(read_hf_config(src).get("model_type"))  # before reading any weights
  hf_cfg, tensors = read_hf(src)
  cfg = model_config_from_hf(hf_cfg, family)
  where = str(src) if isinstance(src, (str, os.PathLike)) else type(src).__name__
  flat = import_tensors(family, cfg, tensors, where=where)
  params = unflatten({k: jnp.asarray(v) for k, v in flat.items()})
  return Transformer(cfg), params


def save_hf(model: Transformer | ModelConfig, params: Mapping[str, Any], path: str | os.PathLike,
            family: str | None = None, *, max_shard_bytes: int = 4 << 30) -> pathlib.Path:
  """Write config.json + model.safetensors (sharded with an index above `max_shard_bytes`) that
  transformers' AutoModelForCausalLM (AutoModel for bert) loads. `family` defaults to the first one
  that reproduces the model exactly; a family that cannot raises HFConfigError naming the field."""
  cfg = model.cfg if isinstance(model, Transformer) else model
  family = family or infer_family(cfg)
  fam = get_family(family)
  hf_cfg = hf_config_from_model(cfg, family)
  tensors = export_tensors(fam, dataclasses.replace(cfg, scan_layers=False), params)
  d = pathlib.Path(path)
  d.mkdir(parents=True, exist_ok=True)
  hf_cfg = {**hf_cfg, "dtype": "float32"}
  (d / "config.json").write_text(json.dumps(hf_cfg, indent=2, sort_keys=True) + "\n")
  _write_safetensors(tensors, d, max_shard_bytes)
  return d


def load_hf_tokenizer(path: str | os.PathLike) -> Any:
  """Our tokenizer (tformer_jax.data.tokenizers) of an HF directory's tokenizer.json."""
  return get_tokenizer("hf:" + os.fspath(path))
