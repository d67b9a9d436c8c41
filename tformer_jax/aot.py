r"""Does this config compile and fit on that TPU topology? Ahead-of-time compilation on any host (a CPU).

  tformer-aot --config=configs/scale/llama_70b.py --topology=v5p:4x4x4
  python -m tformer_jax.aot --config=configs/scale/llama_8b.py --topology=v5e:4x4 --json=runs/aot_8b.json
  python -m tformer_jax.aot --config=configs/llama_tiny.py --topology=v5e:2x2 --num_slices=2 \
      --config.mesh.shape='(2,4,1)' --config.mesh.rules=fsdp

libtpu (the `tpu-aot` extra, `pip install -e ".[tpu-aot]"`: the wheel `jax[tpu]` pins for the installed
jax) describes a topology's devices with no TPU attached (`jax.experimental.topologies`). The mesh and
logical-axis rules are built from the config over those devices exactly as a run builds them
(`parallel.mesh.make_mesh`; several slices: a hybrid mesh whose 'data' axis spans the slices over DCN),
and `train.setup.build` gives the train step train/loop.py runs: same function, shardings, donation,
remat/scan, precision and optimizer state. It is lowered on abstract inputs (nothing is allocated) and
compiled by XLA:TPU for the topology.

Printed, per device: XLA's memory analysis (argument, output, aliased, temporary bytes, their sum, and
XLA:TPU's own peak, which `per_device_bytes` and `fits` use) against the chip's HBM (`HBM_GIB_PER_CHIP`);
the state's share of the arguments (parameters, optimizer, rest: sharded sizes computed from the
shardings; the remainder is TPU tile padding); tformer-estimate's per-device figure for the same mesh
(diagnostics/estimate.py `estimate_on_mesh`, nothing compiled) and its ratio to the peak; the step's
FLOPs from bench/flops.py's formula (with the remat policy's recompute), from the compiled HLO's dots,
convolutions and TPU kernels (`hlo_flops`: ragged_dot, megablox gmm, splash attention, by their operand
shapes; loops trip-counted) and from XLA's cost analysis (which counts a while-loop body once: scanned
layers, collective matmuls); their ratio HLO / formula per device, with a one-line WARNING above
`REPLICATED_RATIO` (devices repeating work instead of splitting it); and the collectives of the
compiled HLO (count and bytes per step, by kind: `hlo_collectives`). The last line is one JSON object
(`topology`, `devices`, `fits`, `per_device_bytes`, `hbm_bytes`, `estimate_bytes`, `estimate_ratio`,
`flops_ratio`, `replicated_work`, ...).

Exit status: 0 it fits; 3 it does not fit (XLA:TPU refuses a program larger than its HBM with
RESOURCE_EXHAUSTED: the figure it needed is reported); 2 a config or topology error (one line).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import re
import sys
import time
from typing import Any, Sequence

import jax
import ml_collections
from absl import flags
from jax.experimental import topologies

from tformer_jax import backends, cli_common
from tformer_jax.bench import flops as flops_lib
from tformer_jax.config import ConfigError
from tformer_jax.diagnostics import estimate as estimate_lib
from tformer_jax.parallel import mesh as mesh_lib
from tformer_jax.train import setup as setup_lib

PROG = "tformer-aot"
EXIT_FITS, EXIT_CONFIG, EXIT_NO_FIT = 0, 2, 3
GiB = 1024 ** 3

# HBM per chip in GiB, by the device_kind jax reports. Source: the Cloud TPU system architecture pages
# (cloud.google.com/tpu/docs/v4, /v5e, /v5p, /v6e, "HBM capacity per chip": v4 32, v5e 16, v5p 95,
# v6e (Trillium) 32). A v4 chip has two TensorCores, which a topology lists as two devices sharing the
# chip's HBM (`devices_per_chip`). XLA:TPU itself leaves a little of it to the runtime (it reports
# 15.75G available on a v5e): a program within a few hundred MiB of the figure may still be refused.
HBM_GIB_PER_CHIP = {"TPU v4": 32, "TPU v5 lite": 16, "TPU v5": 95, "TPU v6 lite": 32}
# TPU_ACCELERATOR_TYPE for a topology name's generation (libtpu wants it, and worker hostnames, at
# start-up; without them it prints warnings): f(chips) -> e.g. 'v5p-128' (v4/v5p count TensorCores).
ACCELERATOR_TYPES = {"v4": lambda chips: f"v4-{2 * chips}", "v5e": lambda chips: f"v5litepod-{chips}",
                     "v5litepod": lambda chips: f"v5litepod-{chips}", "v5p": lambda chips: f"v5p-{2 * chips}",
                     "v6e": lambda chips: f"v6e-{chips}"}
# HLO FLOPs per device above this multiple of the formula's share: the devices repeat work (a
# replicated expert or attention computation) instead of splitting it
REPLICATED_RATIO = 1.5
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "ragged-all-to-all", "collective-permute")


def define_flags(fv: flags.FlagValues) -> None:
  flags.DEFINE_string("topology", None, "TPU topology, GENERATION:SHAPE: v5e:2x2, v5e:4x4, v5e:16x16, v5p:4x4x4, "
                      "v4:4x4x4, v6e:16x16 (required)", flag_values=fv)
  flags.DEFINE_integer("num_slices", 1, "slices of that topology (multi-slice over DCN; the 'data' mesh axis "
                       "spans them)", flag_values=fv)
  flags.DEFINE_string("json", None, "also write the JSON report to this file", flag_values=fv)
  flags.DEFINE_string("hlo", None, "also write the compiled (per-device, optimized) HLO text to this file",
                      flag_values=fv)


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


# -- collectives in the compiled HLO ---------------------------------------------------------------------

_COMPUTATION = re.compile(r"^(ENTRY )?%([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.+?) ([a-z][\w\-]*)\((.*)$")
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16|c64|c128|f8e\w+)\[([\d,]*)\]")
_CALLS = re.compile(r"\b(calls|body|to_apply|condition)=%([\w.\-]+)")


def _array_bytes(shape_text: str) -> int:
  total = 0
  for dtype, dims in _ARRAY.findall(shape_text):
    bits = 1 if dtype == "pred" else 16 if dtype == "bf16" else 64 if dtype == "c64" else 128 if dtype == "c128" \
        else 8 if dtype.startswith("f8") else int(dtype[1:])
    total += math.prod(int(d) for d in dims.split(",") if d) * max(bits, 8) // 8
  return total


def _tuple_elements(shape_text: str) -> list[str]:
  """The top-level elements of a tuple shape '(a, (b, c), d)' (a plain array shape: itself)."""
  text = shape_text.strip()
  if not text.startswith("("):
    return [text]
  parts, depth, start = [], 0, 1
  for i, ch in enumerate(text):
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
      if depth == 0:
        parts.append(text[start:i])
        break
    elif ch == "," and depth == 1:
      parts.append(text[start:i])
      start = i + 1
  return [re.sub(r"/\*.*?\*/", "", p).strip() for p in parts]


def _group_size(attrs: str) -> int:
  """Participants per replica group: {{0,1,2,3},...}, [G,S]<=[N] (iota) or mesh['a'=4,'b'=2] {'a'}."""
  m = re.search(r"replica_groups=\{\{([\d,]*)\}", attrs)
  if m:
    return len(m.group(1).split(","))
  m = re.search(r"replica_groups=\[([\d,]+)\]<=", attrs)
  if m:
    return int(m.group(1).split(",")[-1])
  m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
  if m:
    sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", m.group(1))}
    return math.prod(sizes.get(a, 1) for a in re.findall(r"'([^']+)'", m.group(2)))
  return 1


def _operands(rest: str) -> list[str]:
  return re.findall(r"%([\w.\-]+)", rest.split(")")[0])


def _trip_count(while_rest: str, comps: dict[str, list[tuple[str, str, str, str]]], where: str) -> int:
  """Iterations of a while loop (`_loop_trips`), 1 when they are not known statically."""
  return _loop_trips(while_rest, comps, where) or 1


def _loop_trips(while_rest: str, comps: dict[str, list[tuple[str, str, str, str]]], where: str) -> int | None:
  """Iterations of a while loop (in computation `where`): its known_trip_count, else from the loop
  counter: the condition's `counter < N`, the body's `counter + step` and the counter's initial constant
  (XLA:TPU's collective-matmul loops step by 2). None when the pattern is not there (a bound computed at
  run time, e.g. a causal loop over the visible key blocks)."""
  known = re.search(r"known_trip_count\D*(\d+)", while_rest)
  if known:
    return int(known.group(1))
  cond = re.search(r"condition=%([\w.\-]+)", while_rest)
  body = re.search(r"body=%([\w.\-]+)", while_rest)
  if not cond or not body:
    return None

  def table(comp: str) -> dict[str, tuple[str, str]]:
    return {name: (op, rest) for name, _, op, rest in comps.get(comp, [])}

  def const(t: dict, name: str) -> int | None:
    op, rest = t.get(name, ("", ""))
    m = re.match(r"(-?\d+)\)", rest) if op == "constant" else None
    return int(m.group(1)) if m else None

  def index(t: dict, name: str) -> int | None:
    op, rest = t.get(name, ("", ""))
    m = re.search(r"index=(\d+)", rest) if op == "get-tuple-element" else None
    return int(m.group(1)) if m else None

  ct = table(cond.group(1))
  counter = bound = None
  for op, rest in ct.values():
    if op == "compare" and "direction=LT" in rest:
      a, b = (_operands(rest) + [None, None])[:2]
      counter, bound = index(ct, a), const(ct, b)
  if counter is None or bound is None:
    return None
  step, start = 1, 0
  bt = table(body.group(1))
  root = [rest for name, _, op, rest in comps.get(body.group(1), []) if op == "tuple"]
  if root:
    elems = _operands(root[-1])
    if counter < len(elems) and bt.get(elems[counter], ("",))[0] == "add":
      adds = _operands(bt[elems[counter]][1])
      steps = [const(bt, a) for a in adds if const(bt, a) is not None]
      step = steps[0] if steps and steps[0] > 0 else 1
  init = _operands(while_rest)
  wt = table(where)
  if init and wt.get(init[0], ("",))[0] == "tuple":
    elems = _operands(wt[init[0]][1])
    c = const(wt, elems[counter]) if counter < len(elems) else None
    start = c if c is not None else 0
  return max(1, -(-(bound - start) // step))


Instr = tuple[str, str, str, str]   # (name, shape, opcode, the rest of the line)


def _logical_lines(hlo_text: str):
  """The lines of an HLO module's text with each instruction on one: a Pallas kernel's attributes
  (splash attention's kernel_metadata) span several lines, one of which starts with '}'."""
  pending = ""
  for line in hlo_text.splitlines():
    if pending and (_INSTRUCTION.match(line) or _COMPUTATION.match(line)):
      yield pending                    # unbalanced braces in a string: never swallow the next instruction
      pending = ""
    if pending:
      pending += " " + line
    elif _INSTRUCTION.match(line):
      pending = line
    else:
      yield line
      continue
    if pending.count("{") <= pending.count("}"):
      yield pending
      pending = ""
  if pending:
    yield pending


