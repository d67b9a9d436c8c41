"""The training loop end to end on real Shakespeare text: loss falls, overfitting, crash/resume bitwise,
SIGTERM, checkpoint fallback, the non-finite guard, and bad input."""
import json
import os
import signal
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tformer_jax import cli_common
from tformer_jax.checkpoint import restore_params
from tformer_jax.cli import train as train_cli
from tformer_jax.config import ConfigError, ModelConfig, resolved
from tformer_jax.nn import Transformer
from tformer_jax.train import optim, precision, state as state_lib, step as step_lib
from tformer_jax.train.loop import TrainingError, train
from tformer_jax.train.metrics import read_metrics

from train_utils import env, run, tiny_config, train_cmd


@pytest.mark.slow
def test_end_to_end_shakespeare_validation_loss_falls(tmp_path):
  cfg = tiny_config(steps=180, **{"train.eval_every": 60, "train.log_every": 20})
  final = train(cfg, tmp_path)
  evals = [m["val_loss"] for m in read_metrics(tmp_path) if "val_loss" in m]
  assert len(evals) == 3
  # Uniform over 256 bytes is ln(256) = 5.55 nats; 180 tiny steps reach < 3.0 (the byte unigram level is ~3.3;
  # data seeds 0-3 end at 2.75-2.86 on the validation works).
  assert evals[-1] < 3.0 and evals[-1] < evals[0] - 0.2, evals
  assert final["step"] == 180
  assert (tmp_path / "config.json").exists() and list((tmp_path / "tb").iterdir())
  logged = read_metrics(tmp_path)[-1]
  for key in ("val_loss", "val_ppl", "val_bpb"):
    assert key in logged
  train_logs = [m for m in read_metrics(tmp_path) if "loss" in m]
  for key in ("loss", "ppl", "bpb", "lr", "grad_norm", "grad_norm_clipped", "tokens_per_s"):
    assert key in train_logs[-1]


def _tiny_state(cfg_model: ModelConfig, optim_cfg, steps, precision_name="float32"):
  model = Transformer(cfg_model)
  tx, schedule = optim.make_optimizer(optim_cfg, steps)
  init = state_lib.init_fn(model, tx, precision.get_policy(precision_name).initial_loss_scale(), 16)
  state = jax.jit(lambda r: state_lib.unbox_plain(init(r)))(jax.random.PRNGKey(0))
  step = jax.jit(step_lib.make_train_step(model, tx, schedule, optim_cfg))
  return state, step


def test_overfit_one_batch():
  cfg = tiny_config(steps=150, **{"optim.warmup_steps": 10, "optim.weight_decay": 0.0, "optim.peak_lr": 1e-2})
  m = ModelConfig.from_config(resolved(cfg).model)
  state, step = _tiny_state(m, cfg.optim, 150)
  tokens = np.asarray(jax.random.randint(jax.random.PRNGKey(1), (4, 17), 0, 256))
  batch = {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:])}
  for _ in range(150):
    state, metrics = step(state, batch)
  assert float(metrics["loss"]) < 0.05  # from ln(256) = 5.5: the articles' first debugging step works


def test_nonfinite_step_is_skipped_and_counted():
  cfg = tiny_config()
  m = ModelConfig.from_config(resolved(cfg).model)
  state, step = _tiny_state(m, cfg.optim, 20)
  tok = jnp.zeros((2, 16), jnp.int32)
  bad = {"inputs": tok, "targets": tok, "loss_mask": jnp.full((2, 16), jnp.nan)}
  before = jax.device_get(state.params)
  state, metrics = step(state, bad)
  assert not bool(metrics["finite"]) and int(metrics["bad_steps"]) == 1 and int(metrics["skipped"]) == 1
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(jax.device_get(state.params))):
    np.testing.assert_array_equal(a, b)
  good = {"inputs": tok, "targets": tok}
  state, metrics = step(state, good)
  assert bool(metrics["finite"]) and int(metrics["bad_steps"]) == 0 and int(metrics["skipped"]) == 1


def test_fp16_overflow_halves_scale_and_bf16_runs():
  cfg = tiny_config()
  m = ModelConfig.from_config(resolved(cfg).model)
  import dataclasses
  state, step = _tiny_state(dataclasses.replace(m, dtype="float16"), cfg.optim, 20, "fp16")
  tok = jnp.zeros((2, 16), jnp.int32)
  scale0 = float(state.loss_scale.scale)
  huge = {"inputs": tok, "targets": tok, "loss_mask": jnp.full((2, 16), 1e30)}  # overflows fp16 grads
  state, metrics = step(state, huge)
  assert not bool(metrics["finite"]) and float(state.loss_scale.scale) == scale0 / 2
  state, metrics = step(state, {"inputs": tok, "targets": tok})
  assert bool(metrics["finite"])
  bstate, bstep = _tiny_state(dataclasses.replace(m, dtype="bfloat16"), cfg.optim, 20, "bf16")
  assert jax.tree.leaves(bstate.params)[0].dtype == jnp.float32
  bstate, bm = bstep(bstate, {"inputs": tok, "targets": tok})
  assert bool(bm["finite"]) and np.isfinite(float(bm["loss"]))


def test_repeated_nonfinite_steps_stop_the_run_and_keep_the_checkpoint(tmp_path):
  cfg = tiny_config(steps=30, **{"optim.peak_lr": 1e30, "optim.warmup_steps": 0, "optim.clip_norm": 0.0,
                                 "train.max_nonfinite": 3, "train.ckpt_every": 1})
  with pytest.raises(TrainingError, match="consecutive non-finite"):
    train(cfg, tmp_path)
  steps = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
  assert steps and max(steps) < 5
  _, params = restore_params(tmp_path)
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))


def _wait_for_step(workdir, k, proc, timeout=240):
  t0 = time.time()
  while time.time() - t0 < timeout:
    rows = read_metrics(workdir) if (workdir / "metrics.jsonl").exists() else []
    if any(r.get("step", 0) >= k and "loss" in r for r in rows):
      return
    if proc.poll() is not None:
      raise AssertionError(f"training exited early: {proc.stderr.read()[-3000:]}")
    time.sleep(0.2)
  raise AssertionError("timed out waiting for training progress")


