#!/usr/bin/env python
r"""Memory and FLOPs of a training step, from the config (formulas) and from XLA (compiled), side by side.

  python scripts/estimate_memory.py --config=configs/gpt2_tiny.py --batch 8 --seq 128
  python scripts/estimate_memory.py --config=configs/llama_tiny.py --batch 8 --seq 256 --remat \
      --kv-batch 1 --kv-len 4096
  python scripts/estimate_memory.py --config=configs/gpt2_tiny.py --batch 8 --seq 128 --no-compile \
      --config.model.num_layers=12

Parameters are counted exactly with jax.eval_shape (nothing materialised); gradients, AdamW state
(2 x params float32), activations (per-layer formula, with or without remat), the loss working set and
FLOPs/token follow the formulas in tformer_jax/diagnostics/estimate.py. The compiled side lowers the real
train step: memory_analysis() (arguments + temporaries) and cost_analysis() (flops). --remat uses
remat='full' with scan_layers=True (XLA:CPU only saves memory with remat under scan).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
  from tformer_jax.config import validate
  from tformer_jax.diagnostics import estimate as est_lib
  from tformer_jax.diagnostics.cli import load_config, split_config_args
  path, overrides, rest = split_config_args(sys.argv[1:] if argv is None else argv)
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--batch", type=int, default=None, help="sequences per step (default data.batch_size)")
  p.add_argument("--seq", type=int, default=None, help="sequence length (default data.seq_len)")
  p.add_argument("--remat", action="store_true", help="per-layer rematerialisation (remat='full', scan_layers)")
  p.add_argument("--kv-batch", dest="kv_batch", type=int, default=None, help="KV cache: batch")
  p.add_argument("--kv-len", dest="kv_len", type=int, default=None, help="KV cache: length")
  p.add_argument("--no-compile", dest="compile", action="store_false", help="skip the XLA side")
  p.add_argument("--json", dest="json_out", default=None, help="also write the numbers to this file")
  args = p.parse_args(rest)
  cfg = load_config(path, overrides)
  m = validate(cfg)
  batch = args.batch or int(cfg.data.batch_size)
  seq = args.seq or int(cfg.data.seq_len)
  if args.remat:
    m = dataclasses.replace(m, remat="full", scan_layers=True)
  est = est_lib.estimate(m, batch, seq, remat=args.remat)
  xla = est_lib.compiled_analysis(m, batch, seq, cfg.optim) if args.compile else None
  kv = None
  if args.kv_batch or args.kv_len:
    kv = (args.kv_batch or 1, args.kv_len or m.max_len)
  print(est_lib.format_report(m, est, batch, seq, xla, kv))
  if args.json_out:
    out = {"params": est.params, "estimate": est.bytes, "estimate_total": est.total,
           "activation_per_layer": est.activation_per_layer, "flops_per_token": est.flops_per_token,
           "xla": xla}
    if kv:
      out["kv_cache_bytes_fp16"] = est_lib.kv_cache_bytes(m.num_layers, kv[0], kv[1], m.kv_heads, m.hd, 2)
    with open(args.json_out, "w") as f:
      json.dump(out, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