def parse_hlo(hlo_text: str) -> tuple[dict[str, list[Instr]], str | None]:
  """({computation: its instructions}, the ENTRY computation's name) of an HLO module's text."""
  comps: dict[str, list[Instr]] = {}
  entry, current = None, None
  for line in _logical_lines(hlo_text):
    m = _COMPUTATION.match(line)
    if m:
      current = m.group(2)
      comps[current] = []
      entry = current if m.group(1) else entry
    elif line.startswith("}"):
      current = None
    elif current is not None:
      mi = _INSTRUCTION.match(line)
      if mi:
        comps[current].append(mi.groups())
  return comps, entry


def _executed(comps: dict[str, list[Instr]], entry: str | None):
  """(computation, instruction, executions per run) for every instruction reached from ENTRY: a while
  body runs its trip count times (`_trip_count`), fused and called computations once per call
  (reduction bodies and loop conditions are not walked)."""
  def walk(name: str, times: int, stack: tuple[str, ...]):
    if name in stack:
      return
    for ins in comps.get(name, []):
      yield name, ins, times
      rest = ins[3]
      for attr, callee in _CALLS.findall(rest):
        if attr in ("calls", "body"):
          yield from walk(callee, times * (_trip_count(rest, comps, name) if attr == "body" else 1), stack + (name,))
      branches = re.search(r"branch_computations=\{([^}]*)\}", rest)
      for callee in (branches.group(1).split(",") if branches else ()):
        yield from walk(callee.strip().lstrip("%"), times, stack + (name,))
  if entry is not None:
    yield from walk(entry, 1, ())


