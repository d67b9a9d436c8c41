"""Where a compiled step spends its time, op by op, from a `jax.profiler` trace.

  python -m tformer_jax.bench train --config=configs/bench/gpt2_cpu.py --profile /tmp/prof

writes the trace (open it in Perfetto / TensorBoard) and prints the table `summarize` returns: every
executed HLO op's recorded time, grouped by what it is (matmuls, elementwise/reduce fusions, each
custom-call target, ...), per step. The ops are matched to the compiled module's HLO text by name; runtime
bookkeeping (thread-pool and executor events, Python frames) is left out. Written for XLA:CPU, whose
runtime records one event per executed op under the op's HLO name.

Accounting: XLA:CPU runs independent ops concurrently on its thread pool, so the ops' own durations
('op ms') add up to more than the step's wall time (`concurrency` = op time / busy time says by how
much), and an op sharing the cores runs longer than it would alone. 'wall ms' splits the wall clock
instead: every instant goes in equal parts to the ops running then, so the groups' wall ms add up to
the time any op ran (`busy_ms_per_step`); the rest of the step is dispatch and idle time.
"""
from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
from typing import Any

from tformer_jax.analysis.hlo import parse_hlo


def hlo_op_kinds(hlo_text: str) -> dict[str, str]:
  """{instruction name: kind} for the instructions of an HLO module's text (`analysis.hlo.parse_hlo`). Kinds:
  'matmul' (a dot or convolution, or a fusion whose computation holds one), 'elementwise/reduce fusion'
  (any other fusion), 'custom call <target>', or the opcode."""
  comps, _ = parse_hlo(hlo_text)
  has_dot = {name: any(op in ("dot", "convolution") for _, _, op, _ in instrs) for name, instrs in comps.items()}
  kinds = {}
  for instrs in comps.values():
    for name, _, opcode, rest in instrs:
      if opcode == "custom-call":
        target = re.search(r'custom_call_target="([^"]+)"', rest)
        kinds[name] = f"custom call {target.group(1) if target else '?'}"
      elif opcode == "fusion":
        called = re.search(r"calls=%?([\w.\-]+)", rest)
        dot = has_dot.get(called.group(1), False) if called else False
        kinds[name] = "matmul" if dot else "elementwise/reduce fusion"
      else:
        kinds[name] = "matmul" if opcode in ("dot", "convolution") else opcode
  return kinds


def load_trace_events(trace_dir: str) -> list[dict[str, Any]]:
  """The complete ('X') events of the newest Perfetto trace under trace_dir (written by
  `jax.profiler.start_trace(dir, create_perfetto_trace=True)`)."""
  files = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
  if not files:
    raise FileNotFoundError(f"no *.trace.json.gz under {trace_dir!r}: trace with "
                            "jax.profiler.start_trace(dir, create_perfetto_trace=True)")
  with gzip.open(max(files, key=os.path.getmtime)) as f:
    data = json.load(f)
  events = data["traceEvents"] if isinstance(data, dict) else data
  return [e for e in events if e.get("ph") == "X" and "dur" in e]


def summarize(events: list[dict[str, Any]], kinds: dict[str, str], steps: int,
              wall_s: float | None = None, top: int = 10) -> dict[str, Any]:
  """Per-step time by op kind and the `top` slowest ops, from trace events of `steps` steps whose
  names are HLO instruction names in `kinds` (see the module docstring for the accounting)."""
  ops = [e for e in events if e.get("name", "") in kinds]
  own = collections.defaultdict(float)   # op name -> its events' durations, microseconds
  shared = collections.defaultdict(float)  # op name -> its split of the wall clock, microseconds
  count: dict[str, int] = collections.Counter()
  for e in ops:
    own[e["name"]] += e["dur"]
    count[kinds[e["name"]]] += 1
  # sweep over start/end points: each interval's length goes in equal parts to the ops active in it
  points = sorted([(e["ts"], 1, i) for i, e in enumerate(ops)] +
                  [(e["ts"] + e["dur"], -1, i) for i, e in enumerate(ops)])
  active: set[int] = set()
  busy, last = 0.0, 0.0
  for t, delta, i in points:
    if active and t > last:  # `active` is only non-empty after a first point has set `last`
      for j in active:
        shared[ops[j]["name"]] += (t - last) / len(active)
      busy += t - last
    last = t
    if delta > 0:
      active.add(i)
    else:
      active.discard(i)
  per_step = lambda us: round(us / 1e3 / steps, 3)  # noqa: E731  microseconds -> ms per step
  by_kind_own, by_kind_wall = collections.defaultdict(float), collections.defaultdict(float)
  for name in own:
    by_kind_own[kinds[name]] += own[name]
    by_kind_wall[kinds[name]] += shared[name]
  groups = [dict(kind=k, wall_ms_per_step=per_step(us), wall_share=round(us / busy, 4) if busy else 0.0,
                 op_ms_per_step=per_step(by_kind_own[k]), ops_per_step=round(count[k] / steps, 1))
            for k, us in sorted(by_kind_wall.items(), key=lambda kv: -kv[1])]
  slowest = [dict(op=n, kind=kinds[n], wall_ms_per_step=per_step(us), op_ms_per_step=per_step(own[n]))
             for n, us in sorted(shared.items(), key=lambda kv: -kv[1])[:top]]
  out: dict[str, Any] = dict(steps=steps, busy_ms_per_step=per_step(busy),
                             op_ms_per_step=per_step(sum(own.values())),
                             concurrency=round(sum(own.values()) / busy, 3) if busy else 0.0,
                             groups=groups, slowest=slowest)
  if wall_s:
    out["wall_ms_per_step"] = round(wall_s * 1e3 / steps, 3)
  return out


def format_summary(s: dict[str, Any]) -> str:
  head = (f"time by op kind, per step ({s['steps']} profiled steps): ops ran during "
          f"{s['busy_ms_per_step']:.1f} ms" + (f" of {s['wall_ms_per_step']:.1f} ms" if "wall_ms_per_step" in s
                                             else "")
          + f", {s['concurrency']:.2f} at a time on average")
  lines = [head, f"  {'wall ms':>9s} {'share':>6s} {'op ms':>9s} {'ops':>7s}  kind"]
  for g in s["groups"]:
    lines.append(f"  {g['wall_ms_per_step']:9.2f} {100 * g['wall_share']:5.1f}% {g['op_ms_per_step']:9.2f} "
                 f"{g['ops_per_step']:7.1f}  {g['kind']}")
  lines.append("slowest ops (wall ms / op ms per step):")
  for o in s["slowest"]:
    lines.append(f"  {o['wall_ms_per_step']:9.2f} {o['op_ms_per_step']:9.2f}  {o['op']}  ({o['kind']})")
  return "\n".join(lines)
