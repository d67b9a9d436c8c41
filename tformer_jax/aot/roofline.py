"""A roofline prediction of one train step's time per device from its compiled HLO (`predict`).

  compute     each program XLA runs (a fusion, a kernel, an unfused op; `hlo.hlo_op_costs`, loops
              trip-counted): its dot / convolution / kernel FLOPs (`hlo.hlo_flops`'s count) / the peak
  HBM         its bytes read and written / the HBM bandwidth. Summed from the HLO rather than taken from
              the executable's cost_analysis()['bytes accessed']: that analysis counts a while-loop body
              once (a scanned stack's layers, collective-matmul loops), as its FLOPs do
  local       the sum over those programs of max(compute, HBM): within one kernel the two overlap (the
              roofline of each op); a compute-bound op's time counts as compute, a memory-bound one's as HBM
  collectives each one (`hlo.collective_instances`) by kind over the devices of its replica groups, mapped
              to the mesh axes they span and to the physical links: ICI along the torus dimensions the
              group spans (each dimension's links, twice with wraparound: a bidirectional ring), DCN when
              the group spans slices. Ring formulas for N devices, B the bytes `hlo_collectives` counts,
              W the group's bandwidth per device:
                all-gather (B gathered), reduce-scatter (B before)   B (N-1)/N / W
                all-reduce                                           2 B (N-1)/N / W
                all-to-all, ragged-all-to-all (B local)              B max((N-1)/N / W, sum_i (d_i/4) / W,
                                                                       max_i (d_i/4) / W_i)
              (an all-to-all's bytes travel d_i/4 hops on average along each torus dimension it spans, of d_i
              devices and W_i bandwidth a device: the hop bound over all the links and the bisection of the
              longest dimension; on one ring both are B N/4 / W)
                collective-permute (B sent)                          B / one link (DCN across slices)
              collectives do not overlap each other. A multi-slice program's text holds one slice's
              collectives only: the gradients' all-reduce across slices is added, modeled, over DCN
  step        two stated assumptions that bracket the truth. No overlap (sum): nothing runs at the same
              time, compute + HBM + collectives. Perfect overlap (max): each op's compute and HBM traffic
              overlap (its roofline) and communication is hidden under them, max(local, collectives).
              The bound: the largest of compute-bound ops, HBM-bound ops and collectives in the max.
  MFU         the model's FLOPs (analysis/flops.py's formula, no recompute) per device / step / peak.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from tformer_jax.analysis import hlo
from tformer_jax.aot.chips import Chip, chip_for


@dataclasses.dataclass
class Machine:
  """What the prediction needs of the devices one program runs on, per device. coords: each device's
  physical torus coordinates, slices its slice index, both in the program's device order (the mesh's
  devices, flattened); mesh_shape / mesh_axes: the mesh over that order."""
  name: str
  peak_flops: float
  hbm_bytes_per_s: float
  link_bytes_per_s: float = 0.0
  dcn_bytes_per_s: float = 0.0
  wrap_multiple: int = 0
  coords: Sequence[Sequence[int]] = ()
  slices: Sequence[int] = ()
  mesh_shape: Sequence[int] = ()
  mesh_axes: Sequence[str] = ()
  devices_per_chip: int = 1
  source: str = ""

  @property
  def physical_shape(self) -> list[int]:
    c = np.asarray(self.coords)
    return list(c.max(axis=0) - c.min(axis=0) + 1) if c.size else []


def tpu_machine(mesh: Any, devices_per_chip: int = 1) -> Machine | None:
  """The Machine of a jax Mesh over TPU topology devices, from the chip table (aot/chips.py); None for a
  device kind the table lacks."""
  devs = list(mesh.devices.flat)
  chip: Chip | None = chip_for(devs[0].device_kind)
  if chip is None:
    return None
  return Machine(name=chip.generation, peak_flops=chip.peak_bf16_flops / devices_per_chip,
                 hbm_bytes_per_s=chip.hbm_bytes_per_s / devices_per_chip, link_bytes_per_s=chip.ici_link_bytes_per_s,
                 dcn_bytes_per_s=chip.dcn_bytes_per_s, wrap_multiple=chip.wrap_multiple,
                 coords=[tuple(d.coords) for d in devs], slices=[int(getattr(d, "slice_index", 0)) for d in devs],
                 mesh_shape=tuple(mesh.devices.shape), mesh_axes=tuple(mesh.axis_names),
                 devices_per_chip=devices_per_chip, source=f"chip table {chip.generation} ({chip.sources})")


def _ring(kind: str, nbytes: float, n: int, bw: float) -> float:
  if n <= 1 or nbytes <= 0:
    return 0.0
  if bw <= 0:
    return float("inf")
  if kind == "all-reduce":
    return 2 * nbytes * (n - 1) / n / bw
  if kind in ("all-to-all", "ragged-all-to-all"):
    return nbytes * max((n - 1) / n, n / 4) / bw
  return nbytes * (n - 1) / n / bw


def group_links(group: Sequence[int], m: Machine) -> dict[str, Any]:
  """The mesh axes a device group spans, the ICI bandwidth per device along the torus dimensions it spans
  (each dimension's links, x2 with wraparound), its size within a slice and the slices it spans."""
  ids = np.asarray(group)
  axes = []
  if m.mesh_shape:
    mc = np.stack(np.unravel_index(ids, tuple(m.mesh_shape)), axis=1)
    axes = [a for a, col in zip(m.mesh_axes, mc.T) if len(set(col.tolist())) > 1]
  slices = len({m.slices[i] for i in group}) if m.slices else 1
  bw, shape, dims = 0.0, m.physical_shape, []
  if m.coords:
    pc = np.asarray([m.coords[i] for i in group])
    for d in range(pc.shape[1]):
      extent = len(set(pc[:, d].tolist()))
      if extent > 1:
        wrap = m.wrap_multiple and shape[d] % m.wrap_multiple == 0
        dims.append((extent, m.link_bytes_per_s * (2 if wrap else 1)))
        bw += dims[-1][1]
  return {"axes": axes, "ici_bytes_per_s": bw, "n_ici": len(group) // slices, "slices": slices, "dims": dims}


def _all_to_all_ici(nbytes: float, n: int, dims: list[tuple[int, float]], bw: float) -> float:
  """An all-to-all of `nbytes` a device over `n` devices spanning the torus dimensions `dims` ((devices,
  bandwidth a device) each; `bw` their sum): the module docstring's bound."""
  if n <= 1 or nbytes <= 0:
    return 0.0
  if not dims:
    return _ring("all-to-all", nbytes, n, bw)
  return nbytes * max((n - 1) / n / bw, sum(d / 4 for d, _ in dims) / bw, max(d / 4 / w for d, w in dims))


def collective_seconds(kind: str, nbytes: float, groups: list[list[int]] | None, m: Machine) -> tuple[float, str]:
  """(seconds, 'axes over link') of one execution of a collective of `kind` moving `nbytes` per device."""
  if not groups:
    return 0.0, "?"
  if kind == "collective-permute":
    pairs = [g for g in groups if len(g) == 2 and g[0] != g[1]]
    if not pairs:
      return 0.0, "-"
    links = [group_links(p, m) for p in pairs]
    axes = sorted({a for li in links for a in li["axes"]})
    if any(li["slices"] > 1 for li in links):
      return nbytes / m.dcn_bytes_per_s, f"{','.join(axes)} (DCN)"
    return nbytes / (m.link_bytes_per_s or float("nan")), f"{','.join(axes)} (ICI)"
  li = group_links(groups[0], m)
  # a group within one chip (v4's two TensorCores share coordinates): no link, the exchange goes through HBM
  if kind in ("all-to-all", "ragged-all-to-all") and li["ici_bytes_per_s"]:
    t = _all_to_all_ici(nbytes, li["n_ici"], li["dims"], li["ici_bytes_per_s"])
  else:
    t = _ring(kind, nbytes, li["n_ici"], li["ici_bytes_per_s"] or m.hbm_bytes_per_s)
  where = "ICI" if li["ici_bytes_per_s"] else "on chip"
  if li["slices"] > 1:      # the cross-slice part of a hierarchical ring, on the bytes left after the slice
    t += _ring(kind, nbytes / max(1, li["n_ici"]), li["slices"], m.dcn_bytes_per_s)
    where = "ICI+DCN" if li["n_ici"] > 1 else "DCN"
  return t, f"{','.join(li['axes']) or '-'} ({where})"


def predict(hlo_text: str, m: Machine, model_flops: float, tokens: float,
            slice_gradients: tuple[int, float] | None = None) -> dict[str, Any]:
  """The roofline of one execution of `hlo_text` on one device of `m` (module docstring). model_flops
  and tokens: per device per step (MFU and tokens/s/chip). slice_gradients: (slices, bytes per device)
  of a multi-slice step: XLA:TPU's multi-slice program shows only one slice's collectives (its replica
  groups stay within a slice; the DCN exchange is added outside the HLO text), so the data-parallel
  gradient all-reduce across the slices is added as modeled, over DCN, when no collective reaches DCN."""
  ops = hlo.hlo_op_costs(hlo_text)
  flops = sum(o["flops"] * o["times"] for o in ops)
  nbytes = sum(o["bytes"] * o["times"] for o in ops)
  compute_bound = memory_bound = 0.0
  for o in ops:
    tc, tm = o["flops"] / m.peak_flops, o["bytes"] / m.hbm_bytes_per_s
    if tc >= tm:
      compute_bound += tc * o["times"]
    else:
      memory_bound += tm * o["times"]
  n_dev = len(m.coords) or 1
  comm: dict[tuple[str, str], dict[str, float]] = {}
  for c in hlo.collective_instances(hlo_text):
    t, where = collective_seconds(c["kind"], c["bytes"], hlo.replica_groups(c["attrs"], n_dev), m)
    e = comm.setdefault((c["kind"], where), {"count": 0, "bytes": 0, "seconds": 0.0})
    e["count"] += c["times"]
    e["bytes"] += c["times"] * c["bytes"]
    e["seconds"] += c["times"] * t
  if slice_gradients and slice_gradients[0] > 1 and not any("DCN" in w for _, w in comm):
    n, grads = slice_gradients
    comm[("all-reduce", "data (DCN, modeled)")] = {"count": 1, "bytes": int(grads),
                                                   "seconds": _ring("all-reduce", grads, n, m.dcn_bytes_per_s)}
  comm_s = sum(e["seconds"] for e in comm.values())
  local = compute_bound + memory_bound
  steps = {"no_overlap": flops / m.peak_flops + nbytes / m.hbm_bytes_per_s + comm_s,
           "perfect_overlap": max(local, comm_s)}
  parts = {"compute": compute_bound, "HBM": memory_bound, "collectives": comm_s}
  out = {"machine": m.name, "source": m.source, "peak_flops": m.peak_flops, "hbm_bytes_per_s": m.hbm_bytes_per_s,
         "link_bytes_per_s": m.link_bytes_per_s, "dcn_bytes_per_s": m.dcn_bytes_per_s,
         "flops": flops, "hbm_bytes": nbytes, "compute_s": flops / m.peak_flops, "hbm_s": nbytes / m.hbm_bytes_per_s,
         "compute_bound_s": compute_bound, "memory_bound_s": memory_bound, "local_s": local,
         "collectives": [{"kind": k, "over": w, **v} for (k, w), v in sorted(comm.items())],
         "collectives_s": comm_s, "bound": max(parts, key=parts.get), "model_flops": model_flops, "tokens": tokens}
  for name, s in steps.items():
    out[f"step_s_{name}"] = s
    out[f"tokens_per_s_per_chip_{name}"] = tokens * m.devices_per_chip / s if s else None
    out[f"mfu_{name}"] = model_flops / s / m.peak_flops if s else None
  return out


def format_roofline(r: dict[str, Any]) -> list[str]:
  """The report's lines for a `predict` result."""
  def ms(s: float) -> str:
    return f"{1e3 * s:10.2f} ms"
  lines = [f"roofline per step per device ({r['source']}: {r['peak_flops'] / 1e12:.1f} TFLOP/s, HBM "
           f"{r['hbm_bytes_per_s'] / 1e9:.0f} GB/s"
           + (f", ICI {r['link_bytes_per_s'] / 1e9:.0f} GB/s a link one way, DCN {r['dcn_bytes_per_s'] / 1e9:.2f} GB/s"
              if r["link_bytes_per_s"] else "") + "):",
           f"  compute (HLO FLOPs / peak)  {ms(r['compute_s'])}   ({r['flops']:.4g} FLOPs)",
           f"  HBM (bytes / bandwidth)     {ms(r['hbm_s'])}   ({r['hbm_bytes'] / 2 ** 30:.2f} GiB read + written)",
           f"  each op at its own bound    {ms(r['local_s'])}   (compute-bound ops {1e3 * r['compute_bound_s']:.2f} "
           f"ms, HBM-bound {1e3 * r['memory_bound_s']:.2f} ms)"]
  for c in r["collectives"]:
    lines.append(f"  {c['kind']:<20} {c['over']:<22}{c['count']:6d} x  {c['bytes'] / 2 ** 30:8.3f} GiB"
                 f"  {ms(c['seconds'])}")
  lines.append(f"  collectives                 {ms(r['collectives_s'])}")
  for name, label in (("no_overlap", "no overlap (sum)"), ("perfect_overlap", "perfect overlap (max)")):
    s, mfu, tok = r[f"step_s_{name}"], r[f"mfu_{name}"], r[f"tokens_per_s_per_chip_{name}"]
    lines.append(f"  step, {label:<22}{ms(s)}   {tok:,.0f} tokens/s/chip, MFU {100 * mfu:.1f}%" if s else
                 f"  step, {label}: 0")
  lines.append(f"  bound: {r['bound']} (the largest of compute-bound ops, HBM-bound ops and collectives; no overlap "
               "= compute + HBM + collectives, perfect overlap = max(each op at its own bound, collectives))")
  return lines
