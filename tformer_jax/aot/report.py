"""What a topology compile found (`Report`), as the printed table and the JSON summary line."""
from __future__ import annotations

import dataclasses
from typing import Any

from tformer_jax.analysis.hlo import HLO_FLOPS_PARTS
from tformer_jax.aot.roofline import format_roofline
from tformer_jax.aot.topology import GiB

# HLO FLOPs per device above this multiple of the formula's share: the devices repeat work (a
# replicated expert or attention computation) instead of splitting it
REPLICATED_RATIO = 1.5


@dataclasses.dataclass
class Report:
  topology: str
  num_slices: int
  devices: int
  device_kind: str
  mesh: dict[str, int]
  rules: Any
  runtime: str
  hbm_bytes: int | None
  state_bytes: dict[str, int]              # per device, computed from the shardings (no TPU tile padding)
  batch_bytes: int
  fits: bool = False
  memory: dict[str, int] = dataclasses.field(default_factory=dict)   # XLA memory_analysis, per device
  per_device_bytes: int | None = None
  compiler_error: str = ""
  flops_xla: float | None = None           # per device: XLA's cost analysis (a while-loop body counted once)
  flops_hlo: float | None = None           # per device: dots, convolutions and TPU kernels, trip-counted
  flops_hlo_parts: dict[str, Any] = dataclasses.field(default_factory=dict)   # `hlo_flops`, by part
  flops_formula: dict[str, Any] = dataclasses.field(default_factory=dict)
  collectives: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
  estimate: dict[str, Any] = dataclasses.field(default_factory=dict)   # tformer-estimate's per-device figure
  roofline: dict[str, Any] = dataclasses.field(default_factory=dict)   # aot/roofline.py `predict`, per device
  lower_s: float = 0.0
  compile_s: float = 0.0

  def as_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @property
  def flops_ratio(self) -> float | None:
    """HLO FLOPs per device / (the formula with recompute / devices): about 1 when the devices split
    the work; well above it (> `REPLICATED_RATIO`) when they repeat it."""
    f = self.flops_formula.get("with_recompute") if self.flops_formula else None
    return None if not f or self.flops_hlo is None else self.flops_hlo / (f / self.devices)


