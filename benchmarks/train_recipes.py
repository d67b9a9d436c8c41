"""The issue-55 grid on configs/experiments/train_recipes.py: Muon vs AdamW, WSD vs cosine, two cooldowns
branched from one stable run, and the z-loss at high learning rates; every arm over --lrs x --seeds.

  python benchmarks/train_recipes.py --steps 200 --zloss-lrs 1.6e-2,3.2e-2 --out runs/exp/recipes \
      --json docs/results/train_recipes_DATE.json [--arms adamw,muon,wsd,cooldown,zloss]

A second call with more --lrs / --muon-lrs and the same --json adds runs (those already there are kept:
docs/experiments.md's brackets).

Arms (all AdamW + cosine unless named):
  adamw     the baseline, at each lr and seed
  muon      optim.name=muon, over --muon-lrs (muon_rms 0.2 puts its updates at AdamW's RMS; its best lr
            at this scale still sits above AdamW's)
  wsd       optim.schedule=wsd, decay_fraction 0.2, decay_shape 1-sqrt
  cooldown  at the best wsd lr: one stable run (wsd, decay_fraction 0) saving steps 0.53 T and 0.8 T, cooled
            down from each over 20% of its length (to 0.67 T and T: train.branch_from), against cosine runs
            of those two lengths
  zloss     at --zloss-lrs (higher), train.logit_z_loss 0 vs --z (1e-4, PaLM's)
Per run: final val loss, the val curve (every 25 steps), the last logged train loss, mean logsumexp^2 of
the logits, skipped (non-finite) steps, the largest step-to-step rise of the train loss, wall seconds.
Summary: per arm the best lr (mean final val over seeds); Muon's steps to AdamW's best final val loss
(linear between evaluations), per seed.
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import shutil
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]


def _config(steps: int, lr: float, seed: int, **over):
  from tformer_jax.config import load_config_file  # noqa: PLC0415 (jax after the flags)
  c = load_config_file(REPO / "configs" / "experiments" / "train_recipes.py")
  c.train.steps, c.optim.peak_lr, c.train.seed, c.data.seed = steps, lr, seed, seed
  for key, value in over.items():
    node = c
    *path, last = key.split(".")
    for p in path:
      node = node[p]
    node[last] = value
  return c


def _run(name: str, cfg, out: pathlib.Path, results: dict) -> dict:
  from tformer_jax.train.loop import train  # noqa: PLC0415
  from tformer_jax.train.metrics import read_metrics  # noqa: PLC0415
  work = out / name
  if name in results:
    return results[name]
  shutil.rmtree(work, ignore_errors=True)
  t0 = time.time()
  try:
    train(cfg, work)
    error = None
  except Exception as e:  # noqa: BLE001 - a diverged run is a result (TrainingError: repeated non-finite steps)
    error = f"{type(e).__name__}: {str(e)[:200]}"
  rows = read_metrics(work) if (work / "metrics.jsonl").exists() else []
  train_rows = [r for r in rows if "loss" in r]
  val = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
  losses = [r["loss"] for r in train_rows]
  rec = {"config": {"optim.name": cfg.optim.name, "optim.schedule": cfg.optim.schedule, "lr": cfg.optim.peak_lr,
                    "seed": cfg.train.seed, "steps": cfg.train.steps, "z": cfg.train.logit_z_loss,
                    "branch_from": cfg.train.branch_from},
         "val": val, "final_val": val[max(val)] if val else None,
         "train_loss": losses[-1] if losses else None,
         "logit_lse_sq": train_rows[-1].get("logit_lse_sq") if train_rows else None,
         "skipped": train_rows[-1].get("skipped") if train_rows else None,
         "max_rise": max((b - a for a, b in zip(losses, losses[1:])), default=0.0),
         "wall_s": round(time.time() - t0, 1), "error": error}
  results[name] = rec
  print(f"{name}: val {rec['final_val']} lse^2 {rec['logit_lse_sq']} ({rec['wall_s']} s){' ' + error if error else ''}",
        flush=True)
  return rec


def _steps_to(curve: dict, target: float) -> float | None:
  """The first step where the val curve reaches `target`, linear between evaluations; None if never."""
  pts = sorted((int(s), v) for s, v in curve.items())
  prev = (0, float("inf"))
  for s, v in pts:
    if v <= target:
      if prev[1] == float("inf"):
        return float(s)
      return prev[0] + (s - prev[0]) * (prev[1] - target) / (prev[1] - v)
    prev = (s, v)
  return None


def _best(results: dict, prefix: str, lrs, seeds) -> float:
  def mean(lr):
    vals = [results.get(f"{prefix}_lr{lr:g}_s{s}", {}).get("final_val") for s in seeds]
    vals = [v for v in vals if v is not None]
    return sum(vals) / len(vals) if vals else float("inf")
  return min(lrs, key=mean)


def _grid(a, lrs, mlrs, seeds, arms, out, results, save) -> None:
  """The adamw, muon and wsd arms: every lr x seed (muon: its own lrs)."""
  for arm, over in (("adamw", {}), ("muon", {"optim.name": "muon"}),
                    ("wsd", {"optim.schedule": "wsd", "optim.decay_fraction": 0.2, "optim.decay_shape": "1-sqrt"})):
    if arm in arms or (arm == "adamw" and "muon" in arms):
      for lr in (mlrs if arm == "muon" else lrs):
        for s in seeds:
          _run(f"{arm}_lr{lr:g}_s{s}", _config(a.steps, lr, s, **over), out, results)
          save()


def _muon_summary(T, lrs, mlrs, seeds, results) -> dict:
  """Best lrs, and Muon's steps to AdamW's best final val loss per seed."""
  b_a, b_m = _best(results, "adamw", lrs, seeds), _best(results, "muon", mlrs, seeds)
  per = {}
  for s in seeds:
    target = results[f"adamw_lr{b_a:g}_s{s}"]["final_val"]
    reach = _steps_to(results[f"muon_lr{b_m:g}_s{s}"]["val"], target)
    per[s] = {"adamw_final_val": target, "muon_final_val": results[f"muon_lr{b_m:g}_s{s}"]["final_val"],
              "muon_steps_to_it": reach, "speedup": (T / reach) if reach else None}
  return {"adamw_best_lr": b_a, "muon_best_lr": b_m, "muon_vs_adamw": per}


def _cooldowns(T, lr, seeds, out, results, save) -> None:
  """One stable run per seed, cooled down from 0.8 x (2T/3) and 0.8 x T over 20% of each length; cosine
  runs of both lengths beside them."""
  k1, k2, t1 = int(round(0.8 * 2 * T / 3)), int(round(0.8 * T)), int(round(2 * T / 3))
  for s in seeds:
    stable = f"stable_lr{lr:g}_s{s}"
    _run(stable, _config(T, lr, s, **{"optim.schedule": "wsd", "optim.decay_fraction": 0.0,
                                      "train.ckpt_every": math.gcd(k1, k2), "train.max_to_keep": 100}),
         out, results)
    for k, end in ((k1, t1), (k2, T)):
      _run(f"cool_{k}to{end}_lr{lr:g}_s{s}",
           _config(end, lr, s, **{"optim.schedule": "wsd", "optim.decay_shape": "1-sqrt",
                                  "train.branch_from": f"{(out / stable).resolve()}@{k}"}), out, results)
      if end == T and f"adamw_lr{lr:g}_s{s}" in results:   # the baseline arm's run
        results[f"cosine{end}_lr{lr:g}_s{s}"] = results[f"adamw_lr{lr:g}_s{s}"]
      _run(f"cosine{end}_lr{lr:g}_s{s}", _config(end, lr, s), out, results)
      save()


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--steps", type=int, default=200)
  ap.add_argument("--lrs", default="1e-3,2e-3,4e-3")
  ap.add_argument("--muon-lrs", default="4e-3,8e-3,1.6e-2")
  ap.add_argument("--zloss-lrs", default="8e-3,1.6e-2,3.2e-2")
  ap.add_argument("--z", type=float, default=1e-4)
  ap.add_argument("--seeds", default="0,1")
  ap.add_argument("--arms", default="adamw,muon,wsd,cooldown,zloss")
  ap.add_argument("--out", default="runs/exp/recipes")
  ap.add_argument("--json", default="")
  a = ap.parse_args(argv)
  lrs = [float(x) for x in a.lrs.split(",")]
  mlrs = [float(x) for x in a.muon_lrs.split(",")]
  seeds = [int(x) for x in a.seeds.split(",")]
  arms = a.arms.split(",")
  out = pathlib.Path(a.out)
  out.mkdir(parents=True, exist_ok=True)
  js = pathlib.Path(a.json) if a.json else out / "results.json"
  results = json.loads(js.read_text()).get("runs", {}) if js.exists() else {}
  summary: dict = {}

  def save():
    js.parent.mkdir(parents=True, exist_ok=True)
    js.write_text(json.dumps({"argv": sys.argv[1:], "runs": results, "summary": summary}, indent=1))

  _grid(a, lrs, mlrs, seeds, arms, out, results, save)
  if "muon" in arms:
    summary.update(_muon_summary(a.steps, lrs, mlrs, seeds, results))
  if "wsd" in arms:
    summary["wsd_best_lr"] = _best(results, "wsd", lrs, seeds)
  if "cooldown" in arms:
    _cooldowns(a.steps, summary.get("wsd_best_lr", lrs[len(lrs) // 2]), seeds, out, results, save)
  if "zloss" in arms:
    for lr in [float(x) for x in a.zloss_lrs.split(",")]:
      for s in seeds:
        for z in (0.0, a.z):
          _run(f"z{z:g}_lr{lr:g}_s{s}", _config(a.steps, lr, s, **{"train.logit_z_loss": z}), out, results)
          save()
  save()
  print(json.dumps(summary, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
