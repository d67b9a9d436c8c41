"""Ahead-of-time compilation of the loop's train step for a TPU topology on any host (`tformer-aot`,
tformer_jax/cli/aot.py, describes what it reports).

  topology.py  a topology's devices from libtpu with no TPU attached, their HBM per chip
  driver.py    `compile_for_topology`: the mesh, runtime and train step train/setup.py builds, lowered on
               abstract inputs and compiled by XLA:TPU; memory, FLOPs and collectives of the result
  hlo.py       the optimized HLO text read: instructions, trip-counted loops, collectives (with their replica
               groups), kernel FLOPs, each op's HBM bytes
  chips.py     the TPU chip table (peak bf16 FLOP/s, HBM, ICI links, DCN), with sources
  roofline.py  `predict`: compute, HBM and per-collective time, the step under no / perfect overlap, MFU
  report.py    `Report`, its table and its JSON summary
"""
from tformer_jax.analysis.hlo import (
    COLLECTIVES,
    HLO_FLOPS_PARTS,
    hlo_collectives,
    hlo_flops,
    hlo_matmul_flops,
    hlo_op_costs,
    parse_hlo,
    replica_groups,
)
from tformer_jax.aot.chips import CHIPS, Chip
from tformer_jax.aot.driver import EXIT_CONFIG, EXIT_FITS, EXIT_NO_FIT, compile_for_topology, formula_flops
from tformer_jax.aot.report import REPLICATED_RATIO, Report, format_report, summary
from tformer_jax.aot.roofline import Machine, predict, tpu_machine
from tformer_jax.aot.topology import (
    HBM_GIB_PER_CHIP,
    devices_per_chip,
    hbm_bytes_per_device,
    libtpu_available,
    topology_devices,
)

__all__ = ["CHIPS", "COLLECTIVES", "EXIT_CONFIG", "EXIT_FITS", "EXIT_NO_FIT", "HBM_GIB_PER_CHIP", "HLO_FLOPS_PARTS",
           "REPLICATED_RATIO", "Chip", "Machine", "Report", "compile_for_topology", "devices_per_chip", "format_report",
           "formula_flops", "hbm_bytes_per_device", "hlo_collectives", "hlo_flops", "hlo_matmul_flops", "hlo_op_costs",
           "libtpu_available", "parse_hlo", "predict", "replica_groups", "summary", "topology_devices", "tpu_machine"]
