"""Shared helpers for tests that run the training loop: a tiny config and a subprocess launcher."""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

from tformer_jax.config import default_config

REPO = pathlib.Path(__file__).resolve().parents[1]


# jax.jit(..., compiler_options=RUN_HEAVY): one program that a test runs many times (a training loop of
# hundreds of steps) compiled at XLA's -O3 instead of the suite's -O0 (tests/conftest.py): 2x faster steps
# for ~2 s more compile (a 2-layer d=128 model's AdamW step, 16 x 64 tokens: 99 -> 49 ms).
RUN_HEAVY = {"xla_backend_optimization_level": 3}

SHORT = 5   # runs of at most this many steps: a learning rate schedule that does not depend on train.steps


def short_schedule(steps: int) -> tuple[str, int]:
  """(schedule, warmup_steps) of a short tiny run: constant after 1 warmup step (none for 1 step), so runs
  of 3 and 4 steps, and a run resumed with more steps, take the same learning rates (validate wants
  warmup < train.steps, so the 5-step warmup that used to give that cannot be used)."""
  return "constant", min(1, steps - 1)


def tiny_config(steps: int = 20, **overrides):
  c = default_config()
  m = c.model
  m.d_model, m.num_layers, m.num_heads, m.max_len = 64, 2, 4, 64
  m.position, m.norm = "rope", "rmsnorm"
  c.data.seq_len, c.data.batch_size = 32, 8
  c.optim.peak_lr, c.optim.warmup_steps = 3e-3, 5
  if steps <= SHORT:
    c.optim.schedule, c.optim.warmup_steps = short_schedule(steps)
  c.train.steps, c.train.log_every, c.train.eval_every, c.train.ckpt_every = steps, 1, steps, steps
  c.train.eval_batches, c.train.sample_tokens = 2, 0
  for key, value in overrides.items():
    node = c
    *path, last = key.split(".")
    for p in path:
      node = node[p]
    assert last in node, f"tiny_config: unknown field {key}"
    node[last] = value
  return c


def overrides_to_flags(**overrides) -> list[str]:
  return [f"--config.{k}={v}" for k, v in overrides.items()]


TINY_FLAGS = overrides_to_flags(**{
    "model.d_model": 64, "model.num_layers": 2, "model.num_heads": 4, "model.max_len": 64,
    "model.position": "rope", "model.norm": "rmsnorm", "model.activation": "gelu", "data.seq_len": 32,
    "data.batch_size": 8,
    "optim.peak_lr": 3e-3, "optim.warmup_steps": 5, "train.eval_batches": 2, "train.sample_tokens": 0,
    "train.log_every": 1})


def train_cmd(workdir, *flags: str) -> list[str]:
  """scripts/train.py on the tiny model; with a short --config.train.steps=N, the schedule of
  tiny_config(steps=N) (`short_schedule`), unless the flags set the warmup or the schedule."""
  steps = [int(f.split("=", 1)[1]) for f in flags if f.startswith("--config.train.steps=")]
  warmup = []
  if steps and steps[-1] <= SHORT and not any("optim.warmup" in f or "optim.schedule" in f for f in flags):
    schedule, warm = short_schedule(steps[-1])
    warmup = [f"--config.optim.schedule={schedule}", f"--config.optim.warmup_steps={warm}"]
  return [sys.executable, str(REPO / "scripts" / "train.py"), f"--config={REPO / 'configs' / 'shakespeare_char.py'}",
          f"--workdir={workdir}", *TINY_FLAGS, *warmup, *flags]


def env(devices: int = 1) -> dict[str, str]:
  """The environment of a subprocess: the suite's XLA_FLAGS (conftest.py: LLVM at -O0) with `devices`
  fake CPU devices instead of the suite's 8 (one unless a test asks otherwise)."""
  e = dict(os.environ)
  flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", e.get("XLA_FLAGS", "")).split()
  e["XLA_FLAGS"] = " ".join(flags + ([f"--xla_force_host_platform_device_count={devices}"] if devices > 1 else []))
  e["JAX_PLATFORMS"] = "cpu"
  e["PYTHONUNBUFFERED"] = "1"
  return e


def run(cmd, timeout=300, **kw) -> subprocess.CompletedProcess:
  return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=kw.pop("env", env()), **kw)
