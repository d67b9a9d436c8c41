"""Ablations: short in-process trainings over the cartesian product of config sweeps.

  sweeps = [parse_sweep("model.num_heads=1,4,8"), parse_sweep("model.position=none,rope")]
  results = run_ablation(base_cfg, sweeps, steps=300, out_dir="ablations/heads")
  write_results(results, "ablations/heads")      # results.md, results.json, loss_curves.png

Every run is `tformer_jax.train.loop.train` on a copy of the base config with the overrides applied
(each value text parsed by its field's type, exactly as `--config.KEY=VALUE` on a command line;
tformer_jax/cli_common/), in its own workdir OUT/runs/<name>. Reported per run: the final train
loss (mean of the last 10% of the logged steps, the per-step loss is noisy), the final validation
loss / token accuracy, for synthetic tasks the exact-match accuracy of the answer spans (validation
batches, greedy argmax with teacher forcing), the parameter count, throughput and wall time
(compile included).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import pathlib
import shutil
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from tformer_jax.checkpoint import restore_params
from tformer_jax.cli_common import override
from tformer_jax.data import pipeline, synthetic
from tformer_jax.diagnostics.plots import loss_curves
from tformer_jax.eval.in_training import HarnessEval
from tformer_jax.model_loading import model_from_config
from tformer_jax.train.loop import train
from tformer_jax.train.metrics import read_metrics


def parse_sweep(spec: str) -> tuple[str, list[str]]:
  """'model.num_heads=1,4,8' -> ('model.num_heads', ['1', '4', '8']): each value is set as
  `--config.model.num_heads=4` would set it."""
  key, eq, values = spec.partition("=")
  if not eq or not key or not values:
    raise ValueError(f"bad sweep {spec!r}; expected KEY=V1,V2,... e.g. model.num_heads=1,4,8")
  return key.strip(), [v.strip() for v in values.split(",") if v.strip()]


def grid(sweeps: Sequence[tuple[str, list[Any]]]) -> list[dict[str, Any]]:
  """The cartesian product of the sweeps, as override dicts (first sweep varies slowest)."""
  keys = [k for k, _ in sweeps]
  return [dict(zip(keys, combo)) for combo in itertools.product(*[v for _, v in sweeps])]


def run_name(overrides: dict[str, Any]) -> str:
  if not overrides:
    return "base"
  return ",".join(f"{k.split('.')[-1]}={v}" for k, v in overrides.items())


@dataclasses.dataclass
class RunResult:
  name: str
  overrides: dict[str, Any]
  params: int
  steps: int
  final_train_loss: float
  val_loss: float
  val_accuracy: float
  exact_match: float | None
  wall_s: float
  tokens_per_s: float
  curves: dict[str, list[tuple[int, float]]]
  loss_roughness: float        # mean |loss_t - loss_{t-1}| over the second half of the logged steps

  def row(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d.pop("curves")
    return d


def _curves(workdir: pathlib.Path) -> dict[str, list[tuple[int, float]]]:
  out: dict[str, list[tuple[int, float]]] = {"loss": [], "val_loss": [], "tokens_per_s": []}
  for m in read_metrics(workdir):
    for k in out:
      if k in m:
        out[k].append((int(m["step"]), float(m[k])))
  return out


def exact_match(cfg: ml_collections.ConfigDict, workdir: pathlib.Path) -> float | None:
  """Exact-match accuracy of a synthetic task on the validation batches (None for text corpora)."""
  if not str(cfg.data.corpus).startswith("synthetic:"):
    return None
  _, params = restore_params(workdir)
  model = model_from_config(cfg)
  ds = pipeline.build_dataset(cfg.data)
  fwd = jax.jit(lambda p, x: model.apply({"params": p}, x))
  scores = [float(synthetic.exact_match_accuracy(fwd(params, jnp.asarray(b["inputs"])), b))
            for b in pipeline.eval_batches(ds, cfg.data, int(cfg.train.eval_batches))]
  return float(np.mean(scores))


def _field(cfg: ml_collections.ConfigDict, dotted: str) -> Any:
  """cfg.a.b for 'a.b' (the typed value an override set)."""
  return functools.reduce(lambda node, name: node[name], dotted.split("."), cfg)


def run_one(base: ml_collections.ConfigDict, overrides: dict[str, Any], steps: int, workdir: pathlib.Path,
            evals: int = 4) -> RunResult:
  """Train one configuration from scratch in `workdir` (deleted first) and summarise it."""
  cfg = override(base, overrides)
  cfg.train.steps = steps
  cfg.train.eval_every = max(1, steps // max(evals, 1))
  cfg.train.ckpt_every = steps
  cfg.train.log_every = max(1, steps // 100)
  cfg.train.sample_tokens = 0
  if workdir.exists():
    shutil.rmtree(workdir)
  t0 = time.perf_counter()
  final = train(cfg, workdir, eval_hook=HarnessEval)   # train.eval_tasks, as tformer-train
  wall = time.perf_counter() - t0
  curves = _curves(workdir)
  losses = [v for _, v in curves["loss"]]
  tail = losses[-max(1, len(losses) // 10):]
  half = np.asarray(losses[len(losses) // 2:])
  rough = float(np.mean(np.abs(np.diff(half)))) if half.size > 1 else float("nan")
  tps = [v for _, v in curves["tokens_per_s"]][1:] or [float("nan")]
  return RunResult(
      name=run_name(overrides), overrides={k: _field(cfg, k) for k in overrides},
      params=int(final.get("params", 0)), steps=steps,
      final_train_loss=float(np.mean(tail)) if tail else float("nan"),
      val_loss=float(final.get("val_loss", float("nan"))), val_accuracy=float(final.get("val_accuracy", float("nan"))),
      exact_match=exact_match(cfg, workdir), wall_s=wall, tokens_per_s=float(np.median(tps)), curves=curves,
      loss_roughness=rough)


def run_ablation(base: ml_collections.ConfigDict, sweeps: Sequence[tuple[str, list[Any]]], steps: int,
                 out_dir: str | pathlib.Path, log=print) -> list[RunResult]:
  """Every combination of the sweeps, trained for `steps` steps; results also written as they come."""
  out = pathlib.Path(out_dir)
  results = []
  combos = grid(sweeps)
  for i, overrides in enumerate(combos):
    name = run_name(overrides)
    log(f"[{i + 1}/{len(combos)}] {name}")
    res = run_one(base, overrides, steps, out / "runs" / name.replace("/", "_"))
    log(f"    train {res.final_train_loss:.4f}  val {res.val_loss:.4f}  acc {res.val_accuracy:.4f}"
        + (f"  exact {res.exact_match:.3f}" if res.exact_match is not None else "") + f"  {res.wall_s:.0f}s")
    results.append(res)
    write_results(results, out)
  return results


def markdown_table(results: Sequence[RunResult]) -> str:
  has_em = any(r.exact_match is not None for r in results)
  head = ["run", "params", "steps", "train loss", "val loss", "val ppl", "val acc"]
  head += ["exact match"] if has_em else []
  head += ["loss roughness", "tok/s", "wall s"]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for r in results:
    cells = [r.name, f"{r.params:,}", str(r.steps), f"{r.final_train_loss:.4f}", f"{r.val_loss:.4f}",
             f"{math.exp(min(r.val_loss, 50.0)):.2f}", f"{r.val_accuracy:.4f}"]
    cells += [("-" if r.exact_match is None else f"{r.exact_match:.3f}")] if has_em else []
    cells += [f"{r.loss_roughness:.4f}", f"{r.tokens_per_s:,.0f}", f"{r.wall_s:.0f}"]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def write_results(results: Sequence[RunResult], out_dir: str | pathlib.Path, title: str = ""
                  ) -> dict[str, pathlib.Path]:
  """results.json, results.md and loss_curves.png in `out_dir`."""
  out = pathlib.Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  paths = {"json": out / "results.json", "md": out / "results.md", "png": out / "loss_curves.png"}
  paths["json"].write_text(json.dumps([{**r.row(), "curves": r.curves} for r in results], indent=1))
  paths["md"].write_text((f"# {title}\n\n" if title else "") + markdown_table(results) + "\n")
  loss_curves({r.name: r.curves for r in results}, paths["png"], title=title)
  return paths
