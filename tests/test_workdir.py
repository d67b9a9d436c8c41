"""One run per workdir, nothing overwritten by a command that does not belong there, honest messages.

Faults injected for real: two training processes on one workdir, a holder killed with SIGKILL, a lock
file left by a dead process, a rerun with another architecture, SIGTERM during a non-finite streak.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tformer_jax.checkpoint import CheckpointError, restore_params
from tformer_jax.config import ConfigError
from tformer_jax.model_loading import check_params, model_from_config
from tformer_jax.train import workdir as workdir_lib
from tformer_jax.train.loop import TrainingError, train

from train_utils import REPO, env, run, tiny_config, train_cmd


def _wait_for(predicate, timeout: float = 120.0) -> None:
  end = time.time() + timeout
  while time.time() < end:
    if predicate():
      return
    time.sleep(0.2)
  raise AssertionError("timed out")


def _holder(path) -> dict:
  text = (path / workdir_lib.LOCK_NAME).read_text() if (path / workdir_lib.LOCK_NAME).exists() else ""
  return json.loads(text) if text.strip() else {}


@pytest.mark.slow
def test_second_run_on_a_workdir_stops_at_once_and_a_killed_holder_is_taken_over(tmp_path):
  work = tmp_path / "run"
  first = subprocess.Popen(train_cmd(work, "--config.train.steps=100000", "--config.train.ckpt_every=100000"),
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env())
  try:
    _wait_for(lambda: _holder(work).get("pid") == first.pid)
    t0 = time.time()
    second = run(train_cmd(work, "--config.train.steps=2"), timeout=120)
    assert second.returncode == 2, second.stderr[-2000:]
    err = [line for line in second.stderr.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and f"in use by pid {first.pid}" in err[0], second.stderr[-2000:]
    assert "Traceback" not in second.stderr
    assert time.time() - t0 < 60   # no Orbax timeout: stopped before touching checkpoints
    assert not (work / "checkpoints").exists() or not any((work / "checkpoints").iterdir())
  finally:
    first.send_signal(signal.SIGKILL)
    first.wait(30)
  third = run(train_cmd(work, "--config.train.steps=2"), timeout=300)
  assert third.returncode == 0, third.stderr[-3000:]
  assert f"taking over the lock left by pid {first.pid}" in third.stderr
  assert _holder(work) == {}   # released cleanly at the end
  rows = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows if "loss" in r] == [1, 2]


def test_lock_is_exclusive_within_a_host(tmp_path):
  with workdir_lib.WorkdirLock(tmp_path):
    with pytest.raises(workdir_lib.WorkdirBusy, match=f"in use by pid {os.getpid()}"):
      workdir_lib.WorkdirLock(tmp_path).acquire()
  workdir_lib.WorkdirLock(tmp_path).acquire().release()   # free again after release


def test_stale_lock_file_is_taken_over_with_a_warning(tmp_path, caplog):
  (tmp_path / workdir_lib.LOCK_NAME).write_text(json.dumps({"pid": 999999, "host": "h", "argv": ["x"]}))
  with caplog.at_level("WARNING", logger="tformer_jax"):
    train(tiny_config(steps=2), tmp_path)
  assert any("taking over the lock left by pid 999999" in r.getMessage() for r in caplog.records)


def test_other_architecture_leaves_the_workdir_untouched(tmp_path):
  train(tiny_config(steps=2), tmp_path)
  saved = (tmp_path / "config.json").read_bytes()
  steps = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
  with pytest.raises(ConfigError, match=r"model.d_model: 64 in the workdir, 32 now.*model.num_heads"):
    train(tiny_config(steps=4, **{"model.d_model": 32, "model.num_heads": 2}), tmp_path)
  assert (tmp_path / "config.json").read_bytes() == saved
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == steps
  # a rerun that only changes execution or the schedule is fine
  train(tiny_config(steps=3, **{"model.remat": "full", "runtime.attention": "reference"}), tmp_path)


def test_generate_checks_the_config_against_the_checkpoint(tmp_path):
  train(tiny_config(steps=2), tmp_path)
  cfg, params = restore_params(tmp_path)
  model = model_from_config(cfg)
  assert check_params(model, params, "run") is params
  cfg.model.d_model = 32
  with pytest.raises(CheckpointError, match=r"do not fit the config's model: .*config \(\d+, 32\) vs "
                                            r"checkpoint \(\d+, 64\)"):
    check_params(model_from_config(cfg), params, "run")
  r = run([sys.executable, str(REPO / "scripts" / "generate.py"), f"--workdir={tmp_path}",
           "--config.model.d_model=32", "--max_new_tokens=2"], timeout=120)
  assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
  assert r.stderr.strip().splitlines()[-1].startswith("error: ") and "do not fit" in r.stderr


# -- honest messages -------------------------------------------------------------------------------

DIVERGE = {"optim.peak_lr": 1e30, "optim.warmup_steps": 0, "optim.clip_norm": 0.0}


def test_nonfinite_halt_without_a_checkpoint_says_so(tmp_path):
  cfg = tiny_config(steps=20, **DIVERGE, **{"train.max_nonfinite": 2})
  with pytest.raises(TrainingError, match="no checkpoint was saved yet"):
    train(cfg, tmp_path)


@pytest.mark.slow
def test_sigterm_during_a_nonfinite_streak_does_not_claim_a_save(tmp_path):
  flags = [f"--config.{k}={v}" for k, v in DIVERGE.items()] + [
      "--config.train.max_nonfinite=100000", "--config.train.steps=100000", "--config.train.ckpt_every=100000"]
  p = subprocess.Popen(train_cmd(tmp_path, *flags), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                       text=True, env=env())
  lines = []
  try:
    for line in p.stderr:   # wait for the streak, then stop the run for real
      lines.append(line)
      if "update skipped" in line:
        p.send_signal(signal.SIGTERM)
        break
    _, out = p.communicate(timeout=120)
  finally:
    p.kill()
  text = "".join(lines) + out
  assert p.returncode == 0, text[-3000:]
  assert "SIGTERM received at step" in text and "not saved (non-finite steps); no checkpoint yet" in text
  assert "saved step" not in text


def test_a_run_that_fails_before_saving_leaves_no_new_workdir(tmp_path):
  train(tiny_config(steps=2), tmp_path / "a")
  shutil.rmtree(tmp_path / "a" / "checkpoints")             # a fine-tuning source without weights
  other = tiny_config(steps=2, **{"train.init_from": str(tmp_path / "a")})
  with pytest.raises(CheckpointError):
    train(other, tmp_path / "b")   # fails after the lock and the checkpoint directory were made
  assert not (tmp_path / "b").exists()


def test_a_folder_of_the_users_own_files_is_refused_and_left_as_it_was(tmp_path):
  mine = tmp_path / "notes"
  mine.mkdir()
  (mine / "draft.txt").write_text("my own notes")
  (mine / "config.json").write_text('{"not": "a run"}')
  with pytest.raises(ConfigError, match=r"workdir: .*notes holds files that are not a training run's "
                                        r"\(config.json, draft.txt\)"):
    train(tiny_config(steps=1), mine)
  assert sorted(p.name for p in mine.iterdir()) == ["config.json", "draft.txt"]
  assert (mine / "config.json").read_text() == '{"not": "a run"}'
  (tmp_path / "empty").mkdir()
  workdir_lib.check_owned(tmp_path / "empty")        # an empty directory, a new one and a run's are fine
  workdir_lib.check_owned(tmp_path / "new")
  (mine / "checkpoints").mkdir()
  workdir_lib.check_owned(mine)
