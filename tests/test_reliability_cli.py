"""Anticipated mistakes on the command line are one line `error: ...` and exit status 2, before any work: every
count flag of tformer-bench has a lower bound (`--steps=-1` wrote -40.7M tokens/s with exit 0; `--steps=0` was a
traceback)."""
from __future__ import annotations

import importlib

import pytest
from absl import flags

from tformer_jax import cli_common
from tformer_jax.cli import bench


def _fails_in_one_line(main, argv, capsys) -> str:
  """The command as its console entry runs it (cli_common.run_main): status 2 and one line on stderr."""
  capsys.readouterr()
  try:
    code = cli_common.run_main(main, argv)
  except SystemExit as e:
    code = e.code
  err = capsys.readouterr().err.strip()
  assert code == 2 and err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
  return err


@pytest.mark.parametrize("name", sorted(bench.MODULES))
def test_every_count_flag_of_bench_has_a_lower_bound(name):
  module = importlib.import_module(bench.MODULES[name])
  fv = flags.FlagValues()
  module.define_flags(fv)
  numeric = [fv[f] for f in fv if isinstance(fv[f], flags.Flag) and isinstance(fv[f].parser, flags.ArgumentParser)
             and type(fv[f].parser).__name__ in ("IntegerParser", "FloatParser")]
  assert numeric, name
  unbounded = [f.name for f in numeric if getattr(f.parser, "lower_bound", None) is None]
  assert not unbounded, f"{name}: flags without a lower bound: {unbounded}"


@pytest.mark.parametrize("steps", ["-1", "0"])
def test_bench_train_steps_below_one_is_one_line_before_any_work(steps, capsys):
  err = _fails_in_one_line(bench.main, ["train", f"--steps={steps}", "--config=llama_tiny"], capsys)
  assert f"--steps={steps}: {steps} is not a positive integer" in err, err


@pytest.mark.parametrize("argv, flag", [
    (["serve", "--slots=0"], "--slots"), (["decode", "--runs=-2"], "--runs"),
    (["attention", "--repeats=0"], "--repeats"),
    (["attention", "--seq=1024,-8"], "--seq"), (["serve", "--clients=4,0"], "--clients"),
])
def test_other_bench_counts_below_their_bound_are_one_line(argv, flag, capsys):
  assert flag in _fails_in_one_line(bench.main, argv, capsys)

