"""Metrics to JSONL (one object per line) and TensorBoard event files (tensorboardX); the eval summary.

A run killed while appending leaves a torn last line in `metrics.jsonl`: readers drop it with a
warning (`read_metrics`), and a resuming writer (`truncate_after=step`) rewrites the file without it
(atomically: a new file renamed over the old one), so the next row starts on a line of its own.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import pathlib
import sys
from typing import Any, Sequence

from tformer_jax.config import ConfigError
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


def _summary_writer() -> Any:
  """tensorboardX's SummaryWriter, imported without PyTorch: tensorboardX imports torch when it is
  installed (only to accept torch tensors; we log floats), ~210 MB of RSS and seconds of start-up."""
  if "torch" in sys.modules:
    from tensorboardX import SummaryWriter  # noqa: PLC0415 (slow import, ~1 s; only enabled writers need it)
    return SummaryWriter
  sys.modules["torch"] = None   # type: ignore[assignment]  # `import torch` raises ImportError meanwhile
  try:
    from tensorboardX import SummaryWriter  # noqa: PLC0415
  finally:
    del sys.modules["torch"]
  return SummaryWriter


class MetricWriter:
  """Every metric row to the run's loggers (train.loggers): jsonl (WORKDIR/metrics.jsonl, the run's
  record: resume, plots and tests read it), tensorboard (WORKDIR/tb, tensorboardX) and wandb (Weights &
  Biases, offline unless WANDB_MODE says otherwise, files under WORKDIR/wandb; `pip install wandb`)."""

  def __init__(self, workdir: pathlib.Path, *, enabled: bool = True, truncate_after: int | None = None,
               loggers: Sequence[str] = ("jsonl", "tensorboard"), run_config: dict | None = None,
               project: str = "tformer_jax"):
    self.enabled = enabled
    self.path = pathlib.Path(workdir) / METRICS_FILE
    self._tb = self._wandb = None
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
    if "tensorboard" in loggers:
      self._tb = _summary_writer()(str(pathlib.Path(workdir) / "tb"))
    if "wandb" in loggers:
      self._wandb = _wandb_run(pathlib.Path(workdir), project, run_config or {})

  def write(self, step: int, metrics: dict) -> None:
    if not self.enabled:
      return
    scalars = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    self._file.write(json.dumps({"step": int(step), **scalars}) + "\n")
    self._file.flush()
    if self._tb is not None:
      for k, v in scalars.items():
        self._tb.add_scalar(k, v, int(step))
    if self._wandb is not None:
      self._wandb.log(scalars, step=int(step))

  def close(self) -> None:
    if self.enabled:
      self._file.close()
      if self._tb is not None:
        self._tb.close()
      if self._wandb is not None:
        self._wandb.finish()


def _wandb_run(workdir: pathlib.Path, project: str, run_config: dict) -> Any:
  """A W&B run for this workdir: offline by default, one run id per workdir so a resumed run continues it."""
  try:
    import wandb  # noqa: PLC0415 (optional: only runs that ask for it)
  except ImportError:
    raise ConfigError("train.loggers: 'wandb' needs the wandb package (pip install wandb); it is not "
                      "installed") from None
  os.environ.setdefault("WANDB_MODE", "offline")
  os.environ.setdefault("WANDB_SILENT", "true")
  run_id = hashlib.sha256(str(workdir.resolve()).encode()).hexdigest()[:12]
  return wandb.init(project=project, dir=str(workdir), id=run_id, resume="allow", config=run_config,
                    name=workdir.name)


def _step(row: dict) -> float:
  try:
    return float(row.get("step", 0))
  except (TypeError, ValueError):
    return float("inf")    # a row without a usable step cannot be placed: dropped on resume


def read_metrics(workdir) -> list[dict]:
  """The rows of `workdir/metrics.jsonl` ([] if absent); a torn last line is dropped with a warning."""
  path = pathlib.Path(workdir) / METRICS_FILE
  return [row for _, row in _parse(path, path.read_text(errors="replace"))] if path.exists() else []


def bytes_per_token(ds: Any) -> float:
  """UTF-8 bytes per token of a dataset's validation text (1 for the byte tokenizer): turns nats per
  token into bits per byte, comparable across tokenizers."""
  if getattr(ds.tokenizer, "name", "") == "byte" or ds.val_tokens is None:
    return 1.0
  sample = ds.val_tokens[: 200_000]
  return max(1e-9, len(ds.tokenizer.decode(sample).encode("utf-8")) / max(1, len(sample)))


def eval_summary(totals: dict[str, float], bytes_per_tok: float, prefix: str = "val_") -> dict[str, float]:
  """Loss (nats/token), perplexity, bits per byte and token accuracy from summed eval_step outputs."""
  count = max(totals["count"], 1.0)
  loss = totals["nll_sum"] / count
  return {f"{prefix}loss": loss, f"{prefix}ppl": math.exp(min(loss, 50.0)),
          f"{prefix}bpb": loss / math.log(2) / bytes_per_tok, f"{prefix}accuracy": totals["correct"] / count}