def format_report(r: Report) -> str:
  slices = f" x {r.num_slices} slices" if r.num_slices > 1 else ""
  unit, scale = ("GiB", GiB) if max(r.per_device_bytes or 0, r.hbm_bytes or 0) >= GiB else ("MiB", 2 ** 20)

  def b(x: float | None) -> str:
    return "        ?" if x is None else f"{x / scale:9.2f}"

  hbm = "unknown" if r.hbm_bytes is None else f"{r.hbm_bytes / GiB:.2f} GiB"
  lines = [f"topology {r.topology}{slices}: {r.devices} devices ({r.device_kind}), HBM per device {hbm}",
           f"mesh {r.mesh}, rules {r.rules!r}; {r.runtime}",
           f"lowered in {r.lower_s:.1f} s, compiled in {r.compile_s:.1f} s", "",
           f"per device                          {unit}"]
  s = r.state_bytes
  if r.memory:
    mem = r.memory
    lines += [f"  arguments                   {b(mem['argument'])}",
              f"    params (sharded)          {b(s['params'])}",
              f"    optimizer state           {b(s['opt_state'])}",
              f"    rest of the state         {b(s['other'])}",
              f"    batch                     {b(r.batch_bytes)}",
              f"    TPU tile padding          {b(mem['argument'] - sum(s.values()) - r.batch_bytes)}",
              f"  outputs                     {b(mem['output'])}",
              f"  aliased (donated state)     {b(-mem['alias'])}",
              f"  temporaries                 {b(mem['temp'])}",
              f"  sum                         {b(mem['sum'])}   (arguments + outputs + temporaries - aliased)",
              f"  XLA:TPU peak                {b(mem['peak'] or None)}   (the compiler's own figure: the program "
              f"and runtime reservation included)"]
  else:
    lines += [f"  params (sharded)            {b(s['params'])}",
              f"  optimizer state             {b(s['opt_state'])}",
              f"  XLA:TPU needs               {b(r.per_device_bytes)}   ({r.compiler_error})"]
  if r.estimate.get("bytes") and r.per_device_bytes:
    lines.append(f"  tformer-estimate            {b(r.estimate['bytes'])}   (estimate / XLA:TPU "
                 f"{'peak' if r.memory else 'needs'}: {r.estimate['bytes'] / r.per_device_bytes:.3f})")
  share = ("" if not r.hbm_bytes or r.per_device_bytes is None
           else f"   ({100 * r.per_device_bytes / r.hbm_bytes:.1f}% used)")
  lines += [f"  HBM                         {b(r.hbm_bytes)}{share}",
            f"  fits: {'yes' if r.fits else 'NO'}", ""]
  f = r.flops_formula
  if f:
    n = r.devices
    lines += ["FLOPs per step per device:",
              f"  formula                     {f['flops_per_step'] / n:10.4g}   ({f['formula']}, / {n} devices)"]
    if f["with_recompute"] != f["flops_per_step"]:
      lines.append(f"  formula with recompute      {f['with_recompute'] / n:10.4g}   (remat {f['remat']!r}: the "
                   "recomputed forward, analysis/flops.py)")
    if r.flops_hlo is not None:
      which = "formula with recompute" if f["with_recompute"] != f["flops_per_step"] else "formula"
      lines.append(f"  HLO matmuls and kernels     {r.flops_hlo:10.4g}   (loops trip-counted; / {which}: "
                   f"{r.flops_ratio:.3f})")
      p = r.flops_hlo_parts
      lines.append("    " + ", ".join(f"{k} {p[k]:.4g}" for k in HLO_FLOPS_PARTS if p.get(k))
                   + (f"; not counted: {len(p['uncounted'])} kernel(s) {', '.join(p['uncounted'][:3])}"
                      if p.get("uncounted") else "")
                   + (f"; {p['dynamic_loops']} loop(s) with a run-time trip count counted once (short of what "
                      "runs)" if p.get("dynamic_loops") else ""))
      if r.flops_ratio > REPLICATED_RATIO:
        lines.append(f"WARNING: per-device HLO FLOPs are {r.flops_ratio:.2f}x the {which} / {n} devices "
                     f"(> {REPLICATED_RATIO}): the devices repeat work instead of splitting it")
    if r.flops_xla is not None:
      lines.append(f"  XLA cost analysis           {r.flops_xla:10.4g}   (counts a while-loop body once: scanned "
                   "layers, collective-matmul loops)")
  if r.collectives:
    lines.append("collectives per step per device (count, bytes of the full buffer):")
    for kind, c in r.collectives.items():
      lines.append(f"  {kind:<20}{c['count']:6d}  {c['bytes'] / GiB:10.3f} GiB")
  if r.roofline:
    lines += ["", *format_roofline(r.roofline)]
  return "\n".join(lines)


def _prediction(rf: dict[str, Any]) -> dict[str, Any]:
  """The roofline's headline figures, flat in the JSON line."""
  keys = ("step_s_no_overlap", "step_s_perfect_overlap", "mfu_no_overlap", "mfu_perfect_overlap",
          "tokens_per_s_per_chip_no_overlap", "tokens_per_s_per_chip_perfect_overlap", "bound")
  return {f"predicted_{k}": rf.get(k) for k in keys} if rf else {}


def summary(r: Report) -> dict[str, Any]:
  """The JSON line: the fields a script needs (the whole report is `Report.as_dict()`)."""
  return {"topology": r.topology, "num_slices": r.num_slices, "devices": r.devices, "device_kind": r.device_kind,
          "mesh": r.mesh, "fits": r.fits, "per_device_bytes": r.per_device_bytes, "hbm_bytes": r.hbm_bytes,
          "memory": r.memory, "state_bytes": r.state_bytes, "batch_bytes": r.batch_bytes,
          "flops_xla_per_device": r.flops_xla,
          "flops_formula_per_device": (r.flops_formula["flops_per_step"] / r.devices) if r.flops_formula else None,
          "flops_formula_with_recompute_per_device": (r.flops_formula["with_recompute"] / r.devices
                                                      if r.flops_formula else None),
          "flops_hlo_per_device": r.flops_hlo,
          "flops_hlo_parts_per_device": r.flops_hlo_parts,
          "flops_ratio": r.flops_ratio, "replicated_work": bool(r.flops_ratio and r.flops_ratio > REPLICATED_RATIO),
          "estimate_bytes": r.estimate.get("bytes"),
          "estimate_ratio": (r.estimate["bytes"] / r.per_device_bytes
                             if r.estimate.get("bytes") and r.per_device_bytes else None),
          "collectives": r.collectives, "roofline": r.roofline or None,
          **_prediction(r.roofline), "compile_s": round(r.compile_s, 1), "compiler_error": r.compiler_error}

