"""Device mesh from config: `mesh.shape` over `mesh.axes` (data, fsdp, tensor[, expert]), -1 = the rest.

`mesh.num_devices` (0 = all) restricts the mesh to the first N devices. On several TPU slices the
'data' axis spans the slices (DCN) and the others stay within a slice (`make_mesh`). `check_layout` and
`check_shardings` turn every layout the mesh cannot split evenly into a ConfigError before compiling;
`traced_under` makes the model's logical sharding constraints effective inside a jitted function.
"""
from __future__ import annotations

import functools
import logging
import math
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.experimental import mesh_utils, multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from tformer_jax.config import ConfigError
from tformer_jax.parallel import rules as rules_lib

log = logging.getLogger("tformer_jax")
BATCH_AXES = ("data", "fsdp")  # the batch is split over both (FSDP is data parallel too)


def resolve_shape(shape: Sequence[int], num_devices: int) -> tuple[int, ...]:
  shape = tuple(int(s) for s in shape)
  known = math.prod(s for s in shape if s != -1)
  if -1 in shape:
    if num_devices % known:
      raise ConfigError(f"mesh.shape: {shape} cannot fill {num_devices} devices ({num_devices} is not "
                        f"divisible by {known})")
    shape = tuple(num_devices // known if s == -1 else s for s in shape)
  if math.prod(shape) != num_devices:
    raise ConfigError(f"mesh.shape: {shape} needs {math.prod(shape)} devices but {num_devices} are "
                      "available (use -1 for 'the rest')")
  return shape


def select_devices(mesh_cfg) -> list[jax.Device]:
  """All devices, or the first `mesh.num_devices` of them (single-process runs only)."""
  devices = jax.devices()
  n = int(mesh_cfg.get("num_devices", 0) or 0)
  if n < 0 or n > len(devices):
    raise ConfigError(f"mesh.num_devices: {n} requested but {len(devices)} devices are available "
                      "(0 = all)")
  if n and n != len(devices) and jax.process_count() > 1:
    raise ConfigError(f"mesh.num_devices: a subset ({n} of {len(devices)}) is not supported with "
                      f"{jax.process_count()} processes; use 0 (all devices)")
  return devices[:n] if n else devices


def make_mesh(mesh_cfg, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A mesh with Auto axis types (what linen logical partitioning needs). Devices of several TPU
  slices (multi-slice: a `slice_index` per device) get a hybrid mesh: `slice_axis` spans the slices
  over the data-center network (DCN), every other axis stays inside a slice (ICI)."""
  devices = list(select_devices(mesh_cfg) if devices is None else devices)
  shape = resolve_shape(mesh_cfg.shape, len(devices))
  axes = tuple(mesh_cfg.axes)
  types = (AxisType.Auto,) * len(axes)
  slices = num_slices(devices)
  if slices > 1:
    ici, dcn = hybrid_shapes(shape, axes, slices)
    grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, allow_split_physical_axes=True)
    return Mesh(grid, axes, axis_types=types)
  try:
    return jax.make_mesh(shape, axes, axis_types=types, devices=devices)
  except TypeError:  # older signature without devices=
    return Mesh(np.asarray(devices).reshape(shape), axes, axis_types=types)
  except NotImplementedError:  # an axis no product of the TPU torus's axes (8 on a 4x4x4): split one
    try:
      grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    except (NotImplementedError, ValueError) as e:
      raise ConfigError(f"mesh.shape: {shape} does not map onto these devices' physical layout: {e}") from None
    return Mesh(grid, axes, axis_types=types)


def num_slices(devices: Sequence[jax.Device]) -> int:
  """How many TPU slices `devices` span (1 for GPUs, CPUs and a single slice)."""
  return len({getattr(d, "slice_index", 0) for d in devices})


def slice_axis(axes: Sequence[str]) -> str:
  """The mesh axis that spans the slices of a multi-slice run: 'data' (pure data parallelism: only
  the gradient reduction crosses the slower DCN), or the first axis when there is no 'data' axis."""
  return "data" if "data" in axes else axes[0]


def hybrid_shapes(shape: Sequence[int], axes: Sequence[str], slices: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """(per-slice ICI shape, DCN shape) of `shape` over `slices` slices (`slice_axis` spans them)."""
  name = slice_axis(axes)
  i = list(axes).index(name)
  if shape[i] % slices:
    raise ConfigError(f"mesh.shape: {tuple(shape)} over {slices} TPU slices: the {name!r} axis spans the "
                      f"slices (DCN), so its size ({shape[i]}) must be a multiple of {slices}; e.g. "
                      f"mesh.shape with {name}={slices}")
  ici = tuple(s // slices if j == i else s for j, s in enumerate(shape))
  dcn = tuple(slices if j == i else 1 for j in range(len(shape)))
  return ici, dcn


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
  return tuple(a for a in BATCH_AXES if a in mesh.axis_names)


def data_parallel_size(mesh: Mesh) -> int:
  return math.prod(mesh.shape[a] for a in batch_axes(mesh))


def batch_sharding(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P(batch_axes(mesh)))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def traced_under(fn: Callable, mesh: Mesh, rules) -> Callable:
  """`fn` tracing under the logical axis `rules` and `mesh`, so that the model's
  nn.with_logical_constraint calls become sharding constraints whenever (and wherever) it is jitted.
  Without this they are silently no-ops: jit traces lazily, at the first call, outside any `with`."""
  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), nn.logical_axis_rules(rules):
      return fn(*args, **kwargs)
  return wrapped


def check_layout(cfg, mesh: Mesh) -> None:
  """Errors, before compiling, for batch/heads that the mesh cannot split evenly."""
  if cfg.mesh.get("parallelism", "jit") == "pmap":
    _check_pmap(mesh)
    if int(cfg.train.get("stats_every", 0)) > 0:
      raise ConfigError("train.stats_every: layer statistics need parallelism='jit'")
  dp = data_parallel_size(mesh)
  micro = cfg.data.batch_size // max(1, cfg.optim.grad_accum)
  if cfg.data.batch_size % dp or micro % dp:
    raise ConfigError(f"data.batch_size: global batch {cfg.data.batch_size} (micro-batch {micro}) is not "
                      f"divisible by the data-parallel size {dp} (mesh axes {batch_axes(mesh)})")
  tp = mesh.shape.get("tensor", 1)
  m = cfg.model
  kv = m.num_kv_heads or m.num_heads
  if tp > 1:
    if m.num_heads % tp:
      raise ConfigError(f"model.num_heads: {m.num_heads} heads are not divisible by the tensor size {tp}")
    if kv % tp:
      raise ConfigError(f"model.num_kv_heads: {kv} kv heads are not divisible by the tensor size {tp}")
  _check_axes_used(cfg.mesh.get("rules", "dp"), mesh)
  cp = mesh.shape.get("context", 1)
  if cp > 1 and cfg.data.seq_len % cp:
    raise ConfigError(f"data.seq_len: {cfg.data.seq_len} is not divisible by the context axis size {cp}")
  if cp > 1 and (m.get("attn_dropout", 0) > 0 or m.get("position") == "t5" or m.get("num_global_tokens", 0)
                 or m.get("random_blocks", 0)):
    raise ConfigError("mesh.axes: context parallelism (a 'context' axis) takes no attention dropout, T5 bias, "
                      "global tokens or random blocks")
  ep = mesh.shape.get("expert", 1)
  if ep > 1 and m.moe.num_experts % ep:
    raise ConfigError(f"model.moe.num_experts: {m.moe.num_experts} experts are not divisible by the "
                      f"expert axis size {ep}")


def _check_axes_used(rules_cfg: Any, mesh: Mesh) -> None:
  """A mesh axis of size > 1 that no rule maps a logical axis to would repeat its shard's work: a
  ConfigError, except 'tensor' under a preset without tensor parallelism (dp, fsdp), which the preset
  names as its choice: logged."""
  rules = rules_lib.get_rules(rules_cfg, tuple(mesh.axis_names))
  for axis in rules_lib.unused_axes(rules, dict(mesh.shape)):
    if isinstance(rules_cfg, str) and axis == "tensor":
      log.warning("mesh: the %r axis (size %d) is unused by mesh.rules=%r: its devices replicate the work",
                  axis, mesh.shape[axis], rules_cfg)
      continue
    raise ConfigError(f"mesh.axes: axis {axis!r} (size {mesh.shape[axis]}) is used by no rule of "
                      f"mesh.rules={rules_cfg!r}: its devices would repeat the same work; map a logical axis "
                      "to it, or give it size 1")


def _check_pmap(mesh: Mesh) -> None:
  others = {a: n for a, n in mesh.shape.items() if a != "data" and n > 1}
  if others:
    raise ConfigError(f"mesh.shape: parallelism='pmap' is data-parallel only (replicated parameters), "
                      f"but the mesh has {others}; use shape (-1, 1, 1) or parallelism='jit'")
  local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
  if not local:
    raise ConfigError(f"mesh: process {jax.process_index()} has no device in the mesh")


def check_shardings(abstract: Any, mesh: Mesh) -> None:
  """ConfigError naming the first tensor whose sharded dimensions the mesh cannot split evenly."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]:
    spec = getattr(getattr(leaf, "sharding", None), "spec", None)
    if spec is None:
      continue
    for dim, (size, axes) in enumerate(zip(leaf.shape, tuple(spec) + (None,) * len(leaf.shape))):
      axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
      ways = math.prod(mesh.shape[a] for a in axes)
      if size % ways:
        raise ConfigError(
            f"mesh.rules: {jax.tree_util.keystr(path)} {tuple(leaf.shape)} has dimension {dim} of size "
            f"{size}, which the mesh axes {axes} (size {ways}) cannot split evenly; change the model "
            "size, mesh.shape or mesh.rules")


def to_host(tree: Any) -> Any:
  """Numpy copies of (possibly multi-host sharded) arrays. A collective when arrays span processes:
  every process must call it."""
  if jax.process_count() > 1:
    tree = jax.tree.map(lambda x: x if x.is_fully_addressable else multihost_utils.process_allgather(
        x, tiled=True), tree)
  return jax.device_get(tree)
