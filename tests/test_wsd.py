"""optim.schedule=wsd (warmup, stable, decay over the last decay_fraction) and train.branch_from (a cooldown
branched from another run's checkpoint: train/branch.py): the schedule's exact values at the phase
boundaries, a branch from step k bitwise equal to one run whose decay starts at k, the source untouched,
and the config errors."""
import json
import os

import numpy as np
import pytest

from tformer_jax.checkpoint import restore_params
from tformer_jax.config import ConfigError, default_config, validate
from tformer_jax.train import optim
from tformer_jax.train.loop import train
from tformer_jax.train.metrics import read_metrics

from train_utils import tiny_config


def _wsd(shape="linear", **kw):
  c = default_config().optim
  c.schedule, c.peak_lr, c.min_lr_ratio, c.warmup_steps, c.decay_shape = "wsd", 2.0, 0.25, 10, shape
  for k, v in kw.items():
    c[k] = v
  return c


@pytest.mark.parametrize("shape,mid", [("linear", 1.25), ("cosine", 1.25), ("1-sqrt", 0.5 + 1.5 * (1 - 0.5 ** 0.5))])
def test_wsd_values_at_the_phase_boundaries_are_exact(shape, mid):
  """100 steps, warmup 10, decay_fraction 0.2: 0 at step 0, peak from the warmup's end through step 80 (the
  decay's start), the floor at step 100 and after, exactly; halfway through the decay as each shape says."""
  s = optim.make_schedule(_wsd(shape), 100)
  peak, floor = np.float32(2.0), np.float32(0.5)
  assert float(s(0)) == 0.0 and float(s(5)) == pytest.approx(1.0)
  for step in (10, 11, 50, 79, 80):
    assert np.float32(s(step)) == peak, (step, float(s(step)))
  assert np.float32(s(100)) == floor and np.float32(s(120)) == floor
  assert float(s(90)) == pytest.approx(mid, rel=1e-6)
  assert floor < float(s(81)) < peak and float(s(99)) < float(s(90))
  # a branch's decay start replaces the fraction's
  b = optim.make_schedule(_wsd(shape), 100, decay_start=60)
  assert np.float32(b(60)) == peak and np.float32(b(100)) == floor and float(b(80)) == pytest.approx(mid, rel=1e-6)
  # decay_fraction 0: warmup then constant, never decays
  assert np.float32(optim.make_schedule(_wsd(shape, decay_fraction=0.0), 100)(100)) == peak


def _source_snapshot(path) -> dict[str, tuple[int, int]]:
  return {os.path.relpath(os.path.join(d, f), path): (os.stat(os.path.join(d, f)).st_size,
                                                      os.stat(os.path.join(d, f)).st_mtime_ns)
          for d, _, files in os.walk(path) for f in files} | {
          os.path.relpath(d, path): (0, os.stat(d).st_mtime_ns) for d, _, _ in os.walk(path)}


WSD = {"optim.schedule": "wsd", "optim.warmup_steps": 2, "optim.min_lr_ratio": 0.0}


def test_branched_cooldown_equals_one_run_decaying_from_its_step(tmp_path):
  """A stable run (decay_fraction 0) saves step 3; a branch from stable@3 to step 6 decays over steps 4-6.
  One uninterrupted wsd run of 6 steps with decay_fraction 0.5 (its decay starts at 3) gives the same
  losses and learning rates at every step and the same final parameters, bit for bit; the source is
  untouched and the branch records where it came from."""
  stable, branch, whole = tmp_path / "stable", tmp_path / "branch", tmp_path / "whole"
  train(tiny_config(steps=6, **WSD, **{"optim.decay_fraction": 0.0, "train.ckpt_every": 3}), stable)
  before = _source_snapshot(stable)
  train(tiny_config(steps=6, **WSD, **{"train.branch_from": f"{stable}@3"}), branch)
  train(tiny_config(steps=6, **WSD, **{"optim.decay_fraction": 0.5}), whole)
  assert _source_snapshot(stable) == before
  rows = lambda d: {r["step"]: (r["loss"], r["lr"]) for r in read_metrics(d) if "loss" in r}  # noqa: E731
  got, want, src = rows(branch), rows(whole), rows(stable)
  assert sorted(got) == [4, 5, 6]
  assert all(got[s] == want[s] for s in (4, 5, 6)), (got, want)
  assert all(src[s] == want[s] for s in (1, 2, 3))          # the same run until the decay starts
  peak = float(np.float32(3e-3))
  assert got[4][1] == peak and got[5][1] < peak and src[5][1] == peak   # decays from the branch point
  for a, b in zip(*(jax_leaves(restore_params(d)[1]) for d in (branch, whole))):
    np.testing.assert_array_equal(a, b)
  recorded = json.loads((branch / "config.json").read_text())["train"]["branch_from"]
  assert recorded == f"{stable.resolve()}@3"