def hlo_collectives(hlo_text: str) -> dict[str, dict[str, int]]:
  """{kind: {'count', 'bytes'}} of the collectives one execution of a compiled HLO module runs (per
  device), trip counts included (`_executed`). XLA:TPU repeats an asynchronous collective inside the
  fusions that overlap it with compute (same channel_id): each channel counts once; its reduce-scatter
  is a fusion named 'all-reduce-scatter' around an all-reduce; the all-gathers and reduce-scatters it
  folds into matmuls (collective matmul, 'windowed einsum' loops) are rings of collective-permutes.
  bytes: the full buffer per device (all-gather: the gathered output; reduce-scatter: the input;
  all-reduce, all-to-all, collective-permute: the operand; ragged-all-to-all: its output buffer, what
  can arrive)."""
  seen: dict[Any, list] = {}   # key -> [kind, bytes, executions]
  for comp, (instr, shape, op, rest), times in _executed(*parse_hlo(hlo_text)):
    kind = op[:-len("-start")] if op.endswith("-start") else op
    if kind not in COLLECTIVES:
      continue
    parts = _tuple_elements(shape) if op.endswith("-start") else [shape]
    # an async start's shape is (operands..., outputs..., context): all-gather counts its output
    nbytes = _array_bytes(parts[1] if kind == "all-gather" and len(parts) > 1 else parts[0])
    if kind == "all-reduce" and "reduce-scatter" in comp:
      kind = "reduce-scatter"
    elif kind == "reduce-scatter":
      nbytes *= _group_size(rest)
    ch = re.search(r"channel_id=(\d+)", rest)
    # ragged all-to-alls (an expert-parallel exchange) share one channel id: each instruction counts
    key = ("channel", int(ch.group(1))) if ch and kind != "ragged-all-to-all" else (comp, instr)
    entry = seen.setdefault(key, [kind, nbytes, 0])
    entry[2] = max(entry[2], times)
  out = {k: {"count": 0, "bytes": 0} for k in COLLECTIVES}
  for kind, nbytes, times in seen.values():
    out[kind]["count"] += times
    out[kind]["bytes"] += times * nbytes
  return out


