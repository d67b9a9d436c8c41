"""Data-parallel training with `jax.pmap` (`mesh.parallelism = 'pmap'`).

The classic layout: every device holds the whole (replicated) train state and one slice of the
batch; gradients, token counts and metrics are summed over the 'data' axis inside the caller's
train step (built with `axis_name=AXIS`, e.g. `train.step.make_train_step(..., axis_name=AXIS)`), so
the loss is the same token-weighted mean over the global batch that the jit path computes, and the
optimizer/loss code is shared. This module only wraps step functions it is given: it knows nothing
of the model, the optimizer or the loss.

The state enters and leaves the pmapped step unmapped (`in_axes=None`, `out_axes=None`): the loop
keeps ordinary global arrays, replicated over the mesh's devices (`mesh.shape` must be data-only),
so checkpoints saved on this path are the same unreplicated state the jit path saves and restores
(either way round). Batches are this process's rows split over its local devices.

  step = make_train_step(step_lib.make_train_step(model, tx, schedule, cfg.optim, axis_name=AXIS),
                         mesh, shardings)
  state, metrics = step(state, split_batch(local_batch, mesh))     # metrics: replicated scalars
  evaluate = make_eval_step(lambda p, b: step_lib.eval_step(p, b, model=model), mesh)
"""
from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh

AXIS = "data"
PyTree = Any


def local_devices(mesh: Mesh) -> list[jax.Device]:
  """This process's devices in the mesh, in mesh order."""
  return [d for d in mesh.devices.flat if d.process_index == jax.process_index()]


def split_batch(local: dict, mesh: Mesh) -> dict[str, np.ndarray]:
  """(B_local, ...) host rows -> (local devices, B_local / local devices, ...): contiguous slices."""
  n = len(local_devices(mesh))
  out = {}
  for k, v in local.items():
    v = np.asarray(v)
    if v.shape[0] % n:
      raise ValueError(f"batch[{k!r}]: {v.shape[0]} local rows do not split over {n} devices")
    out[k] = v.reshape((n, v.shape[0] // n) + v.shape[1:])
  return out


def to_mesh(tree: PyTree, shardings: PyTree) -> PyTree:
  """Replicated pmap outputs re-wrapped (no copy) as global arrays with the loop's `shardings`
  (replicated over the same devices), so checkpointing and evaluation see the jit path's layout."""
  def rewrap(x: jax.Array, sh: jax.sharding.Sharding) -> jax.Array:
    if x.sharding == sh:
      return x
    shards = {s.device: s.data for s in x.addressable_shards}
    return jax.make_array_from_single_device_arrays(
        x.shape, sh, [shards[d] for d in sh.addressable_devices_indices_map(x.shape)])
  return jax.tree.map(rewrap, tree, shardings)


def _pmap(fn: Callable, mesh: Mesh, donate: tuple[int, ...] = ()) -> Callable:
  def body(*args):
    with nn.logical_axis_rules(()):  # no logical constraints inside pmap
      return fn(*args)
  return jax.pmap(body, AXIS, in_axes=(None, 0), out_axes=None, devices=list(mesh.devices.flat),
                  donate_argnums=donate)


def make_train_step(train_step: Callable[[PyTree, dict], tuple[PyTree, dict]], mesh: Mesh,
                    shardings: PyTree) -> Callable[[PyTree, dict], tuple[PyTree, dict]]:
  """(state, split batch) -> (state, metrics); the input state is donated.

  `train_step(state, batch) -> (state, metrics)` runs on one device's rows and must reduce its
  gradients and metrics over the `AXIS` ('data') axis itself (`axis_name=AXIS`).
  `shardings` are the loop's state shardings, which the returned state is re-wrapped with."""
  pstep = _pmap(train_step, mesh, donate=(0,))

  def run(state: PyTree, batch: dict) -> tuple[PyTree, dict]:
    new_state, metrics = pstep(state, batch)
    return to_mesh(new_state, shardings), metrics
  return run


def make_eval_step(eval_step: Callable[[PyTree, dict], dict], mesh: Mesh
                   ) -> Callable[[PyTree, dict], dict]:
  """(params, split batch) -> `eval_step`'s sums ({nll_sum, count, correct}) over every device's rows.

  `eval_step(params, batch) -> dict of sums` runs on one device's rows; the psum over `AXIS` is
  added here."""
  def fn(params, batch):
    return jax.lax.psum(eval_step(params, batch), AXIS)
  return _pmap(fn, mesh)
