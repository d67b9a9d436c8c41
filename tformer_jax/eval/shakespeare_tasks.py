"""The data of the shipped harness tasks (tformer_jax/eval/tasks/*.jsonl), from held-out Shakespeare.

The held-out works are the last two of the `shakespeare` corpus (The Two Gentlemen of Verona, The
Winter's Tale): the validation split a run on the byte tokenizer evaluates on (data.val_fraction 0.05
cuts at a document boundary there). A verse line here is a stripped line of at least four words, from the
first act on, that is not a speaker's name or a stage direction. Three tasks, each a JSONL of one split, 'test':
- shakespeare_next_line.jsonl (multiple choice): four consecutive lines, then which of four lines comes
  next (the true one and three other lines of the same work, in a seeded random order);
- shakespeare_ppl.jsonl (rolling perplexity): 15 evenly spaced passages of 30 consecutive non-empty
  lines per work;
- shakespeare_continue.jsonl (generation): four lines, the next line as the target.
Rebuild with `python -c "from tformer_jax.eval import shakespeare_tasks; shakespeare_tasks.build()"`
(deterministic: the corpus is checksum-pinned and the choices seeded).
"""
from __future__ import annotations

import json
import pathlib
import re

import numpy as np

from tformer_jax.data import corpora

TASKS_DIR = pathlib.Path(__file__).resolve().parent / "tasks"
HELD_OUT = (-2, -1)           # document indices of the held-out works
CONTEXT_LINES = 4
_SPEAKER = re.compile(r"^[A-Z][A-Z' ]+\.$")
_ACT_ONE = re.compile(r"^ACT (1|I)\b")


def play_lines(text: str) -> list[str]:
  """The work's lines from its first act on (not the title and the list of persons)."""
  lines = text.splitlines()
  start = next((i for i, line in enumerate(lines) if _ACT_ONE.match(line.strip())), 0)
  return lines[start:]


def verse_lines(text: str) -> list[str]:
  out = []
  for line in play_lines(text):
    s = line.strip()
    if len(s.split()) >= 4 and not _SPEAKER.match(s) and not s.startswith(("[", "ACT", "SCENE")):
      out.append(s)
  return out


def next_line_docs(lines: list[str], n: int, rng: np.random.Generator) -> list[dict]:
  docs = []
  for start in sorted(rng.choice(len(lines) - CONTEXT_LINES - 1, size=n, replace=False)):
    answer = lines[start + CONTEXT_LINES]
    pool = [x for x in rng.choice(len(lines), size=12, replace=False) if lines[x] != answer]
    choices = [answer] + [lines[x] for x in pool[:3]]
    order = rng.permutation(4)
    docs.append({"context": "\n".join(lines[start:start + CONTEXT_LINES]),
                 "choices": [choices[k] for k in order], "label": int(np.argmax(order == 0))})
  return docs


def build(out_dir: str | pathlib.Path = TASKS_DIR, seed: int = 0, cache_dir: str | None = None) -> dict[str, int]:
  """Write the three JSONL files; returns {file name: documents}."""
  works = corpora.load_documents("shakespeare", cache_dir)
  rng = np.random.default_rng(seed)
  mc, gen, ppl = [], [], []
  for i in HELD_OUT:
    text = works[i].decode("utf-8")
    lines = verse_lines(text)
    mc += next_line_docs(lines, 60, rng)
    for start in sorted(rng.choice(len(lines) - CONTEXT_LINES - 1, size=30, replace=False)):
      gen.append({"context": "\n".join(lines[start:start + CONTEXT_LINES]), "target": lines[start + CONTEXT_LINES]})
    raw = [r for r in play_lines(text) if r.strip()]
    for start in np.linspace(0, len(raw) - 30, 15).astype(int):
      ppl.append({"text": "\n".join(raw[start:start + 30])})
  out = pathlib.Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  files = {"shakespeare_next_line.jsonl": mc, "shakespeare_continue.jsonl": gen, "shakespeare_ppl.jsonl": ppl}
  for name, docs in files.items():
    (out / name).write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs), encoding="utf-8")
  return {name: len(docs) for name, docs in files.items()}
