#!/usr/bin/env python
r"""Attention heatmaps of one text: a PNG grid of per-head maps per layer, plus an entropy/flags table.

  tformer-attention-map --workdir=runs/shakespeare --text "ROMEO: But soft" --out maps/
  tformer-attention-map --config=gpt2_tiny --random_init --text "To be" \
      [--config.model.num_heads=8]

With --workdir the trained parameters are used with the run's config.json (--config.a.b=v overrides
apply to it, e.g. --config.runtime.attention=reference).

Writes OUT/layer_<i>.png (rows = queries, columns = keys, tokens on both axes) and OUT/summary.json
(per layer and head: entropy, uniform entropy over the visible keys, their ratio, mean max weight,
collapse/blur flags; see tformer_jax/diagnostics/attention_maps.py), and prints the table.
"""
from __future__ import annotations

import json
import pathlib
import sys
from typing import Sequence

import numpy as np
from absl import flags

from tformer_jax import cli_common, model_loading
from tformer_jax.checkpoint import restore_params
from tformer_jax.diagnostics import attention_maps, plots


def define_flags(fv: flags.FlagValues) -> None:
  flags.DEFINE_string("workdir", None, "training workdir (config.json + checkpoints/)", flag_values=fv)
  flags.DEFINE_bool("random_init", False, "random weights from --config", flag_values=fv)
  flags.DEFINE_string("text", None, "the text to encode (required)", flag_values=fv)
  flags.DEFINE_string("out", "attention_maps", "output directory", flag_values=fv)
  flags.DEFINE_integer("seed", 0, "random-init seed", flag_values=fv)


def main(argv: Sequence[str] | None = None) -> int:
  args = cli_common.parse(argv, define_flags, doc=__doc__, prog="tformer-attention-map",
                          config=True, from_workdir=True)
  if args.text is None:
    cli_common.fail("pass --text=TEXT")
  if not args.workdir and not (args.random_init and args.config_file):
    cli_common.fail("pass --workdir=RUN, or --config=FILE --random_init")

  if args.random_init:
    model, params, tok = model_loading.random_init(args.config, args.seed)
  else:
    _, params = restore_params(args.workdir)
    model, tok = model_loading.model_from_config(args.config), model_loading.tokenizer_from_config(args.config)
  tokens = np.asarray(tok.encode(args.text), np.int32)
  if tokens.size == 0:
    cli_common.fail("--text encodes to no tokens")
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



def entry() -> None:
  """The `tformer-attention-map` console command."""
  cli_common.exit_process(cli_common.run_main(main))   # bounded: no thread left behind holds the exit


if __name__ == "__main__":
  entry()
