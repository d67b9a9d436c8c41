"""bench/op_profile.py: HLO op kinds, the wall-clock split of overlapping ops, and `bench train --profile`
on a real jax.profiler trace. No timing is asserted: only that the accounting adds up."""
import jax
import jax.numpy as jnp
import pytest

from tformer_jax.bench import op_profile

TINY = ["model.num_layers=1", "model.d_model=32", "model.num_heads=2", "model.max_len=32",
        "data.seq_len=32", "data.batch_size=2"]


def _ev(name, ts, dur):
  return {"ph": "X", "name": name, "ts": ts, "dur": dur}


def test_overlapping_ops_split_the_wall_clock():
  kinds = {"a": "matmul", "b": "custom call k", "c": "matmul"}
  # a runs 0-100, b runs 50-150 (overlap 50-100), c runs 200-260 alone; one step; 'x' is not an op
  events = [_ev("a", 0, 100), _ev("b", 50, 100), _ev("c", 200, 60), _ev("x", 0, 1000)]
  s = op_profile.summarize(events, kinds, steps=1, wall_s=300e-6)
  by = {g["kind"]: g for g in s["groups"]}
  # wall: a = 50 + 25, b = 25 + 50, c = 60 (microseconds -> ms)
  assert by["matmul"]["wall_ms_per_step"] == pytest.approx((75 + 60) / 1e3)
  assert by["custom call k"]["wall_ms_per_step"] == pytest.approx(75 / 1e3)
  assert by["matmul"]["op_ms_per_step"] == pytest.approx(160 / 1e3)
  assert by["matmul"]["ops_per_step"] == 2
  assert s["busy_ms_per_step"] == pytest.approx(210 / 1e3)
  assert s["concurrency"] == pytest.approx(260 / 210, abs=1e-3)
  assert s["wall_ms_per_step"] == pytest.approx(0.3)
  assert sum(g["wall_share"] for g in s["groups"]) == pytest.approx(1.0, abs=1e-3)
  order = [o["op"] for o in s["slowest"]]
  assert set(order[:2]) == {"a", "b"} and order[2] == "c"  # a and b tie at 75 us each
  text = op_profile.format_summary(s)
  assert "custom call k" in text and "matmul" in text


def test_two_steps_average_per_step():
  kinds = {"a": "matmul"}
  s = op_profile.summarize([_ev("a", 0, 40), _ev("a", 100, 60)], kinds, steps=2)
  assert s["groups"][0]["wall_ms_per_step"] == pytest.approx(0.05)
  assert s["groups"][0]["ops_per_step"] == 1
  assert "wall_ms_per_step" not in s


def test_hlo_op_kinds_of_a_compiled_function():
  def f(x, w):
    return jnp.tanh(x @ w).sum(axis=0)
  x = jnp.ones((64, 32))
  w = jnp.ones((32, 16))
  kinds = op_profile.hlo_op_kinds(jax.jit(f).lower(x, w).compile().as_text())
  assert "matmul" in kinds.values()
  assert all(isinstance(k, str) and k for k in kinds.values())


def test_missing_trace_is_a_clear_error(tmp_path):
  with pytest.raises(FileNotFoundError, match="create_perfetto_trace"):
    op_profile.load_trace_events(str(tmp_path))


def test_bench_train_profile_accounts_for_the_step(tmp_path, capsys):
  from tformer_jax.bench import train as train_bench
  sets = [f"--config.{s}" for s in TINY]
  res = train_bench.main(["--steps", "2", "--warmup", "1", "--peak-n", "0", "--profile",
                          str(tmp_path / "prof"), *sets])
  prof = res["op_profile"]
  assert prof["steps"] == 3 and prof["groups"]
  kinds = {g["kind"] for g in prof["groups"]}
  assert "matmul" in kinds
  # the wall-clock split adds up to the busy time, which fits in the profiled steps' wall time
  assert sum(g["wall_ms_per_step"] for g in prof["groups"]) == pytest.approx(prof["busy_ms_per_step"],
                                                                             rel=1e-3, abs=1e-2)
  assert 0 < prof["busy_ms_per_step"] <= prof["wall_ms_per_step"] * 1.01
  assert prof["concurrency"] >= 1.0 - 1e-6
  for g in prof["groups"]:
    assert g["op_ms_per_step"] >= g["wall_ms_per_step"] - 1e-3
  walls = [o["wall_ms_per_step"] for o in prof["slowest"]]
  assert walls == sorted(walls, reverse=True)
  assert "time by op kind" in capsys.readouterr().out