def _dims(shape_text: str) -> list[int]:
  m = _ARRAY.search(shape_text)
  return [int(d) for d in m.group(2).split(",") if d] if m else []


def _valid_taps(n_in: int, n_out: int, window: int, lo: int, stride: int, lhs_dilate: int, rhs_dilate: int) -> int:
  """Window taps, summed over the output positions of one spatial dimension, that land on a real input
  element (not padding, not a dilation hole): XLA:TPU writes many dots as convolutions whose padded
  windows touch zeros."""
  last, total = (n_in - 1) * lhs_dilate, 0
  for t in range(window):
    c = t * rhs_dilate - lo                      # input position of output j: j * stride + c
    if lhs_dilate == 1:
      first = (-c + stride - 1) // stride if c < 0 else 0
      hi = min(n_out - 1, (last - c) // stride) if last >= c else -1
      total += max(0, hi - first + 1)
    else:
      total += sum(1 for j in range(n_out) if 0 <= j * stride + c <= last and (j * stride + c) % lhs_dilate == 0)
  return total


def _conv_macs(lhs: list[int], rhs: list[int], out: list[int], attrs: str) -> int:
  labels = re.search(r"dim_labels=([^_]+)_([^-]+)->([\w]+)", attrs)
  if not labels or not lhs or not rhs or not out:
    return 0
  l_lab, r_lab, o_lab = labels.groups()
  win = re.search(r"window=\{([^}]*)\}", attrs)
  fields = dict(f.split("=", 1) for f in win.group(1).split()) if win else {}

  spatial = sum(ch.isdigit() for ch in l_lab)

  def per_dim(key: str, default: int) -> list[int]:
    return [int(x) for x in fields[key].split("x")] if key in fields else [default] * spatial
  size, stride, ldil, rdil = (per_dim(k, 1) for k in ("size", "stride", "lhs_dilate", "rhs_dilate"))
  pads = [tuple(int(v) for v in x.split("_")) for x in fields["pad"].split("x")] if "pad" in fields \
      else [(0, 0)] * spatial
  macs = out[o_lab.index("b")] * out[o_lab.index("f")] * rhs[r_lab.index("i")]
  for k in range(spatial):
    d = str(k)
    macs *= _valid_taps(lhs[l_lab.index(d)], out[o_lab.index(d)], size[k], pads[k][0], stride[k], ldil[k], rdil[k])
  return macs


FLOAT_DTYPES = ("f16", "bf16", "f32", "f64", "f8")
HLO_FLOPS_PARTS = ("dot", "convolution", "ragged_dot", "gmm", "splash_attention", "other_kernels")


def _float_arrays(text: str) -> list[list[int]]:
  """The dims of each floating-point array in a list of shapes, in order."""
  return [[int(d) for d in dims.split(",") if d] for dtype, dims in _ARRAY.findall(text)
          if dtype.startswith(FLOAT_DTYPES)]


def _kernel_flops(name: str, shape: str, rest: str, operand_shapes: str) -> tuple[str, float | None]:
  """(part, FLOPs) of one TPU kernel call (custom-call 'tpu_custom_call'), by its operand shapes; None
  for a kernel with floating-point operands that is not recognised and carries no cost estimate.
  The kernel is named by the instruction, its op_name metadata (Pallas: the pallas_call's name) or
  XLA's own 'ragged-dot':
    ragged_dot, megablox gmm / tgmm   2 x lhs elements x the output's last dim: (m x k) @ (k x n) per row
                                      group, over every row of the buffer (padding rows included)
    splash attention                  per Sq x Skv x head_dim matmul unit 2 x q elements x Skv: forward 2
                                      units (QK^T, PV), the dq kernel 2 (dP, dQ), dkv 2 (dK, dV; 4 when it
                                      also forms dq, the fused backward): the formula's convention (c = 1, the
                                      whole square; the kernel's skipped masked blocks and its recompute of the
                                      scores in the backward are not counted)
    any other kernel                  its Pallas cost estimate (backend_config cost_estimate.flops)."""
  op_name = re.search(r'op_name="([^"]*)"', rest)
  label = f"{name} {op_name.group(1) if op_name else ''}"
  floats = _float_arrays(operand_shapes)
  out = _float_arrays(shape)
  if not floats or not out:
    return "other_kernels", 0.0                         # index/metadata kernels: no arithmetic on floats
  if re.search(r"splash_(mha|mqa)_(fwd|dq|dkv)", label):
    phase = re.search(r"splash_(?:mha|mqa)_(fwd|dq|dkv)", label).group(1)
    q, k = floats[0], (floats[1] if len(floats) > 1 else floats[0])
    k_layout = re.search(r'k_layout\W+(\d)', rest)
    s_kv = k[-1] if k_layout and k_layout.group(1) == "2" else k[-2]
    unit = 2.0 * math.prod(q) * s_kv
    if phase == "dkv":
      grads = sum(1 for o in out if o[-len(q):] == q or o[-len(k):] == k)
      return "splash_attention", unit * (4 if grads >= 3 else 2)
    return "splash_attention", 2 * unit
  if "ragged-dot" in label or "ragged_dot" in label:
    return "ragged_dot", 2.0 * math.prod(floats[0]) * out[0][-1]
  if re.search(r"\bt?gmm\b|jit\(t?gmm\)|_t?gmm_", label):
    return "gmm", 2.0 * math.prod(floats[0]) * out[0][-1]
  estimate = re.search(r'"cost_estimate":\{"flops":"(\d+)"', rest)
  return "other_kernels", (float(estimate.group(1)) if estimate else None)


def hlo_flops(hlo_text: str) -> dict[str, Any]:
  """FLOPs of the matmul-like work one execution of a compiled HLO module runs (per device), trip counts
  included, by part (`HLO_FLOPS_PARTS`) and their 'total': 2 x the multiply-adds of the dots (output
  elements x contracted size) and convolutions (output elements x input features x the window taps on
  real input, `_valid_taps`), and the TPU kernels (`_kernel_flops`: ragged_dot, megablox, splash
  attention); 'uncounted': the names of kernel calls whose FLOPs are not known; 'dynamic_loops': the
  loops holding matmuls whose trip count is set at run time (blockwise attention's causal loop over the
  visible key blocks), counted once: the total is short of what runs. XLA's cost analysis counts each
  while-loop body once (scanned layers, XLA:TPU's collective-matmul loops): this does not."""
  comps, entry = parse_hlo(hlo_text)
  shapes = {(c, name): shape for c, ins in comps.items() for name, shape, _, _ in ins}
  parts = dict.fromkeys(HLO_FLOPS_PARTS, 0.0)
  uncounted: set[str] = set()
  dynamic_loops = 0
  for comp, (name, shape, op, rest), times in _executed(comps, entry):
    if op == "while" and _loop_trips(rest, comps, comp) is None:
      body = re.search(r"body=%([\w.\-]+)", rest)
      dynamic_loops += bool(body and _holds_matmuls(comps, body.group(1)))
    if op not in ("dot", "convolution", "custom-call"):
      continue
    operands = _operands(rest)
    if op == "custom-call":
      if 'custom_call_target="tpu_custom_call"' not in rest:
        continue
      layouts = re.search(r"operand_layout_constraints=\{(.*?)\}, (?:\w+=)", rest)
      operand_shapes = layouts.group(1) if layouts else ", ".join(shapes.get((comp, o), "") for o in operands)
      part, flops = _kernel_flops(name, shape, rest, operand_shapes)
      if flops is None:
        uncounted.add(name)
        continue
      parts[part] += flops * times
      continue
    if len(operands) < 2:
      continue
    lhs, rhs = (_dims(shapes.get((comp, o), "")) for o in operands[:2])
    out = _dims(_tuple_elements(shape)[0])
    if op == "dot":
      m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest)
      macs = math.prod(out) * (math.prod(lhs[int(d)] for d in m.group(1).split(",") if d) if m and lhs else 0)
    else:
      macs = _conv_macs(lhs, rhs, out, rest)
    parts[op] += 2.0 * macs * times
  return parts | {"total": sum(parts.values()), "uncounted": sorted(uncounted), "dynamic_loops": dynamic_loops}


