"""Lower and compile a config's train step for a TPU topology (see tformer_jax/aot/__init__.py)."""
from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import Any

import jax
import ml_collections

from tformer_jax import backends, cli_common
from tformer_jax.analysis import estimate as estimate_lib, flops as flops_lib
from tformer_jax.analysis.hlo import hlo_collectives, hlo_flops
from tformer_jax.aot import roofline
from tformer_jax.aot.report import Report
from tformer_jax.aot.topology import GiB, devices_per_chip, hbm_bytes_per_device, topology_devices
from tformer_jax.config import ConfigError, validate
from tformer_jax.parallel import mesh as mesh_lib
from tformer_jax.train import setup as setup_lib

EXIT_FITS, EXIT_CONFIG, EXIT_NO_FIT = 0, 2, 3


def _shard_bytes(tree: Any) -> int:
  """Bytes one device holds of a tree of sharded ShapeDtypeStructs (the largest shard of each leaf)."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    shape = leaf.sharding.shard_shape(leaf.shape) if getattr(leaf, "sharding", None) is not None else leaf.shape
    total += math.prod(shape) * leaf.dtype.itemsize
  return int(total)


def _hbm_figure(text: str, pattern: str) -> int | None:
  m = re.search(pattern, text)
  if not m:
    return None
  units = {"": 1, "B": 1, "K": 1024, "M": 1024 ** 2, "G": GiB, "T": 1024 ** 4}
  return int(float(m.group(1)) * units.get(m.group(2).upper()[:1], 1))


def formula_flops(m: Any, batch: int, seq: int) -> dict[str, Any]:
  """analysis/flops.py's step FLOPs (6*N_matmul*T + 12*n*h*hd*S*T: the attention scores over all S keys, as
  the 'xla' attention computes them) and `with_recompute`: what the compiled step executes with the
  remat policy's recomputed forward (remat 'full': x 4/3 on the layers)."""
  return flops_lib.with_recompute(m, batch, seq, "full")



def _estimate(cfg: ml_collections.ConfigDict, devices: int, state: dict[str, int]) -> dict[str, Any]:
  """tformer-estimate's per-device peak for this mesh (analysis/estimate/mesh.py: nothing compiled),
  with the exact state this build computed."""
  try:
    layout = dataclasses.replace(estimate_lib.layout_of(cfg, devices), params=state["params"],
                                 optimizer=state["opt_state"])
    est = estimate_lib.estimate_on_mesh(cfg, devices, platform="tpu", layout=layout)
  except Exception as e:   # noqa: BLE001 - the compile's report stands without the estimate
    return {"error": cli_common.one_line(e)}
  return {"bytes": est.total, "parts": est.bytes, "phases": est.phases, "notes": est.notes}


def compile_for_topology(cfg: ml_collections.ConfigDict, topology: str, num_slices: int = 1, *,
                         hlo_path: str | None = None) -> Report:
  """Lower and compile `cfg`'s train step for `num_slices` x `topology` (see the module docstring).
  Raises UsageError / ConfigError (one line) for a topology or config that cannot be laid out."""
  validate(cfg, check_paths=False)    # the whole config (mesh.shape against mesh.axes too) before any mesh is built
  if cfg.mesh.get("parallelism", "jit") != "jit":
    raise ConfigError(f"mesh.parallelism: ahead-of-time compilation covers the jit step; got "
                      f"{cfg.mesh.parallelism!r}, use 'jit'")
  devices = topology_devices(topology, num_slices)
  n = int(cfg.mesh.get("num_devices", 0) or 0)
  if n and n != len(devices):
    raise ConfigError(f"mesh.num_devices: {n}, but {topology} x {num_slices} has {len(devices)} devices; "
                      "use 0 (all of them)")
  mesh = mesh_lib.make_mesh(cfg.mesh, devices=devices)
  runtime = backends.resolve_runtime(cfg, mesh_devices=mesh.size, platform="tpu", quiet=True)
  with backends.use(runtime.backend):
    program = setup_lib.build(cfg, mesh, runtime.backend, check_paths=False)
    batch = setup_lib.abstract_batch(cfg, mesh)
    abstract = program.abstract
    state = {"params": _shard_bytes(abstract.params), "opt_state": _shard_bytes(abstract.opt_state)}
    state["other"] = _shard_bytes(abstract) - state["params"] - state["opt_state"]
    report = Report(topology=topology, num_slices=num_slices, devices=len(devices),
                    device_kind=devices[0].device_kind, mesh=dict(mesh.shape), rules=cfg.mesh.rules,
                    runtime=f"{runtime.backend.describe()}", hbm_bytes=hbm_bytes_per_device(devices),
                    state_bytes=state, batch_bytes=_shard_bytes(batch))
    report.flops_formula = formula_flops(program.model_config, int(cfg.data.batch_size), int(cfg.data.seq_len))
    report.estimate = _estimate(cfg, len(devices), state)
    t0 = time.perf_counter()
    lowered = program.train_step.lower(abstract, batch)
    report.lower_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    try:
      compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as e:
      text = str(e)
      if "RESOURCE_EXHAUSTED" not in text:
        raise
      report.compile_s = time.perf_counter() - t0
      report.compiler_error = cli_common.one_line(e)
      report.per_device_bytes = (_hbm_figure(text, r"Used ([\d.]+)([KMGT]?)i?B? of")
                                 or _hbm_figure(text, r"required for [^(]*\(([\d.]+)([KMGT]?)\)"))
      available = (_hbm_figure(text, r"of ([\d.]+)([KMGT]?)i?B? hbm")
                   or _hbm_figure(text, r"available HBM \(([\d.]+)([KMGT]?)\)"))
      report.hbm_bytes = report.hbm_bytes or available
      report.fits = False
      return report
  report.compile_s = time.perf_counter() - t0
  ma = compiled.memory_analysis()
  report.memory = {"argument": int(ma.argument_size_in_bytes), "output": int(ma.output_size_in_bytes),
                   "alias": int(ma.alias_size_in_bytes), "temp": int(ma.temp_size_in_bytes),
                   "generated_code": int(ma.generated_code_size_in_bytes)}
  mem = report.memory
  # MaxText's sum (donated outputs reuse the argument buffers), and XLA:TPU's own peak of the program's
  # HBM use (buffer assignment's live ranges, the program and the runtime's reservation included)
  mem["sum"] = mem["argument"] + mem["output"] + mem["temp"] - mem["alias"]
  mem["peak"] = int(getattr(ma, "peak_memory_in_bytes", 0) or 0)
  report.per_device_bytes = mem["peak"] or mem["sum"]
  report.fits = report.hbm_bytes is None or report.per_device_bytes <= report.hbm_bytes
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  report.flops_xla = float(cost["flops"]) if cost and "flops" in cost else None
  text = compiled.as_text()
  report.collectives = hlo_collectives(text)
  report.flops_hlo_parts = hlo_flops(text)
  report.flops_hlo = report.flops_hlo_parts["total"]
  machine = roofline.tpu_machine(mesh, devices_per_chip(devices))
  if machine is not None:
    tokens = int(cfg.data.batch_size) * int(cfg.data.seq_len) / len(devices)
    # the gradients leave the slice in float32, sharded as the parameters are within a slice
    report.roofline = roofline.predict(text, machine, report.flops_formula["flops_per_step"] / len(devices), tokens,
                                       slice_gradients=(num_slices, state["params"]))
  if hlo_path:
    with open(hlo_path, "w") as f:
      f.write(text)
  return report


# -- the report --------------------------------------------------------------------------------------------
