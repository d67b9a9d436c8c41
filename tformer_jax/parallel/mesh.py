"""Device mesh from config: `mesh.shape` over `mesh.axes` (data, fsdp, tensor[, expert]), -1 = the rest."""
from __future__ import annotations

import math
from typing import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from tformer_jax.config import ConfigError

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


def make_mesh(mesh_cfg, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A mesh with Auto axis types (what linen logical partitioning needs)."""
  devices = list(jax.devices() if devices is None else devices)
  shape = resolve_shape(mesh_cfg.shape, len(devices))
  axes = tuple(mesh_cfg.axes)
  try:
    return jax.make_mesh(shape, axes, axis_types=(AxisType.Auto,) * len(axes), devices=devices)
  except TypeError:  # older signature without devices=
    return Mesh(np.asarray(devices).reshape(shape), axes, axis_types=(AxisType.Auto,) * len(axes))


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
  return tuple(a for a in BATCH_AXES if a in mesh.axis_names)


def data_parallel_size(mesh: Mesh) -> int:
  return math.prod(mesh.shape[a] for a in batch_axes(mesh))


def batch_sharding(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P(batch_axes(mesh)))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def check_layout(cfg, mesh: Mesh) -> None:
  """Errors, before compiling, for batch/heads that the mesh cannot split evenly."""
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
  ep = mesh.shape.get("expert", 1)
  if ep > 1 and m.moe.num_experts % ep:
    raise ConfigError(f"model.moe.num_experts: {m.moe.num_experts} experts are not divisible by the "
                      f"expert axis size {ep}")
