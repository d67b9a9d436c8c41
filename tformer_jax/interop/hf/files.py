"""Reading and writing tensors: bounded JSON and safetensors readers, torch .bin files through weights_only
loads, shards, config.json, and sharded safetensors writing."""
from __future__ import annotations

import json
import math
import os
import pathlib
import pickle
import re
import struct
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from tformer_jax.interop.families import HFConfigError
from tformer_jax.interop.hf.common import HFWeightsError
from tformer_jax.interop.hf.weights import _listed

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