def _holds_matmuls(comps: dict[str, list[Instr]], name: str, seen: frozenset = frozenset()) -> bool:
  """Whether computation `name` (or one it calls) runs a dot, convolution or TPU kernel."""
  for _, _, op, rest in comps.get(name, []):
    if op in ("dot", "convolution") or 'custom_call_target="tpu_custom_call"' in rest:
      return True
    for attr, callee in _CALLS.findall(rest):
      if attr in ("calls", "body") and callee not in seen and _holds_matmuls(comps, callee, seen | {name}):
        return True
  return False


def hlo_matmul_flops(hlo_text: str) -> float:
  """The total of `hlo_flops`: every dot, convolution and TPU matmul kernel, loops trip-counted."""
  return hlo_flops(hlo_text)["total"]


# -- the compile ------------------------------------------------------------------------------------------

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
  """bench/flops.py's step FLOPs (6*N_matmul*T + 12*n*h*hd*S*T: the attention scores over all S keys, as
  the 'xla' attention computes them) and `with_recompute`: what the compiled step executes with the
  remat policy's recomputed forward (remat 'full': x 4/3 on the layers)."""
  return flops_lib.with_recompute(m, batch, seq, "full")


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


def _estimate(cfg: ml_collections.ConfigDict, devices: int, state: dict[str, int]) -> dict[str, Any]:
  """tformer-estimate's per-device peak for this mesh (diagnostics/estimate.py: nothing compiled),
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
  if hlo_path:
    with open(hlo_path, "w") as f:
      f.write(text)
  return report


# -- the report --------------------------------------------------------------------------------------------

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
                   "recomputed forward, bench/flops.py)")
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
  return "\n".join(lines)


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
          "collectives": r.collectives, "compile_s": round(r.compile_s, 1), "compiler_error": r.compiler_error}


def main(argv: Sequence[str] | None = None) -> int:
  args = cli_common.parse(argv, define_flags, doc=__doc__, prog=PROG, config="required")
  if not args.topology:
    cli_common.fail("pass --topology=GENERATION:SHAPE (e.g. v5e:2x2, v5p:4x4x4)")
  if not os.environ.get("JAX_PLATFORMS"):
    jax.config.update("jax_platforms", "cpu")   # this host's devices are not used (and libtpu would probe)
  report = compile_for_topology(args.config, args.topology, args.num_slices, hlo_path=args.hlo)
  print(format_report(report))
  out = summary(report)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(report.as_dict() | out, f, indent=2)
  print(json.dumps(out), flush=True)
  return EXIT_FITS if report.fits else EXIT_NO_FIT


def entry() -> None:
  """The `tformer-aot` console command: anticipated errors are one line and exit status 2."""
  sys.exit(cli_common.run_main(main))


if __name__ == "__main__":
  entry()
