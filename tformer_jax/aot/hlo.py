"""An optimized HLO module's text, read: its computations and instructions (`parse_hlo`), what executes
how often (while loops trip-counted), the collectives by kind and bytes (`hlo_collectives`), and the
FLOPs of its dots, convolutions and TPU kernels (`hlo_flops`: ragged_dot, megablox gmm, splash attention
by their operand shapes). Shared by tformer-aot, the MoE tests and bench/op_profile.py."""
from __future__ import annotations

import math
import re
from typing import Any

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
