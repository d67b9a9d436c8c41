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

import dataclasses
import json
import sys
from typing import Sequence

from absl import flags

from tformer_jax import backends, cli_common
from tformer_jax.config import ConfigError, validate
from tformer_jax.diagnostics import estimate as est_lib


def define_flags(fv: flags.FlagValues) -> None:
  flags.DEFINE_integer("batch", None, "sequences per step (default data.batch_size)", flag_values=fv)
  flags.DEFINE_integer("seq", None, "sequence length (default data.seq_len)", flag_values=fv)
  flags.DEFINE_bool("remat", False, "per-layer rematerialisation (remat='full', scan_layers)", flag_values=fv)
  flags.DEFINE_integer("kv-batch", None, "KV cache: batch", flag_values=fv)
  flags.DEFINE_integer("kv-len", None, "KV cache: length", flag_values=fv)
  flags.DEFINE_bool("no-compile", False, "skip the XLA side", flag_values=fv)
  flags.DEFINE_string("json", None, "also write the numbers to this file", flag_values=fv)


def main(argv: Sequence[str] | None = None) -> int:
  args = cli_common.parse(argv, define_flags, doc=__doc__, prog="tformer-estimate",
                          config="required")
  cfg = args.config
  try:
    m = validate(cfg, check_paths=False)   # the architecture only: a run's files need not exist here
    backend = None if args.no_compile else backends.resolve_runtime(cfg, quiet=True).backend
  except ConfigError as e:
    cli_common.fail(str(e))
  batch = args.batch or int(cfg.data.batch_size)
  seq = args.seq or int(cfg.data.seq_len)
  if args.remat:
    m = dataclasses.replace(m, remat="full", scan_layers=True)
  est = est_lib.estimate(m, batch, seq, remat=args.remat)
  xla = None
  if backend is not None:          # the step as the run would compile it: under cfg.runtime's backend
    with backends.use(backend):
      xla = est_lib.compiled_analysis(m, batch, seq, cfg.optim)
  kv = None
  if args.kv_batch or args.kv_len:
    kv = (args.kv_batch or 1, args.kv_len or m.max_len)
  print(est_lib.format_report(m, est, batch, seq, xla, kv))
  if args.json:
    out = {"params": est.params, "estimate": est.bytes, "estimate_total": est.total,
           "activation_per_layer": est.activation_per_layer, "flops_per_token": est.flops_per_token,
           "xla": xla}
    if kv:
      out["kv_cache_bytes_fp16"] = est_lib.kv_cache_bytes(m.num_layers, kv[0], kv[1], m.kv_heads, m.hd, 2)
    with open(args.json, "w") as f:
      json.dump(out, f, indent=2)
  return 0



def entry() -> None:
  """The `tformer-estimate` console command."""
  sys.exit(cli_common.run_main(main))


if __name__ == "__main__":
  entry()
