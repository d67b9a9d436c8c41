"""The integrity manifest: 64-bit checksums of every array, digests of the JSON items, the checks of a step's
items, and the shape comparison against a restore target."""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax import lax

from tformer_jax.checkpoint.common import (
  _MAX_LISTED,
  _RECORD,
  DATA,
  MANIFEST,
  CheckpointError,
  PyTree,
  _Damaged,
  _path_str,
)


def _json_default(x: Any) -> Any:
  """numpy / jax scalars and arrays, paths, ConfigDicts and sets -> JSON values."""
  if isinstance(x, (np.generic, np.ndarray, jax.Array)):
    return np.asarray(x).tolist()
  if isinstance(x, os.PathLike):
    return os.fspath(x)
  if isinstance(x, ml_collections.ConfigDict):
    return x.to_dict()
  if isinstance(x, (set, frozenset)):
    return sorted(x)
  raise TypeError(f"not JSON-serialisable: {type(x).__name__} {x!r}")


def _to_json(name: str, value: Any) -> Any:
  """`value` as plain JSON data; fails here (not in Orbax's background thread) if it can't be."""
  try:
    return json.loads(json.dumps(value, default=_json_default))
  except (TypeError, ValueError) as e:
    raise CheckpointError(f"checkpoint item {name!r} must be JSON-serialisable: {e}") from e


def _digest(value: Any) -> str:
  """sha256 of the canonical JSON of `value`."""
  return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# -- array checksums ------------------------------------------------------------------------------

def _fmix32(h: jax.Array) -> jax.Array:
  """MurmurHash3's finaliser: a bijection of uint32 that mixes every bit into every other."""
  h = h ^ (h >> 16)
  h = h * np.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * np.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def _words(x: jax.Array) -> jax.Array:
  """The bytes of `x` as uint32 words (one per element; 8-byte elements gain a trailing axis of 2)."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if jnp.issubdtype(x.dtype, jnp.complexfloating):
    x = jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  bits = np.dtype(x.dtype).itemsize * 8
  if bits > 32:
    return lax.bitcast_convert_type(x, jnp.uint32)
  if bits not in (8, 16, 32):          # sub-byte types (int4, ...): their values, widened
    return x.astype(jnp.int32).view(jnp.uint32)
  unsigned = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32}[bits]
  return lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _leaf_checksum(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Two independent 32-bit sums over the words, each word mixed with its flat index: any change of
  one element changes both; the sums are exact in any order, so any sharding gives the same value."""
  w = _words(jnp.asarray(x))
  idx = jnp.zeros(w.shape, jnp.uint32)
  stride = 1
  for axis in reversed(range(w.ndim)):
    idx = idx + lax.broadcasted_iota(jnp.uint32, w.shape, axis) * np.uint32(stride % (1 << 32))
    stride *= w.shape[axis]
  a = jnp.sum(_fmix32(w ^ _fmix32(idx + np.uint32(0x9E3779B9))), dtype=jnp.uint32)
  b = jnp.sum(_fmix32(_fmix32(w) + idx * np.uint32(0x85EBCA77) + np.uint32(0x27D4EB2F)), dtype=jnp.uint32)
  return a, b


# One leaf per call: XLA materialises a leaf's index and mixed words (two uint32 arrays of its size), so one
# program over the whole state held 2x the state in temporaries (a 1.5 GiB state: +3.1 GiB of RSS at a save).
_checksum_jit = jax.jit(_leaf_checksum)


def _local(x: Any) -> Any:
  """A replicated scalar's copy on this process (fetchable on multi-process meshes too)."""
  return x.addressable_data(0) if isinstance(x, jax.Array) else x


def array_checksums(tree: PyTree) -> dict[str, dict[str, Any]]:
  """{leaf path: {"dtype", "shape", "checksum"}} of every array leaf of `tree`, computed on device, one
  leaf at a time (all processes of a multi-process run must call it together, like a save)."""
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  if not flat:
    return {}
  sums = [jax.device_get(tuple(_local(v) for v in _checksum_jit(x))) for _, x in flat]
  out = {}
  for (path, x), (a, b) in zip(flat, sums):
    dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
    out[_path_str(ocp.tree.str_keypath(path))] = {
        "dtype": str(dtype), "shape": list(np.shape(x)), "checksum": f"{int(a):08x}{int(b):08x}"}
  return out


