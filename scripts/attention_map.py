#!/usr/bin/env python
r"""Attention heatmaps of one text: a PNG grid of per-head maps per layer, plus an entropy/flags table.

  python scripts/attention_map.py --workdir=runs/shakespeare --text "ROMEO: But soft" --out maps/
  python scripts/attention_map.py --config=configs/gpt2_tiny.py --random_init --text "To be" \
      [--config.model.num_heads=8]

Writes OUT/layer_<i>.png (rows = queries, columns = keys, tokens on both axes) and OUT/summary.json
(per layer and head: entropy, uniform entropy over the visible keys, their ratio, mean max weight,
collapse/blur flags; see tformer_jax/diagnostics/attention_maps.py), and prints the table.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Sequence

import numpy as np


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, str | None, dict[str, str]]:
  from tformer_jax.diagnostics.cli import split_config_args
  path, overrides, rest = split_config_args(argv)
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--workdir", help="training workdir (config.json + checkpoints/)")
  p.add_argument("--random_init", action="store_true", help="random weights from --config")
  p.add_argument("--text", required=True, help="the text to encode")
  p.add_argument("--out", default="attention_maps", help="output directory")
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(rest)
  if not args.workdir and not (args.random_init and path):
    p.error("pass --workdir=RUN, or --config=FILE --random_init")
  return args, path, overrides


def main(argv: Sequence[str] | None = None) -> int:
  args, path, overrides = parse_args(sys.argv[1:] if argv is None else argv)
  from tformer_jax import decode_io
  from tformer_jax.diagnostics import attention_maps, plots
  from tformer_jax.diagnostics.cli import load_config

  if args.workdir and not args.random_init:
    model, params, tok = decode_io.load_for_inference(args.workdir)
  else:
    cfg = load_config(path, overrides)
    model, params, tok = decode_io.random_init(cfg, args.seed)
  tokens = np.asarray(tok.encode(args.text), np.int32)
  if tokens.size == 0:
    raise SystemExit("error: --text encodes to no tokens")
  if tokens.size > model.cfg.max_len:
    tokens = tokens[: model.cfg.max_len]
    print(f"note: text truncated to model.max_len={model.cfg.max_len} tokens", file=sys.stderr)
  weights, rows = attention_maps.analyze(model, params, tokens[None])
  labels = plots.token_labels(tok, tokens)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  for layer, w in enumerate(weights):
    notes = [",".join(f for f in ("collapse", "blur") if r[f])
             for r in rows if r["layer"] == layer]
    plots.attention_grid(w[0], labels, out / f"layer_{layer}.png", title=f"layer {layer}", head_notes=notes)
  summary = {"text": args.text, "tokens": [int(t) for t in tokens], "labels": labels,
             "num_layers": len(weights), "heads": rows,
             "collapsed_heads": sum(r["collapse"] for r in rows),
             "blurred_heads": sum(r["blur"] for r in rows)}
  (out / "summary.json").write_text(json.dumps(summary, indent=2))
  print(attention_maps.format_table(rows))
  print(f"\n{len(weights)} layer grids and summary.json written to {out}/ "
        f"({summary['collapsed_heads']} collapsed, {summary['blurred_heads']} blurred heads)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
