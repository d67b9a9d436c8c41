"""A TPU topology's devices on a host with no TPU (libtpu, compile-only) and their HBM."""
from __future__ import annotations

import importlib.util
import math
import os
import re
from typing import Sequence

import jax
from jax.experimental import topologies

from tformer_jax import cli_common
from tformer_jax.aot.chips import CHIPS

GiB = 1024 ** 3

# HBM per chip in GiB, by the device_kind jax reports. Source: the Cloud TPU system architecture pages
# (cloud.google.com/tpu/docs/v4, /v5e, /v5p, /v6e, "HBM capacity per chip": v4 32, v5e 16, v5p 95,
# v6e (Trillium) 32). A v4 chip has two TensorCores, which a topology lists as two devices sharing the
# chip's HBM (`devices_per_chip`). XLA:TPU itself leaves a little of it to the runtime (it reports
# 15.75G available on a v5e): a program within a few hundred MiB of the figure may still be refused.
HBM_GIB_PER_CHIP = {kind: chip.hbm_gib for kind, chip in CHIPS.items()}   # aot/chips.py: the one table
# TPU_ACCELERATOR_TYPE for a topology name's generation (libtpu wants it, and worker hostnames, at
# start-up; without them it prints warnings): f(chips) -> e.g. 'v5p-128' (v4/v5p count TensorCores).
ACCELERATOR_TYPES = {"v4": lambda chips: f"v4-{2 * chips}", "v5e": lambda chips: f"v5litepod-{chips}",
                     "v5litepod": lambda chips: f"v5litepod-{chips}", "v5p": lambda chips: f"v5p-{2 * chips}",
                     "v6e": lambda chips: f"v6e-{chips}"}


def libtpu_available() -> tuple[bool, str]:
  """(True, '') when libtpu is importable, else (False, why): what AOT compilation for TPU needs."""
  if importlib.util.find_spec("libtpu") is None:
    return False, ('libtpu is not installed: pip install -e ".[tpu-aot]" (the libtpu wheel that jax[tpu] '
                   f"pins for jax {jax.__version__})")
  return True, ""


def _accelerator_type(topology: str) -> str | None:
  gen, _, shape = topology.partition(":")
  try:
    chips = math.prod(int(s) for s in shape.lower().split("x"))
  except ValueError:
    return None
  make = ACCELERATOR_TYPES.get(gen.lower())
  return make(chips) if make else None


def topology_devices(topology: str, num_slices: int = 1) -> list[jax.Device]:
  """The devices of `num_slices` slices of `topology`, compile-only (no TPU needed; libtpu required).
  Raises UsageError naming the flag for a name libtpu does not know or a bad slice count."""
  ok, why = libtpu_available()
  if not ok:
    raise cli_common.UsageError(f"--topology: {why}")
  if num_slices < 1:
    raise cli_common.UsageError(f"--num_slices: must be >= 1, got {num_slices}")
  if not re.fullmatch(r"[a-z0-9]+:\d+(x\d+)*", topology or ""):
    raise cli_common.UsageError(f"--topology: expected GENERATION:SHAPE such as v5e:2x2 or v5p:4x4x4, got "
                                f"{topology!r}")
  # libtpu reads these once, when it loads (without them it warns); the user's own values win
  os.environ.setdefault("TPU_ACCELERATOR_TYPE", _accelerator_type(topology) or "v5litepod-4")
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  # compile-only: no TPU is opened, so several processes (two tformer-aot runs) may load libtpu at once;
  # without this the second one stops at libtpu's lockfile (/tmp/libtpu_lockfile)
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  kwargs = {"num_slices": num_slices} if num_slices > 1 else {}
  try:
    desc = topologies.get_topology_desc(topology_name=topology, platform="tpu", **kwargs)
  except (jax.errors.JaxRuntimeError, RuntimeError, ValueError) as e:
    raise cli_common.UsageError(f"--topology: {topology!r}: {cli_common.one_line(e)}") from None
  return list(desc.devices)


def devices_per_chip(devices: Sequence[jax.Device]) -> int:
  return 1 + max(int(getattr(d, "core_on_chip", 0)) for d in devices)


def hbm_bytes_per_device(devices: Sequence[jax.Device]) -> int | None:
  gib = HBM_GIB_PER_CHIP.get(devices[0].device_kind)
  return None if gib is None else int(gib * GiB) // devices_per_chip(devices)

