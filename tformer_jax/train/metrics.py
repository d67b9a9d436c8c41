"""Metrics to JSONL (one object per line) and TensorBoard event files (tensorboardX)."""
from __future__ import annotations

import json
import pathlib


class MetricWriter:
  def __init__(self, workdir: pathlib.Path, *, enabled: bool = True, truncate_after: int | None = None):
    self.enabled = enabled
    self.path = pathlib.Path(workdir) / "metrics.jsonl"
    self._tb = None
    if not enabled:
      return
    if truncate_after is not None and self.path.exists():
      # A crashed run may have logged steps past its last checkpoint: drop them, they will be redone.
      keep = [ln for ln in self.path.read_text().splitlines()
              if ln.strip() and json.loads(ln).get("step", 0) <= truncate_after]
      self.path.write_text("".join(k + "\n" for k in keep))
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


def read_metrics(workdir) -> list[dict]:
  path = pathlib.Path(workdir) / "metrics.jsonl"
  return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []
