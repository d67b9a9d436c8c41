"""An optimized HLO module's text, read: its computations and instructions (`parse_hlo`), what executes
how often (while loops trip-counted), the collectives by kind and bytes (`hlo_collectives`), and the
FLOPs of its dots, convolutions and TPU kernels (`hlo_flops`: ragged_dot, megablox gmm, splash attention
by their operand shapes). Shared by tformer-aot, the MoE tests and bench/op_profile.py."""
from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "ragged-all-to-all", "collective-permute")

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


def _executed(comps: dict[str, list[Instr]], entry: str | None, into_fusions: bool = True):
  """(computation, instruction, executions per run) for every instruction reached from ENTRY: a while
  body runs its trip count times (`_trip_count`), fused and called computations once per call
  (reduction bodies and loop conditions are not walked). into_fusions=False: the instructions that run
  as one program each (a fusion and a kernel call, not what they hold): what reads and writes HBM."""
  def walk(name: str, times: int, stack: tuple[str, ...]):
    if name in stack:
      return
    for ins in comps.get(name, []):
      yield name, ins, times
      rest = ins[3]
      if not into_fusions and ins[2] in ("fusion", "custom-call"):
        continue
      for attr, callee in _CALLS.findall(rest):
        if attr in ("calls", "body"):
          yield from walk(callee, times * (_trip_count(rest, comps, name) if attr == "body" else 1), stack + (name,))
      branches = re.search(r"branch_computations=\{([^}]*)\}", rest)
      for callee in (branches.group(1).split(",") if branches else ()):
        yield from walk(callee.strip().lstrip("%"), times, stack + (name,))
  if entry is not None:
    yield from walk(entry, 1, ())


def collective_instances(hlo_text: str) -> list[dict[str, Any]]:
  """Each collective one execution of a compiled HLO module runs (per device), as `hlo_collectives`
  counts them (one per channel): {'kind', 'bytes' (one execution), 'times' (executions per step),
  'attrs' (the rest of its line: replica_groups / source_target_pairs)}."""
  seen: dict[Any, dict[str, Any]] = {}
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
    entry = seen.setdefault(key, {"kind": kind, "bytes": nbytes, "times": 0, "attrs": rest})
    entry["times"] = max(entry["times"], times)
  return list(seen.values())


def hlo_collectives(hlo_text: str) -> dict[str, dict[str, int]]:
  """{kind: {'count', 'bytes'}} of the collectives one execution of a compiled HLO module runs (per
  device), trip counts included (`_executed`). XLA:TPU repeats an asynchronous collective inside the
  fusions that overlap it with compute (same channel_id): each channel counts once; its reduce-scatter
  is a fusion named 'all-reduce-scatter' around an all-reduce; the all-gathers and reduce-scatters it
  folds into matmuls (collective matmul, 'windowed einsum' loops) are rings of collective-permutes.
  bytes: the full buffer per device (all-gather: the gathered output; reduce-scatter: the input;
  all-reduce, all-to-all, collective-permute: the operand; ragged-all-to-all: its output buffer, what
  can arrive)."""
  out = {k: {"count": 0, "bytes": 0} for k in COLLECTIVES}
  for c in collective_instances(hlo_text):
    out[c["kind"]]["count"] += c["times"]
    out[c["kind"]]["bytes"] += c["times"] * c["bytes"]
  return out


def replica_groups(attrs: str, num_devices: int) -> list[list[int]]:
  """The device groups of a collective's attributes: explicit {{0,1},{2,3}}, iota [G,S]<=[dims]T(perm)
  (an iota over dims, transposed by perm, read as G groups of S), or {} / none (one group of all
  `num_devices`); a collective-permute's source_target_pairs as [source, target] pairs. None for a form
  not read here (a named mesh['a'=4] {'a'})."""
  m = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", attrs)
  if m:
    return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(1))]
  m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
  if m:
    shape = [int(x) for x in m.group(1).split(",")]
    dims = [int(x) for x in m.group(2).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(3):
      ids = ids.transpose([int(x) for x in m.group(3).split(",")])
    return ids.reshape(-1, shape[-1]).tolist()
  m = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", attrs)
  if m:
    groups = [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
    return [g for g in groups if g] or [list(range(num_devices))]
  m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?\s*"
                r"\{([^}]*)\}", attrs)
  if m:                 # a named mesh over the devices (an iota, or device_ids: an iota transposed), grouped by axes
    names, sizes = zip(*[(k, int(v)) for k, v in re.findall(r"'([^']+)'=(\d+)", m.group(1))])
    dims = [int(x) for x in m.group(2).split(",")] if m.group(2) else [math.prod(sizes)]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(3):
      ids = ids.transpose([int(x) for x in m.group(3).split(",")])
    ids = ids.reshape(sizes)
    grouped = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(4)) if a in names]
    rest = [i for i in range(len(names)) if i not in grouped]
    return ids.transpose(rest + grouped).reshape(-1, math.prod(sizes[i] for i in grouped) or 1).tolist()
  return [list(range(num_devices))]


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
                                      whole square; the kernel's skipped causal blocks and its recompute of the
                                      scores in the backward are not counted); a sliding-window kernel, named
                                      'splash_window_blocks_<v>_of_<n>' by backends/splash.py, counts the v
                                      tiles of n its mask visits
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
    band = re.search(r"splash_window_blocks_(\d+)_of_(\d+)", label)   # a sliding window's visited tiles
    if band:
      unit *= int(band.group(1)) / int(band.group(2))
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


def _library_flops(comp: str, ins: Instr, shapes: dict[tuple[str, str], str]) -> tuple[str, float] | None:
  """(part, FLOPs) of a library call: this project's XLA:CPU kernels (`tfj_matmul`, `tfj_chunked_attention_*`),
  an XLA:GPU cuBLAS / cuBLASLt GEMM ('__cublas$gemm',
  '__cublas$lt$matmul': 2 x output elements x the contracted size of its backend_config's
  dot_dimension_numbers) or a cuDNN attention ('__cudnn$fmha...', q and k in (batch, seq, heads, head_dim):
  the splash convention, forward 2 units of 2 x q elements x Skv, backward 4); None for any other call."""
  name, shape, op, rest = ins
  target = re.search(r'custom_call_target="([^"]+)"', rest)
  target = target.group(1) if target else ""
  operands = [_dims(shapes.get((comp, o), "")) for o in _operands(rest)]
  if target.startswith("__cublas"):
    out = _dims(_tuple_elements(shape)[0])
    contracting = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', rest)
    if not operands or not operands[0] or not contracting:
      return "dot", 0.0
    k = math.prod(operands[0][int(d.strip('" '))] for d in contracting.group(1).split(",") if d.strip('" '))
    return "dot", 2.0 * math.prod(out) * k
  if target == "tfj_matmul" and len(operands) == 2 and all(len(o) == 2 for o in operands):
    a = operands[0]
    k = a[0] if re.search(r"transpose_a = true", rest) else a[1]
    return "dot", 2.0 * math.prod(_dims(shape)) * k
  if target.startswith("tfj_chunked_attention") and len(operands) >= 5:
    # this project's CPU kernel (backends/cpu/kernels): the probabilities it packs (b, h, rows x keys it computes:
    # the causal chunks only) give its work; forward 2 units (scores, P V), backward 4 (dP, dV, dQ, dK)
    fwd = target.endswith("_fwd")
    packed = _dims(_tuple_elements(shape)[1]) if fwd else operands[4]
    d = operands[0][-1]
    return "other_kernels", 2.0 * math.prod(packed) * d * (2 if fwd else 4)
  if target.startswith("__cudnn$fmha") and len(operands) >= 2 and len(operands[1]) == 4:
    unit = 2.0 * math.prod(operands[0]) * operands[1][1]
    return "other_kernels", unit * (4 if "Backward" in target else 2)
  return None


def _instr_flops(comp: str, ins: Instr, shapes: dict[tuple[str, str], str]) -> tuple[str, float | None]:
  """(part, FLOPs of one execution) of a dot, convolution or TPU kernel call (`hlo_flops`); ('', 0.0) for
  any other instruction; FLOPs None for a kernel whose FLOPs are not known."""
  name, shape, op, rest = ins
  if op not in ("dot", "convolution", "custom-call"):
    return "", 0.0
  operands = _operands(rest)
  if op == "custom-call":
    gpu = _library_flops(comp, ins, shapes)
    if gpu is not None:
      return gpu
    if 'custom_call_target="tpu_custom_call"' not in rest:
      return "", 0.0
    layouts = re.search(r"operand_layout_constraints=\{(.*?)\}, (?:\w+=)", rest)
    operand_shapes = layouts.group(1) if layouts else ", ".join(shapes.get((comp, o), "") for o in operands)
    return _kernel_flops(name, shape, rest, operand_shapes)
  if len(operands) < 2:
    return op, 0.0
  lhs, rhs = (_dims(shapes.get((comp, o), "")) for o in operands[:2])
  out = _dims(_tuple_elements(shape)[0])
  if op == "dot":
    m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest)
    macs = math.prod(out) * (math.prod(lhs[int(d)] for d in m.group(1).split(",") if d) if m and lhs else 0)
  else:
    macs = _conv_macs(lhs, rhs, out, rest)
  return op, 2.0 * macs


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
  for comp, ins, times in _executed(comps, entry):
    if ins[2] == "while" and _loop_trips(ins[3], comps, comp) is None:
      body = re.search(r"body=%([\w.\-]+)", ins[3])
      dynamic_loops += bool(body and _holds_matmuls(comps, body.group(1)))
    part, flops = _instr_flops(comp, ins, shapes)
    if flops is None:
      uncounted.add(ins[0])
    elif part:
      parts[part] += flops * times
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


# What moves no HBM bytes of its own: views, control flow (its body's instructions count), bookkeeping;
# collectives are timed as communication (aot/roofline.py), the '-done' half of an async pair not at all.
_NO_TRAFFIC = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "call",
                         "conditional", "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency",
                         "domain", "send", "recv", "iota"})
_SLICES = ("dynamic-slice", "slice", "gather")


def _sliced_bytes(comps: dict[str, list[Instr]], name: str, users: dict[str, list[Instr]],
                  depth: int = 0) -> int | None:
  """The bytes of `name` its users read when every one only slices it (directly, or as the parameter of a
  nested fusion that only slices it); None when some user reads it whole."""
  us = users.get(name, [])
  if not us or depth > 8:
    return None
  total = 0
  for u in us:
    ops = _operands(u[3])
    if u[2] in _SLICES and ops[:1] == [name]:
      total += _array_bytes(u[1])
      continue
    fused = re.search(r"calls=%([\w.\-]+)", u[3]) if u[2] == "fusion" else None
    if not fused:
      return None
    inner = comps.get(fused.group(1), [])
    inner_users: dict[str, list[Instr]] = {}
    for i in inner:
      for o in _operands(i[3]):
        inner_users.setdefault(o, []).append(i)
    for k in (k for k, o in enumerate(ops) if o == name):
      param = next((i[0] for i in inner if i[2] == "parameter" and re.match(rf"{k}\)", i[3])), None)
      b = _sliced_bytes(comps, param, inner_users, depth + 1) if param else None
      if b is None:
        return None
      total += b
  return total


def _fusion_io(comps: dict[str, list[Instr]], fused: str) -> tuple[dict[int, int], set[int], dict[int, int]]:
  """For a fused computation: {parameter index: bytes read} for the parameters it only slices (a scanned
  layer's slice of the stacked weights: the slice's bytes, not the whole operand's); the parameters a root
  dynamic-update-slice updates in place (read nothing); {output element: bytes written} for those outputs
  (the update, not the whole buffer)."""
  ins = comps.get(fused, [])
  table = {i[0]: i for i in ins}
  params = {name: int(re.match(r"(\d+)", rest).group(1)) for name, _, op, rest in ins if op == "parameter"}
  users: dict[str, list[Instr]] = {}
  for i in ins:
    for o in _operands(i[3]):
      users.setdefault(o, []).append(i)
  sliced = {}
  for name, idx in params.items():
    b = _sliced_bytes(comps, name, users)
    if b is not None:
      sliced[idx] = b
  in_place, written = set(), {}
  root = ins[-1] if ins else None           # the printer puts a computation's ROOT last
  roots = ([table.get(o) for o in _operands(root[3])] if root[2] == "tuple" else [root]) if root else []
  for k, r in enumerate(roots):
    ops = _operands(r[3]) if r else []
    if r and r[2] == "dynamic-update-slice" and len(ops) > 1 and ops[0] in params:
      in_place.add(params[ops[0]])
      written[k] = _array_bytes(table[ops[1]][1]) if ops[1] in table else 0
  return sliced, in_place, written


