"""Checkpoint and metrics reliability with the faults injected for real.

Save failures: the checkpoint directory is a regular file, or a path component is (root ignores
permissions, so these stand in for read-only); a full disk (a small tmpfs mounted over the directory,
where mounting is allowed); a file-size limit (RLIMIT_FSIZE: the kernel refuses the write, EFBIG);
a read-only directory for a process without CAP_DAC_OVERRIDE (setpriv drops it; plain chmod for a
non-root user), before the run and in the middle of it. Damage: a flipped byte in a saved array file,
a deleted item directory (data, manifest, meta), a changed JSON item, every step unreadable; a torn
last line of metrics.jsonl. End to end through `train()` and scripts/train.py.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import pathlib
import resource
import shutil
import signal
import subprocess
import sys
import time

import jax
import pytest
from test_checkpoint import abstract, assert_bitwise_equal, make_state

from tformer_jax import checkpoint as ckpt_lib
from tformer_jax.checkpoint import Checkpointer, CheckpointError, restore_params
from tformer_jax.train.loop import train
from tformer_jax.train.metrics import MetricWriter, read_metrics

from train_utils import REPO, env, run, tiny_config, train_cmd


def _one_line(msg: str) -> None:
  assert "\n" not in msg and "Traceback" not in msg, msg
  assert "tensorstore_spec" not in msg and "'driver':" not in msg, msg


def _warnings(caplog) -> list[str]:
  return [r.getMessage() for r in caplog.records
          if r.levelno == logging.WARNING and r.name == "tformer_jax.checkpoint"]


# -- real faults --------------------------------------------------------------------------------------

@contextlib.contextmanager
def _tmpfs(path: pathlib.Path, size: str):
  """A tmpfs of `size` mounted at `path` (a full disk on demand); skips where mounting is not allowed."""
  path.mkdir(parents=True, exist_ok=True)
  if os.geteuid() != 0 or not shutil.which("mount"):
    pytest.skip("mounting a tmpfs needs root")
  r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                     capture_output=True, text=True)
  if r.returncode != 0:
    pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
  try:
    yield path
  finally:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


@contextlib.contextmanager
def _file_size_limit(nbytes: int):
  """RLIMIT_FSIZE for this process: writes past `nbytes` fail with EFBIG (SIGXFSZ ignored)."""
  old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
  soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
  resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
  try:
    yield
  finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    signal.signal(signal.SIGXFSZ, old_handler)


def _unprivileged(cmd: list[str]) -> list[str]:
  """`cmd` run so that file permissions apply to it: as is for a non-root user; for root, under
  setpriv without CAP_DAC_OVERRIDE/CAP_DAC_READ_SEARCH (skips if that is not possible here)."""
  if os.geteuid() != 0:
    return cmd
  prefix = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]
  if not shutil.which("setpriv") or subprocess.run([*prefix, "true"], capture_output=True).returncode != 0:
    pytest.skip("root without setpriv: permissions cannot be made to apply")
  return [*prefix, *cmd]


def _flip_array_byte(step_dir: pathlib.Path) -> pathlib.Path:
  """Overwrite one byte in the middle of the largest array-data file of the step's state: TensorStore
  reads it without complaint (chunks carry no checksum), the values come back changed."""
  files = [p for p in (step_dir / "state").glob("ocdbt.process_*/d/*") if p.is_file()]
  victim = max(files, key=lambda p: p.stat().st_size)
  data = bytearray(victim.read_bytes())
  data[len(data) // 2] ^= 0x5A
  victim.write_bytes(bytes(data))
  return victim


def _delete_array_files(step_dir: pathlib.Path) -> None:
  """Every data file of the state: the read fails for every array (the noisiest failure)."""
  for p in (step_dir / "state").rglob("*"):
    if p.is_file() and p.parent.name == "d":
      p.unlink()


def _save(directory: pathlib.Path, steps=(1, 2), d: int = 8, **kw) -> None:
  with Checkpointer(directory, async_save=False, **kw) as ckpt:
    for s in steps:
      assert ckpt.save(s, make_state(d=d, seed=s), {"next_index": s * 10}, {"note": f"step {s}"})


# == (2) save failures ===================================================================================

@pytest.mark.parametrize("fault", ["directory_is_a_file", "parent_is_a_file"])
def test_unwritable_directory_fails_at_construction(tmp_path, fault):
  if fault == "directory_is_a_file":
    target = tmp_path / "checkpoints"
    target.write_text("not a directory")
  else:
    (tmp_path / "work").write_text("a file where a directory should be")
    target = tmp_path / "work" / "checkpoints"
  t0 = time.monotonic()
  with pytest.raises(CheckpointError, match="is not writable") as err:
    Checkpointer(target)
  assert time.monotonic() - t0 < 10
  _one_line(str(err.value))
  assert str(target) in str(err.value)


def test_save_that_cannot_start_raises_at_once_and_earlier_steps_survive(tmp_path):
  d = tmp_path / "checkpoints"
  ckpt = Checkpointer(d)
  assert ckpt.save(1, make_state(seed=1), {"next_index": 10})
  ckpt.wait()
  d.rename(tmp_path / "moved")           # the directory is gone and a file is in its place
  d.write_text("not a directory")
  t0 = time.monotonic()
  with pytest.raises(CheckpointError, match=r"saving checkpoint step 2 to .* failed") as err:
    ckpt.save(2, make_state(seed=2), {"next_index": 20})
  _one_line(str(err.value))
  ckpt.check()                           # nothing else pending
  ckpt.close()
  assert time.monotonic() - t0 < 10      # no minutes-long wait at exit
  d.unlink()
  (tmp_path / "moved").rename(d)
  with Checkpointer(d) as again:
    step, restored, data, _ = again.restore(abstract(make_state()))
  assert step == 1 and data == {"next_index": 10}
  assert_bitwise_equal(restored, make_state(seed=1))


@pytest.mark.parametrize("fault", ["full_disk", "file_size_limit"])
@pytest.mark.parametrize("caught_by", ["check", "save", "wait", "close"])
def test_failed_async_save_is_raised_once_and_earlier_steps_survive(tmp_path, fault, caught_by):
  """The write fails in Orbax's background threads: the failure surfaces, as one line, through the
  first of check()/save()/wait()/close() that looks, exactly once; step 1 stays restorable."""
  small, big = make_state(seed=1), make_state(d=512, seed=2)     # ~40 kB and ~4 MB on disk
  debug_log = tmp_path / "debug.log"
  disk = _tmpfs(tmp_path / "disk", "1m") if fault == "full_disk" else contextlib.nullcontext(tmp_path / "disk")
  limit = _file_size_limit(256 * 1024) if fault == "file_size_limit" else contextlib.nullcontext()
  with disk as root:
    d = root / "checkpoints"
    ckpt = Checkpointer(d, debug_log=debug_log)
    assert ckpt.save(1, small, {"next_index": 10})
    ckpt.wait()
    ckpt.check()
    t0 = time.monotonic()
    with limit:
      assert ckpt.save(2, big, {"next_index": 20})       # async: starts fine, fails while writing
      if caught_by == "check":
        while True:
          try:
            ckpt.check()
          except CheckpointError as e:
            error = e
            break
          assert time.monotonic() - t0 < 60, "check() never reported the failed save"
          time.sleep(0.02)
        ckpt.check()                                      # reported once
        ckpt.wait()
        ckpt.close()
      else:
        call = {"save": lambda: ckpt.save(3, small, {"next_index": 30}), "wait": ckpt.wait,
                "close": ckpt.close}[caught_by]
        with pytest.raises(CheckpointError) as err:
          call()
        error = err.value
        ckpt.close()
    assert time.monotonic() - t0 < 60
    msg = str(error)
    _one_line(msg)
    assert "saving checkpoint step 2" in msg and "the last complete checkpoint is step 1" in msg
    assert ("No space left on device" if fault == "full_disk" else "File too large") in msg
    assert "Traceback" in debug_log.read_text()
    with Checkpointer(d) as again:
      step, restored, data, _ = again.restore(abstract(small))
    assert step == 1 and data == {"next_index": 10}
    assert_bitwise_equal(restored, small)


def test_close_quiet_logs_the_failure_while_another_error_propagates(tmp_path, caplog):
  """`with ckpt:` / close(quiet=True) in a `finally`: the error already on its way out wins, the
  failed save is one ERROR line."""
  ckpt = Checkpointer(tmp_path / "checkpoints")
  with pytest.raises(KeyError, match="the loop's own error"), caplog.at_level(logging.ERROR):
    with _file_size_limit(256 * 1024), ckpt:       # the limit outlasts the save in flight
      assert ckpt.save(2, make_state(d=512), {"next_index": 20})
      raise KeyError("the loop's own error")
  (record,) = [r for r in caplog.records if r.name == "tformer_jax.checkpoint" and r.levelno == logging.ERROR]
  assert "saving checkpoint step 2" in record.getMessage() and "File too large" in record.getMessage()
  ckpt.close()                                           # closed: nothing left to raise


def test_checkpointer_works_again_once_the_fault_is_gone(tmp_path):
  ckpt = Checkpointer(tmp_path / "checkpoints")
  assert ckpt.save(1, make_state(seed=1), {"next_index": 10})
  with _file_size_limit(256 * 1024):
    assert ckpt.save(2, make_state(d=512, seed=2), {"next_index": 20})
    with pytest.raises(CheckpointError, match="saving checkpoint step 2 .* File too large"):
      ckpt.wait()
  step, restored, _, _ = ckpt.restore(abstract(make_state()))
  assert step == 1
  assert_bitwise_equal(restored, make_state(seed=1))
  assert ckpt.save(3, make_state(seed=3), {"next_index": 30})
  ckpt.close()
  with Checkpointer(tmp_path / "checkpoints") as again:
    assert again.all_steps() == [1, 3]
    assert again.restore(abstract(make_state()))[2] == {"next_index": 30}


def test_check_is_quiet_while_saving_and_after_a_good_save(tmp_path):
  ckpt = Checkpointer(tmp_path / "checkpoints")
  assert ckpt.save(1, make_state(d=256), {"next_index": 1})
  t0 = time.monotonic()
  ckpt.check()                       # never blocks on the save in flight
  assert time.monotonic() - t0 < 1.0
  ckpt.wait()
  ckpt.check()
  ckpt.close()
  ckpt.close()                       # idempotent
  assert ckpt_lib._wait(lambda: time.sleep(2), timeout_s=0.05) is False   # the bounded wait gives up


# == (4) damage: integrity manifest, missing items, one-line errors =========================================

def test_flipped_byte_is_caught_by_the_manifest_and_falls_back(tmp_path, caplog):
  _save(tmp_path, d=128)             # arrays big enough to live in plain (unchecksummed) data files
  _flip_array_byte(tmp_path / "2")
  with Checkpointer(tmp_path) as ckpt, pytest.raises(CheckpointError, match="step 2 .* checksum mismatch") as err:
    ckpt.restore(abstract(make_state(d=128)), step=2)        # an explicit step does not fall back
  _one_line(str(err.value))
  ckpt = Checkpointer(tmp_path)
  with caplog.at_level(logging.WARNING, logger="tformer_jax.checkpoint"):
    step, restored, data, meta = ckpt.restore(abstract(make_state(d=128)))
  assert step == 1 and data == {"next_index": 10} and meta == {"step": 1, "note": "step 1"}
  assert_bitwise_equal(restored, make_state(d=128, seed=1))
  (warning,) = _warnings(caplog)
  assert "step 2" in warning and "array checksum mismatch" in warning and "falling back" in warning
  _one_line(warning)
  assert ckpt.save(2, make_state(d=128, seed=22), {"next_index": 99})   # moved aside, written again
  assert (tmp_path / "2.corrupt").is_dir()
  assert ckpt.restore(abstract(make_state(d=128)))[0] == 2
  ckpt.close()


def test_flipped_param_byte_is_caught_by_restore_params(tmp_path, caplog):
  (tmp_path / "config.json").write_text(json.dumps({"model": {"d_model": 128}}))
  _save(tmp_path / "checkpoints", d=128)
  _, params = restore_params(tmp_path)
  assert_bitwise_equal(params, make_state(d=128, seed=2).params)
  _flip_array_byte(tmp_path / "checkpoints" / "2")
  with caplog.at_level(logging.WARNING, logger="tformer_jax.checkpoint"):
    _, params = restore_params(tmp_path)
  assert_bitwise_equal(params, make_state(d=128, seed=1).params)
  (warning,) = _warnings(caplog)
  assert "step 2" in warning and "checksum mismatch in params/" in warning
  assert "Traceback" in (tmp_path / "debug.log").read_text()


@pytest.mark.parametrize("item", ["data", "manifest", "meta"])
def test_missing_item_is_damage(tmp_path, caplog, item):
  _save(tmp_path)
  shutil.rmtree(tmp_path / "2" / item)
  with Checkpointer(tmp_path) as ckpt, caplog.at_level(logging.WARNING, logger="tformer_jax.checkpoint"):
    step, restored, data, _ = ckpt.restore(abstract(make_state()))
  assert step == 1 and data == {"next_index": 10}
  assert_bitwise_equal(restored, make_state(seed=1))
  (warning,) = _warnings(caplog)
  assert "step 2" in warning
  if item != "meta":
    assert {"data": "data-iterator state", "manifest": "integrity manifest"}[item] in warning


def test_changed_json_item_fails_its_digest(tmp_path, caplog):
  _save(tmp_path)
  path = tmp_path / "2" / "data" / "metadata"
  assert json.loads(path.read_text()) == {"next_index": 20}
  path.write_text(json.dumps({"next_index": 21}))             # valid JSON, wrong position
  with Checkpointer(tmp_path) as ckpt, caplog.at_level(logging.WARNING, logger="tformer_jax.checkpoint"):
    step, _, data, _ = ckpt.restore(abstract(make_state()))
  assert step == 1 and data == {"next_index": 10}
  (warning,) = _warnings(caplog)
  assert "'data' item does not match its digest" in warning


def test_steps_from_before_manifests_restore_unverified_unless_data_is_required(tmp_path, caplog):
  _save(tmp_path)
  for s in ("1", "2"):                       # what the previous version wrote: no manifest, no record
    shutil.rmtree(tmp_path / s / "manifest")
    meta_file = tmp_path / s / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    meta.pop("_checkpoint")
    meta_file.write_text(json.dumps(meta))
  shutil.rmtree(tmp_path / "2" / "data")
  with Checkpointer(tmp_path) as ckpt, caplog.at_level(logging.WARNING, logger="tformer_jax.checkpoint"):
    step, restored, data, meta = ckpt.restore(abstract(make_state()))
    assert step == 2 and data is None and meta == {"step": 2, "note": "step 2"} and not _warnings(caplog)
    assert_bitwise_equal(restored, make_state(seed=2))
    step, _, data, _ = ckpt.restore(abstract(make_state()), require_data_state=True)
  assert step == 1 and data == {"next_index": 10}
  (warning,) = _warnings(caplog)
  assert "step 2" in warning and "data-iterator state" in warning


def test_every_step_unreadable_is_one_line_and_tracebacks_go_to_the_debug_log(tmp_path, caplog, capfd):
  work = tmp_path / "run"
  _save(work / "checkpoints", d=128)
  for s in ("1", "2"):
    _delete_array_files(work / "checkpoints" / s)
  ckpt = Checkpointer(work / "checkpoints")
  with caplog.at_level(logging.WARNING), pytest.raises(CheckpointError) as err:
    ckpt.restore(abstract(make_state(d=128)))
  ckpt.close()
  time.sleep(0.5)                            # TensorStore's late callbacks ("Event loop is closed")
  msg = str(err.value)
  _one_line(msg)
  assert msg.startswith(f"no restorable checkpoint in {work / 'checkpoints'}: all 2 step(s)")
  assert "step 2:" in msg and "step 1:" in msg and f"details in {work / 'debug.log'}" in msg
  warnings = _warnings(caplog)
  assert len(warnings) == 2 and all("\n" not in w for w in warnings)
  assert not [r for r in caplog.records if r.name != "tformer_jax.checkpoint" and r.levelno >= logging.WARNING]
  out, errtext = capfd.readouterr()
  assert "Traceback" not in out + errtext and "Event loop is closed" not in out + errtext
  debug = (work / "debug.log").read_text()
  assert debug.count("cannot be restored") == 2 and "Traceback" in debug


# == (4) metrics.jsonl with a torn last line ===============================================================

TORN = '{"step": 4, "loss": 2.5, "l'


def _write_rows(work: pathlib.Path, steps, torn: bool) -> None:
  text = "".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in steps)
  (work / "metrics.jsonl").write_text(text + (TORN if torn else ""))


def test_read_metrics_drops_a_torn_last_line_with_a_warning(tmp_path, caplog):
  _write_rows(tmp_path, [1, 2, 3], torn=True)
  with caplog.at_level(logging.WARNING, logger="tformer_jax.train.metrics"):
    rows = read_metrics(tmp_path)
  assert [r["step"] for r in rows] == [1, 2, 3]
  assert "last line (4) is incomplete" in caplog.text
  assert read_metrics(tmp_path / "absent") == []


@pytest.mark.parametrize("truncate_after", [2, None])
def test_metric_writer_resumes_over_a_torn_last_line(tmp_path, caplog, truncate_after):
  _write_rows(tmp_path, [1, 2, 3], torn=True)
  with caplog.at_level(logging.WARNING, logger="tformer_jax.train.metrics"):
    writer = MetricWriter(tmp_path, truncate_after=truncate_after)
  writer.write(9, {"loss": 0.5})
  writer.close()
  assert "incomplete" in caplog.text
  kept = [1, 2] if truncate_after == 2 else [1, 2, 3]
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  assert [json.loads(line)["step"] for line in lines] == [*kept, 9]      # every line parses
  assert not list(tmp_path.glob(".metrics.jsonl.tmp*"))


# == end to end through train() ==========================================================================

def _cfg(steps: int, **kw):
  return tiny_config(steps=steps, **{"train.ckpt_every": 4, "train.eval_every": steps, **kw})


def _losses(work: pathlib.Path) -> dict[int, float]:
  return {r["step"]: r["loss"] for r in read_metrics(work) if "loss" in r}


@pytest.fixture(scope="module")
def run12(tmp_path_factory):
  """An uninterrupted 12-step run with checkpoints at 4, 8 and 12: the reference."""
  work = tmp_path_factory.mktemp("run12")
  train(_cfg(12), work)
  assert sorted(p.name for p in (work / "checkpoints").iterdir() if p.name.isdigit()) == ["12", "4", "8"]
  return work


def _crashed_after_8(run12: pathlib.Path, dest: pathlib.Path) -> pathlib.Path:
  """run12 as a run killed between its saves of step 8 and step 12 leaves it."""
  shutil.copytree(run12, dest)
  shutil.rmtree(dest / "checkpoints" / "12")
  (dest / ".lock").unlink(missing_ok=True)
  return dest


def _assert_same_run(work: pathlib.Path, run12: pathlib.Path) -> None:
  _, want = restore_params(run12)
  _, got = restore_params(work)
  assert_bitwise_equal(got, want)
  assert _losses(work) == _losses(run12)


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["data_item_deleted", "array_byte_flipped"])
def test_resume_over_a_damaged_step_falls_back_and_matches_the_uninterrupted_run(run12, tmp_path, caplog,
                                                                                    damage):
  """Before: a step without its data item resumed with the iterator at batch 0, and a flipped byte
  resumed from changed weights; both diverged silently from the uninterrupted run."""
  work = _crashed_after_8(run12, tmp_path / "run")
  if damage == "data_item_deleted":
    shutil.rmtree(work / "checkpoints" / "8" / "data")
  else:
    _flip_array_byte(work / "checkpoints" / "8")
  with caplog.at_level(logging.WARNING, logger="tformer_jax.checkpoint"):
    train(_cfg(12), work)
  warnings = _warnings(caplog)
  assert "checkpoint step 8" in warnings[0] and "falling back" in warnings[0]
  if damage == "data_item_deleted":
    assert "data-iterator state" in warnings[0]
  # (a flipped byte is a checksum mismatch, or a read error when it lands in a compressed chunk's header:
  # which one depends on the file layout of the save; the fallback is the same)
  assert (work / "checkpoints" / "8.corrupt").is_dir()
  _assert_same_run(work, run12)


@pytest.mark.slow
def test_resume_over_a_torn_metrics_line(run12, tmp_path, caplog):
  """Before: json.loads of the torn line crashed every resume."""
  work = _crashed_after_8(run12, tmp_path / "run")
  with (work / "metrics.jsonl").open("a") as f:
    f.write('{"step": 9, "loss": 1.23')                # killed mid-write
  with caplog.at_level(logging.WARNING, logger="tformer_jax.train.metrics"):
    train(_cfg(12), work)
  assert "incomplete" in caplog.text
  _assert_same_run(work, run12)


def test_train_stops_at_once_when_checkpoints_is_not_a_directory(tmp_path):
  (tmp_path / "checkpoints").write_text("a file")
  t0 = time.monotonic()
  with pytest.raises(CheckpointError, match=r"checkpoint directory .*checkpoints is not writable") as err:
    train(_cfg(8), tmp_path)
  assert time.monotonic() - t0 < 120
  _one_line(str(err.value))
  assert not (tmp_path / "metrics.jsonl").exists()


@pytest.fixture(scope="module")
def disk_full_run(tmp_path_factory):
  """60 steps, a save every 20, on a 2 MiB tmpfs: step 20 (1.4 MB) fits, step 40 does not."""
  work = tmp_path_factory.mktemp("disk_full")
  with _tmpfs(work / "checkpoints", "2m"):
    t0 = time.monotonic()
    with pytest.raises(CheckpointError) as err:
      train(_cfg(60, **{"train.ckpt_every": 20}), work)
    elapsed = time.monotonic() - t0
    steps = sorted(int(p.name) for p in (work / "checkpoints").iterdir() if p.name.isdigit())
    _, params = restore_params(work)
    yield work, err.value, elapsed, steps, params


@pytest.mark.slow
def test_full_disk_mid_run_stops_the_run_in_one_line_and_keeps_the_last_step(disk_full_run):
  """Before: an Orbax RESOURCE_EXHAUSTED traceback."""
  work, error, elapsed, steps, params = disk_full_run
  msg = str(error)
  _one_line(msg)
  assert msg.startswith(f"saving checkpoint step 40 to {work / 'checkpoints'} failed: No space left on device")
  assert "the last complete checkpoint is step 20" in msg and f"details in {work / 'debug.log'}" in msg
  assert steps == [20] and jax.tree.leaves(params)
  assert elapsed < 300
  assert "No space left on device" in (work / "debug.log").read_text()


@pytest.mark.slow
def test_full_disk_stops_the_run_within_steps_of_the_failed_save(disk_full_run):
  """With check() every step the run stops soon after the failed save of step 40, not at the next
  save (step 60) or at exit."""
  work, _, _, _, _ = disk_full_run
  last = max(_losses(work))
  assert 40 <= last < 55, last


# == end to end through scripts/train.py =====================================================================

@pytest.mark.slow
def test_cli_read_only_checkpoints_fails_at_start_in_one_line(tmp_path):
  """Before: the run trained on with nothing saved, a PermissionError traceback came from Orbax's
  background thread, and the exit blocked ~300 s."""
  (tmp_path / "checkpoints").mkdir()
  os.chmod(tmp_path / "checkpoints", 0o555)
  t0 = time.monotonic()
  r = run(_unprivileged(train_cmd(tmp_path, "--config.train.steps=6", "--config.train.ckpt_every=3")), timeout=240)
  assert time.monotonic() - t0 < 120
  assert r.returncode == 2, r.stderr[-3000:]
  assert "Traceback" not in r.stderr, r.stderr[-3000:]
  last = r.stderr.strip().splitlines()[-1]
  assert last.startswith("error: checkpoint directory") and "is not writable: Permission denied" in last, last
  assert not read_metrics(tmp_path)


@pytest.mark.slow
def test_cli_checkpoints_made_read_only_mid_run_stops_at_the_next_save(tmp_path):
  os.makedirs(tmp_path / "checkpoints")
  cmd = _unprivileged(train_cmd(tmp_path, "--config.train.steps=400", "--config.train.ckpt_every=3",
                                "--config.train.eval_every=400"))
  proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  try:
    t0 = time.monotonic()
    while not (tmp_path / "checkpoints" / "3").is_dir():
      assert proc.poll() is None, proc.stderr.read()[-3000:]
      assert time.monotonic() - t0 < 240, "no checkpoint written"
      time.sleep(0.05)
    os.chmod(tmp_path / "checkpoints", 0o555)
    t_fault = time.monotonic()
    _, err = proc.communicate(timeout=180)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.communicate()
  assert time.monotonic() - t_fault < 60
  os.chmod(tmp_path / "checkpoints", 0o755)
  assert proc.returncode == 2, err[-3000:]
  assert "Traceback" not in err, err[-3000:]
  last = err.strip().splitlines()[-1]
  assert last.startswith("error: saving checkpoint step ") and "Permission denied" in last, last
  failed = int(last.split("saving checkpoint step ")[1].split()[0])
  # The save that failed is reported by the next one at the latest: it fails at once if its step
  # directory could not be created, or in the background if the chmod came before its final rename.
  assert failed % 3 == 0 and failed <= max(_losses(tmp_path)) <= failed + 3
  saved = Checkpointer(tmp_path / "checkpoints").all_steps()
  assert saved and max(saved) < failed and f"the last complete checkpoint is step {max(saved)}" in last
  restore_params(tmp_path)


@pytest.fixture(scope="module")
def cli_run6(tmp_path_factory):
  work = tmp_path_factory.mktemp("cli6") / "run"
  r = run(train_cmd(work, "--config.train.steps=6", "--config.train.ckpt_every=3", "--config.train.eval_every=6"))
  assert r.returncode == 0, r.stderr[-3000:]
  return work


@pytest.mark.slow
def test_cli_fallback_prints_one_warning_line_and_no_library_tracebacks(cli_run6, tmp_path):
  """Before: the fallback warning carried TensorStore's spec over a dozen lines and was followed by
  dozens of 'Event loop is closed' tracebacks (thousands with a bigger model)."""
  work = tmp_path / "run"
  shutil.copytree(cli_run6, work)
  _delete_array_files(work / "checkpoints" / "6")
  r = run(train_cmd(work, "--config.train.steps=9", "--config.train.ckpt_every=3", "--config.train.eval_every=9"))
  assert r.returncode == 0, r.stderr[-3000:]
  assert "resumed from step 3" in r.stderr
  assert "Traceback" not in r.stderr and "Event loop is closed" not in r.stderr, r.stderr[-3000:]
  warnings = [line for line in r.stderr.splitlines() if "WARNING tformer_jax.checkpoint: checkpoint step 6" in line]
  assert len(warnings) == 1 and "falling back" in warnings[0] and f"details in {work / 'debug.log'}" in warnings[0]
  follows = r.stderr.split(warnings[0])[1].splitlines()[1:2]
  assert not follows or not follows[0].startswith(" "), follows       # nothing indented after it
  assert "Traceback" in (work / "debug.log").read_text()


@pytest.mark.slow
def test_cli_every_step_unreadable_is_one_error_line(cli_run6, tmp_path):
  work = tmp_path / "run"
  shutil.copytree(cli_run6, work)
  for s in ("3", "6"):
    _delete_array_files(work / "checkpoints" / s)
  r = run(train_cmd(work, "--config.train.steps=9", "--config.train.ckpt_every=3"))
  assert r.returncode == 2, r.stderr[-3000:]
  assert "Traceback" not in r.stderr and "Event loop is closed" not in r.stderr, r.stderr[-3000:]
  last = r.stderr.strip().splitlines()[-1]
  assert last.startswith(f"error: no restorable checkpoint in {work / 'checkpoints'}: all 2 step(s)"), last
  assert len(last) < 1000


@pytest.mark.slow
def test_two_processes_agree_on_a_damaged_step_and_fall_back_together(tmp_path):
  """Checksums are computed on the global arrays (under jit), so both processes of a 2-process run
  see the byte flipped in process 1's data file and fall back to the same step."""
  def launch(*flags: str) -> subprocess.CompletedProcess:
    args = train_cmd(tmp_path, "--config.mesh.shape=(1,2,2)", "--config.mesh.rules=fsdp_tp", *flags)[2:]
    return run([sys.executable, str(REPO / "scripts" / "launch_local.py"), "--processes", "2",
                "--devices-per-process", "2", "--", *args], timeout=300)

  r = launch("--config.train.steps=4", "--config.train.eval_every=4", "--config.train.ckpt_every=2")
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
  files = [p for p in (tmp_path / "checkpoints" / "4" / "state").glob("ocdbt.process_1/d/*")]
  victim = max(files, key=lambda p: p.stat().st_size)
  data = bytearray(victim.read_bytes())
  data[len(data) // 2] ^= 0x5A
  victim.write_bytes(bytes(data))
  r = launch("--config.train.steps=6", "--config.train.eval_every=6", "--config.train.ckpt_every=2")
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
  for p in ("[p0]", "[p1]"):
    lines = [line for line in r.stdout.splitlines() if line.startswith(p)]
    assert any("checkpoint step 4" in line and "checksum mismatch" in line for line in lines), r.stdout[-3000:]
    assert any("resumed from step 2" in line for line in lines), r.stdout[-3000:]
  assert "Traceback" not in r.stdout + r.stderr
  assert (tmp_path / "checkpoints" / "4.corrupt").is_dir() and (tmp_path / "checkpoints" / "6").is_dir()
