"""Matplotlib figures (Agg backend, files only): attention heatmap grids and loss curves."""
from __future__ import annotations

import math
import os
import pathlib
from typing import Any, Sequence

import numpy as np


def _plt():
  import matplotlib  # noqa: PLC0415 (heavy; only the plotting paths need it)
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415 (after matplotlib.use("Agg"))
  return plt


def token_labels(tokenizer: Any, tokens: Sequence[int]) -> list[str]:
  """One short printable label per token (whitespace made visible)."""
  out = []
  for t in tokens:
    try:
      s = tokenizer.decode([int(t)])
    except Exception:  # noqa: BLE001 - any odd tokenizer: fall back to the id
      s = str(int(t))
    s = s.replace("\n", "\\n").replace("\t", "\\t").replace(" ", "\u2423") or "\u2205"
    out.append(s if len(s) <= 8 else s[:7] + "\u2026")
  return out


def attention_grid(weights_HxLxS: np.ndarray, labels: Sequence[str], path: str | os.PathLike,
                   title: str = "", head_notes: Sequence[str] | None = None) -> pathlib.Path:
  """A PNG with one heatmap per head (rows: queries, columns: keys), tokens on both axes."""
  plt = _plt()
  h, l, s = weights_HxLxS.shape
  cols = math.ceil(math.sqrt(h))
  rows = math.ceil(h / cols)
  cell = max(2.5, 0.22 * max(l, s))
  fig, axes = plt.subplots(rows, cols, figsize=(cols * cell + 1, rows * cell + 0.8), squeeze=False)
  tick = len(labels) <= 64
  for i, ax in enumerate(axes.flat):
    if i >= h:
      ax.axis("off")
      continue
    im = ax.imshow(weights_HxLxS[i], vmin=0.0, vmax=1.0, cmap="viridis", interpolation="nearest")
    note = f" ({head_notes[i]})" if head_notes and head_notes[i] else ""
    ax.set_title(f"head {i}{note}", fontsize=9)
    if tick:
      ax.set_xticks(range(s))
      ax.set_xticklabels(labels[:s], rotation=90, fontsize=6)
      ax.set_yticks(range(l))
      ax.set_yticklabels(labels[:l], fontsize=6)
    ax.set_xlabel("key", fontsize=7)
    ax.set_ylabel("query", fontsize=7)
  fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.6)
  if title:
    fig.suptitle(title)
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def loss_curves(curves: dict[str, dict[str, list[tuple[int, float]]]], path: str | os.PathLike,
                title: str = "") -> pathlib.Path:
  """curves: run name -> {'loss': [(step, value)], 'val_loss': [...]}; train solid, val dashed."""
  plt = _plt()
  fig, ax = plt.subplots(figsize=(8, 5))
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for i, (name, c) in enumerate(curves.items()):
    color = colors[i % len(colors)]
    if c.get("loss"):
      x, y = zip(*c["loss"])
      ax.plot(x, y, color=color, label=f"{name} train", lw=1.2)
    if c.get("val_loss"):
      x, y = zip(*c["val_loss"])
      ax.plot(x, y, color=color, ls="--", marker="o", ms=3, label=f"{name} val")
  ax.set_xlabel("step")
  ax.set_ylabel("loss (nats/token)")
  if title:
    ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7, ncol=2)
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path
