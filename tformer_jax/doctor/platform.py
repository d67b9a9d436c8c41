"""Where a run would execute and what it would choose there: the platform, the devices, and the kernels
`backends.resolve_runtime` picks for the run's config on that platform (attention, MoE exchange and grouped
matmul, the C++ CPU kernels, the decode layout), with its reasons. `platform` may name another target than
this host's (`tformer-doctor --platform=tpu` on a CPU host: what a TPU run would choose).
"""
from __future__ import annotations

from typing import Any

import jax

from tformer_jax import backends
from tformer_jax.config import ConfigError
from tformer_jax.parallel import mesh as mesh_lib

PLATFORMS = ("cpu", "gpu", "tpu")   # jax.default_backend()'s names


def devices_summary() -> str:
  """This host's devices, e.g. '8 x cpu (cpu)' or '1 x NVIDIA H100 80GB HBM3 (gpu)', one entry per kind."""
  kinds: dict[tuple[str, str], int] = {}
  for d in jax.devices():
    key = (str(getattr(d, "device_kind", d.platform)), d.platform)
    kinds[key] = kinds.get(key, 0) + 1
  return ", ".join(f"{n} x {kind} ({platform})" for (kind, platform), n in kinds.items())


def kernel_report(cfg: Any, platform: str | None = None) -> dict[str, Any]:
  """What a run of `cfg` would choose on `platform` (default: this host's): the keys of runtime.json plus
  'reasons', 'host_platform', 'devices' and 'mesh_devices' (the jit mesh the C++ kernels see: the run's own
  mesh on this host, 1 for another target). Raises ConfigError for a choice that platform cannot run."""
  host = jax.default_backend()
  platform = platform or host
  if platform not in PLATFORMS:
    raise ValueError(f"--platform: {platform!r} is not one of {', '.join(PLATFORMS)}")
  devices = 1
  if platform == host and cfg.get("mesh", {}).get("parallelism", "jit") == "jit":
    try:
      devices = mesh_lib.make_mesh(cfg.mesh).size
    except (ValueError, ConfigError):   # a mesh this host cannot make: the checks below run without one
      devices = 1
  runtime = backends.resolve_runtime(cfg, mesh_devices=devices, platform=platform, quiet=True)
  return {**runtime.as_dict(), "reasons": list(runtime.reasons), "host_platform": host,
          "devices": devices_summary(), "mesh_devices": devices}


def format_kernel_report(r: dict[str, Any]) -> str:
  """The report as a few aligned lines (the reasons one per line)."""
  target = r["platform"] + ("" if r["platform"] == r["host_platform"] else f" (this host: {r['host_platform']})")
  attention = r["attention"] + (" (Pallas interpret mode)" if r["attention"] == "splash" and r["splash_interpret"]
                                else "")
  gmm = r["moe_gmm"] + (" (Pallas interpret mode)" if r["moe_interpret"] else "")
  if r["cpu_kernels"]:
    cpu = f"on (weight-gradient matmul {r['cpu_matmul']}, sgemm {r['cpu_blas']})"
  else:
    cpu = "off" if r["platform"] == "cpu" else "off (not a CPU)"
  rows = [("platform", target), ("devices", r["devices"]), ("backend", r["backend"]), ("attention", attention),
          ("MoE exchange", r["moe_exchange"]), ("MoE gmm", gmm), ("CPU kernels", cpu),
          ("decode layout", r["decode_layout"]), ("allocator", r["allocator"])]
  lines = [f"  {name:<15}{value}" for name, value in rows]
  lines += [f"  why: {reason}" for reason in r["reasons"]]
  return "\n".join(lines)