def test_a_branch_never_becomes_a_resume_of_another_run(tmp_path):
  """A branch into its own source (or a folder inside it), into a workdir holding another branch or a run that was
  not branched: each one line before anything trains, every workdir as it was; the branch a workdir records
  resumes, with or without its step named. The source is never written."""
  src, b, plain = tmp_path / "src", tmp_path / "b", tmp_path / "plain"
  train(tiny_config(steps=6, **{"train.ckpt_every": 3}), src)
  train(tiny_config(steps=3), plain)
  train(tiny_config(steps=5, **{"train.branch_from": f"{src}@3"}), b)
  snaps = {d: _source_snapshot(d) for d in (src, b, plain)}
  cases = [
      (src, f"{src}@3", r"the workdir .*src is the source .*src: a branch never writes its source"),
      (src / "cool", f"{src}@3", r"is inside the source"),
      (b, f"{src}@6", rf"{b} already holds the branch from {src}@3; asked to branch from {src}@6"),
      (b, f"{plain}@3", rf"already holds the branch from {src}@3; asked to branch from {plain}@3"),
      (plain, f"{src}@3", rf"{plain} already holds a run that was not branched; asked to branch from {src}@3"),
  ]
  for workdir, branch_from, match in cases:
    with pytest.raises(ConfigError, match=match):
      train(tiny_config(steps=9, **{"train.branch_from": branch_from}), workdir)
    assert {d: _source_snapshot(d) for d in (src, b, plain)} == snaps, (workdir, branch_from)
  assert not (src / "cool").exists()
  train(tiny_config(steps=6, **{"train.branch_from": str(src)}), b)       # its recorded step, not the latest
  assert json.loads((b / "config.json").read_text())["train"]["branch_from"] == f"{src.resolve()}@3"
  train(tiny_config(steps=7, **{"train.branch_from": f"{src}@3"}), b)
  assert max(r["step"] for r in read_metrics(b) if "loss" in r) == 7
  assert _source_snapshot(src) == snaps[src]


def jax_leaves(tree):
  import jax  # noqa: PLC0415
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_branch_errors_are_one_line(tmp_path):
  src = tmp_path / "src"
  train(tiny_config(steps=3, **{"train.ckpt_every": 3}), src)
  with pytest.raises(ConfigError, match=r"train.branch_from: .* has no checkpoint step 2; available: \[3\]"):
    train(tiny_config(steps=6, **{"train.branch_from": f"{src}@2"}), tmp_path / "b1")
  with pytest.raises(ConfigError, match="trained with optim.name=adamw, this run sets muon"):
    train(tiny_config(steps=6, **{"train.branch_from": str(src), "optim.name": "muon"}), tmp_path / "b2")
  with pytest.raises(ConfigError, match="train.branch_from: step 3 is not before train.steps=3"):
    validate(tiny_config(steps=3, **{"train.branch_from": f"{src}@3"}))
  with pytest.raises(ConfigError, match="not a training workdir"):
    validate(tiny_config(steps=6, **{"train.branch_from": str(tmp_path / "nothing")}))
  with pytest.raises(ConfigError, match="set one of them"):
    validate(tiny_config(steps=6, **{"train.branch_from": str(src), "train.init_from": str(src)}))
  assert not (tmp_path / "b1").exists() and not (tmp_path / "b2").exists()


@pytest.mark.parametrize("field,value,match", [
    ("optim.decay_fraction", 1.0, "must be in \\[0, 1\\)"),
    ("optim.decay_shape", "sqrt", "unknown value 'sqrt'"),
    ("optim.warmup_steps", 90, "would end after its decay starts at step 80"),
    ("train.logit_z_loss", -1.0, "must be >= 0"),
    ("optim.muon_ns_steps", 0, "must be >= 1"),
])
def test_wsd_and_friends_are_validated(field, value, match):
  c = tiny_config(steps=100, **{"optim.schedule": "wsd", field: value})
  with pytest.raises(ConfigError, match=f"{field}: .*{match}"):
    validate(c)
