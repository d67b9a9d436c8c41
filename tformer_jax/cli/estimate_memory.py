#!/usr/bin/env python
r"""Memory and FLOPs of a training step, from the config (formulas) and from XLA (compiled), side by side.

  tformer-estimate --config=mixtral_tiny
  tformer-estimate --config=gpt2_tiny --batch_size=8 --seq_len=128
  tformer-estimate --config=llama_tiny --batch_size=8 --seq_len=256 --remat --kv-batch=1 --kv-len=4096
  tformer-estimate --config=scale/llama_8b --platform=tpu                   # estimate only
  tformer-estimate --config=gpt2_tiny --no-compile --config.model.num_layers=12
  tformer-estimate --config=finetune_hf --config.train.init_from=hf:DIR    # the HF model's own figures

With train.init_from the model is the source's (its architecture, max_len and vocabulary: the
config is resolved before anything reads it), and the report names it. --batch_size / --seq_len are
short for --config.data.batch_size / seq_len (--batch / --seq: their old, deprecated spellings).
The estimate is a pure function of the config (tformer_jax/analysis/estimate/: exact parameter and
optimizer-state sizes from jax.eval_shape, formulas for what the compiled step keeps), for the runtime
the run resolves from cfg.runtime on --platform (default this machine's): backend, attention
implementation, C++ kernels, train.loss_chunk, train.precision, optim.name/grad_accum, remat and
scan_layers. The compiled side builds the very same train step (train/setup.py, one device) and reads
XLA's memory_analysis(): arguments + temporaries, printed with the ratio estimate/XLA. FLOPs come from a
second compile with the reference backend, dense attention and unrolled layers (XLA's cost analysis
counts no custom call, e.g. the C++ kernels, and a loop body once); --no-flops skips it.
--remat: remat='full' with scan_layers=True (on CPU remat saves memory only under scan).
"""
from __future__ import annotations

import json
import sys
from typing import Any, Sequence

import jax
from absl import flags

from tformer_jax import cli_common
from tformer_jax.analysis import estimate as est_lib
from tformer_jax.config import ConfigError
from tformer_jax.train import setup as setup_lib

PLATFORMS = ("cpu", "gpu", "tpu")


def define_flags(fv: flags.FlagValues) -> None:
  flags.DEFINE_integer("batch_size", None, "sequences per step; = --config.data.batch_size", flag_values=fv)
  flags.DEFINE_integer("seq_len", None, "sequence length; = --config.data.seq_len", flag_values=fv)
  flags.DEFINE_integer("batch", None, "deprecated spelling of --batch_size", flag_values=fv)
  flags.DEFINE_integer("seq", None, "deprecated spelling of --seq_len", flag_values=fv)
  flags.DEFINE_bool("remat", False, "per-layer rematerialisation (remat='full', scan_layers)", flag_values=fv)
  flags.DEFINE_integer("kv-batch", None, "KV cache: batch", flag_values=fv)
  flags.DEFINE_integer("kv-len", None, "KV cache: length", flag_values=fv)
  flags.DEFINE_enum("platform", None, list(PLATFORMS), "estimate for this platform's runtime (default this "
                    "machine's); XLA compiles only for this machine's", flag_values=fv)
  flags.DEFINE_integer("devices", 0, "estimate per device of cfg's mesh over this many devices (the rules "
                       "split the state, batch, heads, vocab; default: one unsharded device)", flag_values=fv)
  flags.DEFINE_bool("no-compile", False, "skip the XLA side", flag_values=fv)
  flags.DEFINE_bool("no-flops", False, "skip the second (FLOPs) compile", flag_values=fv)
  flags.DEFINE_string("json", None, "also write the numbers to this file", flag_values=fv)


