r"""Does this config compile and fit on that TPU topology? Ahead-of-time compilation on any host (a CPU).

  tformer-aot --config=scale/llama_70b --topology=v5p:4x4x4
  tformer-aot --config=scale/llama_8b --topology=v5e:4x4 --json=runs/aot_8b.json
  tformer-aot --config=llama_tiny --topology=v5e:2x2 --num_slices=2 \
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
(analysis/estimate/mesh.py `estimate_on_mesh`, nothing compiled) and its ratio to the peak; the step's
FLOPs from analysis/flops.py's formula (with the remat policy's recompute), from the compiled HLO's dots,
convolutions and TPU kernels (`aot.hlo_flops`: ragged_dot, megablox gmm, splash attention, by their operand
shapes; loops trip-counted) and from XLA's cost analysis (which counts a while-loop body once: scanned
layers, collective matmuls); their ratio HLO / formula per device, with a one-line WARNING above
`REPLICATED_RATIO` (devices repeating work instead of splitting it); and the collectives of the
compiled HLO (count and bytes per step, by kind: `aot.hlo_collectives`).

Then a roofline prediction of the step per device (tformer_jax/aot/roofline.py, the chip table
tformer_jax/aot/chips.py with its sources): compute = the HLO FLOPs / the chip's bf16 peak; HBM = the bytes
each op reads and writes (summed from the HLO with loops trip-counted) / the HBM bandwidth; each collective
by kind and the mesh axes of its replica groups, timed by the ring formulas over that axis's ICI links (DCN
across slices); the step with no overlap (compute + HBM + collectives) and with perfect overlap (each op
at its own bound, communication hidden: the max); predicted tokens/s/chip and MFU (the formula's FLOPs)
for both, and the bound. The last line is one JSON object (`topology`, `devices`, `fits`,
`per_device_bytes`, `hbm_bytes`, `estimate_bytes`, `estimate_ratio`, `flops_ratio`, `replicated_work`,
`predicted_step_s_no_overlap`, `predicted_step_s_perfect_overlap`, `predicted_mfu_*`,
`predicted_tokens_per_s_per_chip_*`, `predicted_bound`, `roofline`: every term, ...).

Exit status: 0 it fits; 3 it does not fit (XLA:TPU refuses a program larger than its HBM with
RESOURCE_EXHAUSTED: the figure it needed is reported); 2 a config or topology error (one line).
"""
from __future__ import annotations

import json
import os
from typing import Sequence

import jax
from absl import flags

from tformer_jax import cli_common
from tformer_jax.aot import EXIT_FITS, EXIT_NO_FIT, compile_for_topology, format_report, summary

PROG = "tformer-aot"


def define_flags(fv: flags.FlagValues) -> None:
  flags.DEFINE_string("topology", None, "TPU topology, GENERATION:SHAPE: v5e:2x2, v5e:4x4, v5e:16x16, v5p:4x4x4, "
                      "v4:4x4x4, v6e:16x16 (required)", flag_values=fv)
  flags.DEFINE_integer("num_slices", 1, "slices of that topology (multi-slice over DCN; the 'data' mesh axis "
                       "spans them)", flag_values=fv)
  flags.DEFINE_string("json", None, "also write the JSON report to this file", flag_values=fv)
  flags.DEFINE_string("hlo", None, "also write the compiled (per-device, optimized) HLO text to this file",
                      flag_values=fv)


def main(argv: Sequence[str] | None = None) -> int:
  args = cli_common.parse(argv, define_flags, doc=__doc__, prog=PROG, config="required")
  if not args.topology:
    cli_common.fail("pass --topology=GENERATION:SHAPE (e.g. v5e:2x2, v5p:4x4x4)")
  cli_common.require_extra(PROG, "tpu-aot")               # libtpu compiles for the topology
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
  cli_common.exit_process(cli_common.run_main(main))   # bounded: no thread left behind holds the exit


if __name__ == "__main__":
  entry()
