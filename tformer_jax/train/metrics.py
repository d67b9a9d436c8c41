"""Metrics to JSONL (one object per line) and TensorBoard event files (tensorboardX).

A run killed while appending leaves a torn last line in `metrics.jsonl`: readers drop it with a
warning (`read_metrics`), and a resuming writer (`truncate_after=step`) rewrites the file without it
(atomically: a new file renamed over the old one), so the next row starts on a line of its own.
"""
from __future__ import annotations

import json
import logging
import pathlib

from tformer_jax.data.corpora import write_atomic

log = logging.getLogger(__name__)
METRICS_FILE = "metrics.jsonl"


def _parse(path: pathlib.Path, text: str) -> list[tuple[str, dict]]:
  """(line, row) of every row of a metrics file's `text`; undecodable lines (a torn last line) are
  dropped with a warning."""
  lines = text.splitlines()
  rows, bad = [], []
  for n, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      row = json.loads(line)
    except ValueError:
      row = None
    if isinstance(row, dict):
      rows.append((line, row))
    else:
      bad.append(n)
  if bad:
    torn = bad == [len(lines)]
    what = (f"its last line ({len(lines)}) is incomplete (a run killed while writing it?)" if torn
            else f"{len(bad)} line(s) are not JSON objects (lines {', '.join(map(str, bad[:5]))}"
                 f"{' ...' if len(bad) > 5 else ''})")
    log.warning("%s: %s; dropped", path, what)
  return rows


class MetricWriter:
  def __init__(self, workdir: pathlib.Path, *, enabled: bool = True, truncate_after: int | None = None):
    self.enabled = enabled
    self.path = pathlib.Path(workdir) / METRICS_FILE
    self._tb = None
    if not enabled:
      return
    if self.path.exists():
      text = self.path.read_text(errors="replace")
      # A crashed run may have logged steps past its last checkpoint (dropped: they will be redone),
      # or a torn last line (dropped rather than appended to).
      if truncate_after is not None or (text and not text.endswith("\n")):
        keep = [line for line, row in _parse(self.path, text)
                if truncate_after is None or _step(row) <= truncate_after]
        write_atomic(self.path, "".join(line + "\n" for line in keep).encode())
    self._file = self.path.open("a")
    from tensorboardX import SummaryWriter  # noqa: PLC0415 (slow import, ~1 s; only enabled writers need it)
    self._tb = SummaryWriter(str(pathlib.Path(workdir) / "tb"))

  def write(self, step: int, metrics: dict) -> None:
    if not self.enabled:
      return
    scalars = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    self._file.write(json.dumps({"step": int(step), **scalars}) + "\n")
    self._file.flush()
    for k, v in scalars.items():
      self._tb.add_scalar(k, v, int(step))

  def close(self) -> None:
    if self.enabled:
      self._file.close()
      self._tb.close()


def _step(row: dict) -> float:
  try:
    return float(row.get("step", 0))
  except (TypeError, ValueError):
    return float("inf")    # a row without a usable step cannot be placed: dropped on resume


def read_metrics(workdir) -> list[dict]:
  """The rows of `workdir/metrics.jsonl` ([] if absent); a torn last line is dropped with a warning."""
  path = pathlib.Path(workdir) / METRICS_FILE
  return [row for _, row in _parse(path, path.read_text(errors="replace"))] if path.exists() else []