def _apply_flags(args: Any) -> Any:
  """args.config with --batch_size / --seq_len (or the deprecated --batch / --seq) and --remat applied."""
  cfg = args.config
  for old, new in (("batch", "batch_size"), ("seq", "seq_len")):
    if getattr(args, old) is not None:
      print(f"note: --{old} is deprecated; use --{new} (= --config.data.{new})", file=sys.stderr)
      if getattr(args, new) is None:
        setattr(args, new, getattr(args, old))
  for name in ("batch_size", "seq_len"):
    value = getattr(args, name)
    if value is not None and value <= 0:
      raise cli_common.UsageError(f"--{name}: must be > 0, got {value}")
    if value:
      cfg.data[name] = value
  if args.remat:
    cfg.model.remat, cfg.model.scan_layers = "full", True
  if args.devices < 0:
    raise cli_common.UsageError(f"--devices: must be >= 0, got {args.devices}")
  return cfg


def _xla_side(args: Any, cfg: Any, platform: str, here: str) -> tuple[dict | None, str]:
  """(XLA's compiled memory and FLOPs of the step, or None; why it was skipped, '' when it was not)."""
  if args.no_compile:
    return None, "--no-compile"
  if args.devices > 1:
    return None, (f"--devices={args.devices}: XLA compiles one device here; tformer-aot compiles the sharded "
                  "step for a TPU topology")
  if platform != here:
    return None, (f"--platform={platform}: XLA compiles for this machine's platform ({here}) only; "
                  "tformer-aot compiles for TPU topologies")
  return est_lib.compiled_analysis_config(cfg, flops=not args.no_flops), ""


def main(argv: Sequence[str] | None = None) -> int:
  args = cli_common.parse(argv, define_flags, doc=__doc__, prog="tformer-estimate", config="required")
  cfg = _apply_flags(args)
  here = jax.default_backend()
  platform = args.platform or here
  try:
    m = setup_lib.resolve_model_config(cfg, check_paths=False)   # the run's files need not exist here
    if args.devices > 1:
      est = est_lib.estimate_on_mesh(cfg, args.devices, platform=platform)
    else:
      est = est_lib.estimate_config(cfg, platform=platform)
  except ConfigError as e:
    hint = "" if args.platform else " (--platform=gpu|tpu estimates for another platform's runtime)"
    raise ConfigError(f"{cli_common.one_line(e)}{hint}") from None
  batch, seq = int(cfg.data.batch_size), int(cfg.data.seq_len)
  xla, skipped = _xla_side(args, cfg, platform, here)
  kv = None
  if args.kv_batch or args.kv_len:
    kv = (args.kv_batch or 1, args.kv_len or m.max_len)
  source = str(cfg.get("train", {}).get("init_from", "") or "")
  if source:
    print(f"source: train.init_from={source} (its architecture: max_len {m.max_len}, vocabulary {m.vocab_size})")
  print(est_lib.format_report(m, est, batch, seq, xla, kv))
  host = est_lib.host_rss(est, cfg) if platform == "cpu" and args.devices <= 1 else None
  if host is not None:
    print("\n" + est_lib.format_host(host))
  if skipped:
    print(f"\nXLA side skipped: {skipped}")
  if args.json:
    out = {"source": source or None, "params": est.params, "estimate": est.bytes, "estimate_total": est.total,
           "phases": est.phases,
           "execution": est.execution, "notes": est.notes, "activation_per_layer": est.activation_per_layer,
           "flops_per_token": est.flops_per_token, "executed_flops_per_token": est.executed_flops_per_token,
           "xla": xla, "ratio": (est.total / xla["total"]) if xla else None, "host_rss": host}
    if kv:
      out["kv_cache_bytes_fp16"] = est_lib.kv_cache_bytes(m.num_layers, kv[0], kv[1], m.kv_heads, m.hd, 2)
      out["kv_cache_bytes_int8"] = est_lib.kv_cache_bytes_as(m, kv[0], kv[1], "int8")
    with open(args.json, "w") as f:
      json.dump(out, f, indent=2)
  return 0


def entry() -> None:
  """The `tformer-estimate` console command."""
  cli_common.exit_process(cli_common.run_main(main))   # bounded: no thread left behind holds the exit


if __name__ == "__main__":
  entry()