def _fused_flops(comps: dict[str, list[Instr]], name: str, shapes: dict, memo: dict) -> float:
  """FLOPs of one execution of computation `name` and what it calls (`_instr_flops`; unknown kernels 0)."""
  if name not in memo:
    memo[name] = 0.0
    total = 0.0
    for ins in comps.get(name, []):
      total += _instr_flops(name, ins, shapes)[1] or 0.0
      for attr, callee in _CALLS.findall(ins[3]):
        if attr == "calls":
          total += _fused_flops(comps, callee, shapes, memo)
    memo[name] = total
  return memo[name]


def _op_bytes(comps: dict, comp: str, ins: Instr, shapes: dict) -> int:
  """HBM bytes one execution of a top-level instruction reads and writes (`hlo_op_costs`)."""
  name, shape, op, rest = ins
  sizes = [_array_bytes(shapes.get((comp, o), "")) for o in _operands(rest)]
  out = _array_bytes(shape)
  if op == "dynamic-update-slice" and len(sizes) > 1:
    return 2 * sizes[1] + sum(sizes[2:])       # the update read and written in place, and the indices
  if op in _SLICES and sizes:
    return 2 * out + sum(sizes[1:])
  fused = re.search(r"calls=%([\w.\-]+)", rest) if op == "fusion" else None
  if not fused:
    return sum(sizes) + out
  sliced, in_place, written = _fusion_io(comps, fused.group(1))
  reads = sum(sliced.get(i, 0 if i in in_place else b) for i, b in enumerate(sizes))
  parts = _tuple_elements(shape)
  return reads + sum(written.get(k, _array_bytes(p)) for k, p in enumerate(parts))


def hlo_op_costs(hlo_text: str) -> list[dict[str, Any]]:
  """Each instruction one execution of a compiled HLO module runs as one program (a fusion, a kernel, an
  unfused op: not what a fusion holds), per device: {'name', 'op', 'times' (executions per step), 'bytes'
  (HBM read + written by one execution), 'flops' (its dots, convolutions and TPU kernels, `hlo_flops`)}.
  bytes: operands + outputs, except what a fusion or op only slices (a scanned layer's slice of the
  stacked weights: the slice) and the buffers a dynamic-update-slice writes in place (the update);
  views, control flow and collectives (`_NO_TRAFFIC`, timed as communication) count none. As XLA's
  cost analysis counts 'bytes accessed', but with every loop trip-counted (that analysis counts a while
  body once)."""
  comps, entry = parse_hlo(hlo_text)
  shapes = {(c, name): shape for c, ins in comps.items() for name, shape, _, _ in ins}
  memo: dict[str, float] = {}
  out = []
  for comp, ins, times in _executed(comps, entry, into_fusions=False):
    op = ins[2]
    base = op[:-len("-start")] if op.endswith("-start") else op
    if op in _NO_TRAFFIC or op.endswith("-done") or op.endswith("-start") or base in COLLECTIVES:
      continue
    flops = _instr_flops(comp, ins, shapes)[1] or 0.0
    if op == "fusion":
      fused = re.search(r"calls=%([\w.\-]+)", ins[3])
      flops += _fused_flops(comps, fused.group(1), shapes, memo) if fused else 0.0
    out.append({"name": ins[0], "op": op, "times": times, "bytes": _op_bytes(comps, comp, ins, shapes),
                "flops": flops})
  return out


# -- the compile ------------------------------------------------------------------------------------------
