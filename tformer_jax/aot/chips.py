"""The TPU chips a roofline prediction needs (aot/roofline.py), per chip, with their sources.

Sources (read 2026-12):
  [cloud]  the Cloud TPU system architecture pages, cloud.google.com/tpu/docs/v4, /v5e, /v5p, /v6e: peak bf16
           TFLOP/s per chip, HBM capacity (GiB) and bandwidth (GB/s) per chip, the interconnect topology and,
           for v5p, "data center network (DCN) bandwidth per chip: 50 Gbps".
  [book]   "How to Scale Your Model" (the JAX scaling book, jax-ml.github.io/scaling-book/tpus), its table of
           ICI bandwidth per link, one way: v4p 4.5e10, v5p 9e10, v5e 4.5e10, v6e 9e10 bytes/s; links per
           chip: 6 on the 3D tori (v4, v5p), 4 on the 2D ones (v5e, v6e); wraparound links only on a full
           axis (v4/v5p: an axis whose length is a multiple of 4, a whole cube face; v5e/v6e: 16, the pod).
DCN per chip on v4, v5e and v6e is not stated per chip on the pages read: the v5p figure (6.25e9 bytes/s,
one way) is used for all four and marked as assumed.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Chip:
  generation: str
  peak_bf16_flops: float        # per chip, dense bf16 [cloud]
  hbm_gib: float                # per chip [cloud]
  hbm_bytes_per_s: float        # per chip [cloud]
  ici_links: int                # per chip [book]
  ici_link_bytes_per_s: float   # one way, per link [book]
  dcn_bytes_per_s: float        # per chip, one way [cloud, v5p]
  wrap_multiple: int            # an ICI axis of a multiple of this length has wraparound links [book]
  sources: str


CHIPS = {
    # 275 TFLOP/s, 32 GiB, 1200 GB/s [cloud v4]; 3D torus, 6 links of 4.5e10 B/s one way [book]
    "TPU v4": Chip("v4", 275e12, 32, 1200e9, 6, 4.5e10, 6.25e9, 4, "cloud v4; book; DCN assumed = v5p"),
    # 197 TFLOP/s, 16 GiB, 819 GB/s [cloud v5e]; 2D torus, 4 links of 4.5e10 B/s one way [book]
    "TPU v5 lite": Chip("v5e", 197e12, 16, 819e9, 4, 4.5e10, 6.25e9, 16, "cloud v5e; book; DCN assumed = v5p"),
    # 459 TFLOP/s, 95 GiB, 2765 GB/s, DCN 50 Gbps per chip [cloud v5p]; 3D torus, 6 links of 9e10 B/s [book]
    "TPU v5": Chip("v5p", 459e12, 95, 2765e9, 6, 9e10, 6.25e9, 4, "cloud v5p; book"),
    # 918 TFLOP/s, 32 GiB, 1640 GB/s [cloud v6e]; 2D torus, 4 links of 9e10 B/s one way [book]
    "TPU v6 lite": Chip("v6e", 918e12, 32, 1640e9, 4, 9e10, 6.25e9, 16, "cloud v6e; book; DCN assumed = v5p"),
}


def chip_for(device_kind: str) -> Chip | None:
  return CHIPS.get(device_kind)