@pytest.mark.slow
def test_crash_resume_is_bitwise_identical(tmp_path):
  flags = ["--config.train.steps=16", "--config.train.ckpt_every=4", "--config.train.eval_every=16"]
  ref = run(train_cmd(tmp_path / "ref", *flags))
  assert ref.returncode == 0, ref.stderr[-3000:]
  crash = tmp_path / "crash"
  proc = subprocess.Popen(train_cmd(crash, *flags), env=env(), stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
  _wait_for_step(crash, 9, proc)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  resumed = run(train_cmd(crash, *flags))
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "resumed from step" in resumed.stderr
  _, p_ref = restore_params(tmp_path / "ref")
  _, p_res = restore_params(crash)
  for a, b in zip(jax.tree.leaves(p_ref), jax.tree.leaves(p_res)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  losses = lambda d: {r["step"]: r["loss"] for r in read_metrics(d) if "loss" in r}  # noqa: E731
  l_ref, l_res = losses(tmp_path / "ref"), losses(crash)
  assert sorted(l_res) == list(range(1, 17))
  assert all(l_ref[s] == l_res[s] for s in range(9, 17))


@pytest.mark.slow
def test_sigterm_saves_exits_zero_and_corrupt_latest_falls_back(tmp_path):
  flags = ["--config.train.steps=400", "--config.train.ckpt_every=3", "--config.train.eval_every=400"]
  proc = subprocess.Popen(train_cmd(tmp_path, *flags), env=env(), stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
  _wait_for_step(tmp_path, 5, proc)
  proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 0, err[-3000:]
  assert "SIGTERM received" in err
  ckpts = tmp_path / "checkpoints"
  steps = sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit())
  latest, previous = steps[-1], steps[-2]
  assert latest >= 5
  # Corrupt the latest checkpoint: truncate its largest file.
  files = sorted((p for p in (ckpts / str(latest)).rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
  files[-1].write_bytes(files[-1].read_bytes()[: files[-1].stat().st_size // 3])
  again = run(train_cmd(tmp_path, "--config.train.steps=" + str(previous + 1), "--config.train.ckpt_every=3",
                        "--config.train.eval_every=400"))
  assert again.returncode == 0, again.stderr[-3000:]
  assert f"resumed from step {previous}" in again.stderr
  assert f"checkpoint step {latest}" in again.stderr and "falling back" in again.stderr


def _train_cli(capsys, workdir, *flags: str) -> subprocess.CompletedProcess:
  """tformer-train's main on the tiny model in this process, as its console entry point runs it
  (`cli_common.run_main`: an anticipated error is one line and status 2): its status and stderr."""
  capsys.readouterr()
  try:
    status = cli_common.run_main(train_cli.main, train_cmd(workdir, *flags)[2:])
  except SystemExit as e:
    status = e.code
  cap = capsys.readouterr()
  return subprocess.CompletedProcess("tformer-train", status, cap.out, cap.err)


def test_bad_inputs_give_clear_errors(tmp_path, capsys):
  ro = tmp_path / "ro"
  ro.mkdir()
  os.chmod(ro, 0o500)
  if os.access(ro / "x", os.W_OK) or os.geteuid() == 0:
    target = "/proc/tformer_not_writable"  # root can write anywhere else
  else:
    target = str(ro / "run")
  with pytest.raises(ConfigError, match="not writable"):
    train(tiny_config(), target)
  r = _train_cli(capsys, tmp_path / "a", "--config.data.corpus=text:/nonexistent/path.txt")
  assert r.returncode == 2 and "/nonexistent/path.txt" in r.stderr and "Traceback" not in r.stderr
  r = _train_cli(capsys, tmp_path / "b", "--config.data.corpus=nosuchcorpus")
  assert r.returncode == 2 and "nosuchcorpus" in r.stderr
  r = _train_cli(capsys, tmp_path / "c", "--config.model.num_heads=5")
  assert r.returncode == 2 and "model.d_model" in r.stderr
  short = tmp_path / "short.txt"
  short.write_text("too short")
  r = _train_cli(capsys, tmp_path / "d", f"--config.data.corpus=text:{short}")
  assert r.returncode == 2 and "seq_len" in r.stderr
  blob = tmp_path / "latin1.txt"
  blob.write_bytes(("caf\xe9 " * 4000).encode("latin-1"))
  r = _train_cli(capsys, tmp_path / "e", f"--config.data.corpus=text:{blob}", "--config.data.tokenizer=bpe")
  assert r.returncode == 2 and "UTF-8" in r.stderr
  r = _train_cli(capsys, tmp_path / "f", f"--config.data.corpus=text:{blob}", "--config.train.steps=2")
  assert r.returncode == 0, r.stderr[-2000:]  # the byte tokenizer takes any bytes


def test_init_from_and_generate_cli_on_a_trained_workdir(tmp_path):
  base = tmp_path / "base"
  train(tiny_config(steps=4), base)
  _, p_base = restore_params(base)
  # Fine-tune from it: the first logged loss equals the base model's loss on the same first batch.
  ft = tmp_path / "ft"
  train(tiny_config(steps=1, **{"train.init_from": str(base)}), ft)
  fresh = tmp_path / "fresh"
  train(tiny_config(steps=1), fresh)
  loss = lambda d: [r["loss"] for r in read_metrics(d) if "loss" in r][0]  # noqa: E731
  assert loss(ft) < loss(fresh) - 0.05
  # The architecture comes from the source: a config with another width trains the source's.
  other = tmp_path / "other"
  train(tiny_config(steps=1, **{"train.init_from": str(base), "model.d_model": 32}), other)
  assert json.loads((other / "config.json").read_text())["model"]["d_model"] == 64
  assert loss(other) == pytest.approx(loss(ft), rel=1e-6)
  out = run([__import__("sys").executable, "scripts/generate.py", f"--workdir={base}", "--prompt=ROMEO:",
             "--max_new_tokens=20", "--temperature=0.8"], cwd=str(__import__("pathlib").Path(__file__).parents[1]))
  assert out.returncode == 0, out.stderr[-2000:]
  assert "ROMEO:" in out.stdout and len(out.stdout.strip()) > len("ROMEO:")