def _verify_arrays(expected: Any, tree: PyTree, prefix: str = "") -> None:
  """_Damaged unless the leaves of `tree` are exactly the manifest's entries under `prefix`, each with
  its saved dtype, shape and checksum."""
  if not isinstance(expected, dict):
    raise _Damaged("the integrity manifest has no array entries")
  got = array_checksums(tree)
  wanted = {k: v for k, v in expected.items() if k.startswith(prefix)}
  bad = sorted(k for k in got if k not in wanted or wanted[k] != got[k])
  bad += sorted(k for k in wanted if k not in got)
  if bad:
    more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
    raise _Damaged(f"array checksum mismatch in {', '.join(bad[:3])}{more} (changed bytes on disk?)")


def _expected_items(meta: Any) -> set[str] | None:
  """The items the step was saved with (from its `meta` record), None for steps saved before records."""
  record = meta.get(_RECORD) if isinstance(meta, dict) else None
  if not isinstance(record, dict) or not isinstance(record.get("items"), list):
    return None
  return set(record["items"])


def _user_meta(meta: Any) -> Any:
  return {k: v for k, v in meta.items() if k != _RECORD} if isinstance(meta, dict) else meta


def _check_items(step_dir: epath.Path, meta: Any, *, require_data: bool,
                 needed: tuple[str, ...] = (DATA, MANIFEST)) -> None:
  """_Damaged if an item among `needed` that the step was saved with (or a required one) is gone."""
  present = {name for name in (DATA, MANIFEST) if (step_dir / name).exists()}
  expected = _expected_items(meta)
  missing = sorted((expected or set()) & set(needed) - present)
  if require_data and DATA not in present and DATA not in missing:
    missing.insert(0, DATA)
  if missing:
    what = {DATA: "the data-iterator state ('data')", MANIFEST: "the integrity manifest ('manifest')"}
    raise _Damaged("missing " + " and ".join(what[m] for m in missing))


def _verify_json(manifest: dict, name: str, value: Any) -> None:
  want = manifest.get(name)
  if want is not None and want != _digest(value):
    raise _Damaged(f"the '{name}' item does not match its digest in the manifest (changed on disk?)")


# -- shapes -----------------------------------------------------------------------------------------

def _target_shape(leaf: Any) -> tuple[int, ...] | None:
  """The shape a target leaf occupies on disk (a typed PRNG key is stored as its key data)."""
  dtype = getattr(leaf, "dtype", None)
  if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    return tuple(jax.eval_shape(jax.random.key_data, leaf).shape)
  if hasattr(leaf, "shape"):
    return tuple(leaf.shape)
  if isinstance(leaf, (int, float, bool, complex, np.generic)):
    return ()
  return None


def shape_mismatches(abstract_state: PyTree, metadata_tree: PyTree) -> list[str]:
  """Lines 'path: checkpoint (..) vs target (..)' for every tensor whose shape or presence differs."""
  saved = ocp.tree.to_flat_dict(metadata_tree)
  flat = jax.tree_util.tree_flatten_with_path(abstract_state)[0]
  target = {ocp.tree.str_keypath(p): leaf for p, leaf in flat}
  lines = []
  for key, leaf in target.items():
    want = _target_shape(leaf)
    if key not in saved:
      lines.append(f"{_path_str(key)}: not in the checkpoint (target shape {want})")
      continue
    have = getattr(saved[key], "shape", None)
    if have is not None and want is not None and tuple(have) != want:
      lines.append(f"{_path_str(key)}: checkpoint shape {tuple(have)} vs target shape {want}")
  for key, meta in saved.items():
    if key not in target:
      shape = getattr(meta, "shape", "?")
      lines.append(f"{_path_str(key)}: in the checkpoint (shape {shape}) but not in the target")
  return lines


def _mismatch_error(directory: epath.Path, step: int, lines: list[str]) -> CheckpointError:
  shown = lines[:_MAX_LISTED]
  more = f"\n  ... and {len(lines) - len(shown)} more" if len(lines) > len(shown) else ""
  return CheckpointError(
      f"checkpoint step {step} in {directory} does not fit the state being restored "
      f"({len(lines)} tensor(s) differ; was it written with a different model/optimizer config?):\n  "
      + "\n  ".join(shown) + more)
