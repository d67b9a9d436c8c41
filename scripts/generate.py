"""Generate text with the KV cache, streaming to stdout.

  python scripts/generate.py --workdir runs/gpt2_tiny --prompt "ROMEO:" --max_new_tokens 200
  python scripts/generate.py --hf path/to/hf_model --prompt "Hello" --temperature 0.7 --top_p 0.9
  python scripts/generate.py --random_init --config configs/gpt2_tiny.py --prompt "To be"   # smoke test

Several --prompt (or --prompts_file, one prompt per line) run as one left-padded batch; a single
prompt streams chunk by chunk. --stop strings end a row (the text is cut before the stop string).
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

import numpy as np

from tformer_jax import decode, decode_io


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  src = p.add_mutually_exclusive_group(required=True)
  src.add_argument("--workdir", help="training workdir (config.json + checkpoints/)")
  src.add_argument("--hf", help="Hugging Face model directory")
  src.add_argument("--random_init", action="store_true", help="random weights from --config")
  p.add_argument("--config", help="config file (with --random_init)")
  p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
  p.add_argument("--prompts_file", help="a file with one prompt per line")
  p.add_argument("--max_new_tokens", type=int, default=200)
  p.add_argument("--temperature", type=float, default=0.8)
  p.add_argument("--top_k", type=int, default=0)
  p.add_argument("--top_p", type=float, default=1.0)
  p.add_argument("--repetition_penalty", type=float, default=1.0)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
  p.add_argument("--chunk_size", type=int, default=16, help="tokens per streamed chunk")
  args = p.parse_args(argv)
  if args.random_init and not args.config:
    p.error("--random_init needs --config=configs/<name>.py")
  return args


def load(args: argparse.Namespace) -> tuple[Any, Any, Any, str]:
  """(model, params, tokenizer, default prompt)."""
  if args.random_init:
    cfg = decode_io.load_config_file(args.config)
    model, params, tok = decode_io.random_init(cfg, args.seed)
    return model, params, tok, cfg.train.sample_prompt if "train" in cfg else "\n"
  if args.hf:
    return (*decode_io.load_hf(args.hf), "Hello")
  return (*decode_io.load_for_inference(args.workdir), "\n")


class RowText:
  """The decoded continuation of one row, cut at the first stop string."""

  def __init__(self, tokenizer: Any, stops: Sequence[str]):
    self.tok, self.stops, self.ids, self.finished = tokenizer, [s for s in stops if s], [], False
    self.text, self.shown = "", 0

  def add(self, ids: np.ndarray, n_real: int) -> None:
    if self.finished:
      return
    self.ids.extend(int(i) for i in ids[:n_real])
    text = self.tok.decode(self.ids)
    cuts = [text.find(s) for s in self.stops if s in text]
    if cuts:
      text, self.finished = text[:min(cuts)], True
    self.text = text

  def ready(self, final: bool) -> str:
    """New text safe to print: holds back a possibly partial character or stop-string prefix."""
    end = len(self.text)
    if not (final or self.finished):
      end -= max((len(s) - 1 for s in self.stops), default=0)
      while end > self.shown and self.text[end - 1] == "\ufffd":
        end -= 1
    out = self.text[self.shown:max(end, self.shown)]
    self.shown = max(end, self.shown)
    return out


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  model, params, tok, default_prompt = load(args)
  prompts = list(args.prompt)
  if args.prompts_file:
    with open(args.prompts_file, encoding="utf-8") as f:
      prompts += [line.rstrip("\n") for line in f if line.strip()]
  prompts = prompts or [default_prompt]
  encoded = [tok.encode(p) for p in prompts]
  for p, ids in zip(prompts, encoded):
    if len(ids) == 0:
      raise SystemExit(f"prompt {p!r} encodes to no tokens")
  stop_tokens = sorted({int(ids[0]) for ids in map(tok.encode, args.stop) if len(ids) == 1})
  rows = [RowText(tok, args.stop) for _ in prompts]
  stream = decode.generate_stream(
      model, params, encoded, max_new_tokens=args.max_new_tokens, chunk_size=args.chunk_size,
      temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
      repetition_penalty=args.repetition_penalty, stop_tokens=stop_tokens, rng=args.seed, pad_id=-1)
  single = len(prompts) == 1
  if single:
    sys.stdout.write(prompts[0])
  for chunk in stream:
    for row, ids in zip(rows, chunk):
      row.add(ids, int(np.sum(ids >= 0)))      # pad_id=-1 follows a row's stop token
    if single:
      sys.stdout.write(rows[0].ready(final=False))
      sys.stdout.flush()
    if all(r.finished for r in rows):
      stream.close()
      break
  if single:
    sys.stdout.write(rows[0].ready(final=True) + "\n")
  else:
    for i, (p, row) in enumerate(zip(prompts, rows)):
      sys.stdout.write(f"=== [{i}] ===\n{p}{row.text}\n")
  sys.stdout.flush()
  return 0


if __name__ == "__main__":
  sys.exit(main())
