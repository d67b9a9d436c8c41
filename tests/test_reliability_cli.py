"""Anticipated mistakes on the command line are one line `error: ...` and exit status 2, before any work: every
count flag of tformer-bench has a lower bound (`--steps=-1` wrote -40.7M tokens/s with exit 0; `--steps=0` was a
traceback)."""
from __future__ import annotations

import gzip
import importlib
import json
import re
import sys

import pytest
from absl import flags

from tformer_jax import cli_common
from tformer_jax.cli import bench

import train_utils


def _fails_in_one_line(main, argv, capsys) -> str:
  """The command as its console entry runs it (cli_common.run_main): status 2 and one line on stderr."""
  capsys.readouterr()
  try:
    code = cli_common.run_main(main, argv)
  except SystemExit as e:
    code = e.code
  err = "\n".join(x for x in capsys.readouterr().err.splitlines() if "%|" not in x).strip()   # not tqdm's bars
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



CONFIG_FAULTS = {
    "syntax": ("def get_config(:\n  pass\n", r"syntax\.py:1: SyntaxError: "),
    "missing_module": ("import no_such_module_xyz\n\ndef get_config():\n  return None\n",
                       r"missing_module\.py:1: ModuleNotFoundError: No module named 'no_such_module_xyz'"),
    "raises": ("def get_config():\n  raise RuntimeError('boom')\n", r"raises\.py:2: RuntimeError: boom"),
    # a KeyError of the user's own code: not read as "unknown config field"
    "key_error": ("def get_config():\n  d = {}\n  return d['model']\n", r"key_error\.py:3: KeyError: 'model'"),
}


@pytest.mark.parametrize("command", ["train", "doctor"])
@pytest.mark.parametrize("fault", sorted(CONFIG_FAULTS))
def test_a_config_file_that_fails_to_load_is_one_line_naming_the_file_and_line(fault, command, tmp_path, capsys):
  text, match = CONFIG_FAULTS[fault]
  path = tmp_path / f"{fault}.py"
  path.write_text(text)
  main = importlib.import_module(f"tformer_jax.cli.{command}").main
  argv = [f"--config={path}"] + ([f"--workdir={tmp_path / 'run'}"] if command == "train" else [])
  err = _fails_in_one_line(main, argv, capsys)
  assert re.search(f"config file {re.escape(str(tmp_path))}/{match}", err) and "unknown config field" not in err, err
  assert not (tmp_path / "run").exists()


def test_a_corrupt_workdir_config_json_is_named_with_its_path(tmp_path, capsys):
  from tformer_jax.cli import generate  # noqa: PLC0415
  (tmp_path / "run").mkdir()
  (tmp_path / "run" / "config.json").write_text('{"model": {"d_model": 6')       # cut short
  err = _fails_in_one_line(generate.main, [f"--workdir={tmp_path / 'run'}", "--prompt=a"], capsys)
  assert f"{tmp_path / 'run' / 'config.json'}: not a readable run config" in err, err


def test_a_truncated_jsonl_gz_is_one_line_naming_it(tmp_path, capsys):
  from tformer_jax.cli import prepare  # noqa: PLC0415
  rows = b"".join(json.dumps({"text": f"line {i} of the corpus"}).encode() + b"\n" for i in range(5000))
  packed = gzip.compress(rows)
  src = tmp_path / "cut.jsonl.gz"
  src.write_bytes(packed[:len(packed) // 2])
  err = _fails_in_one_line(prepare.main, [f"--source={src}", f"--out={tmp_path / 'out'}", "--tokenizer=byte"],
                           capsys)
  assert f"{src}: the gzip file is truncated or damaged" in err, err


def test_aot_with_a_mesh_shape_of_the_wrong_length_is_a_config_error():
  from tformer_jax.aot import driver  # noqa: PLC0415
  from tformer_jax.config import ConfigError, load_config_file  # noqa: PLC0415
  cfg = load_config_file(train_utils.REPO / "configs" / "llama_tiny.py")
  cfg.mesh.shape = (2, 2)
  with pytest.raises(ConfigError, match=r"^mesh\.shape: \(2, 2\) has 2 entries for axes \('data', 'fsdp', 'tensor'\)$"):
    driver.compile_for_topology(cfg, "v5e:2x2")


def test_an_unknown_allocator_is_exit_2_in_one_line(monkeypatch, capsys):
  from tformer_jax.backends.cpu import host_alloc  # noqa: PLC0415
  monkeypatch.setenv(host_alloc.ENV_CHOICE, "bogus")
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.delenv(host_alloc.ENV_DONE, raising=False)
  monkeypatch.setattr(sys, "argv", ["tformer-train", "--config=llama_tiny"])
  capsys.readouterr()
  with pytest.raises(SystemExit) as e:
    host_alloc.maybe_reexec()
  err = capsys.readouterr().err.strip()
  assert e.value.code == 2 and err.startswith("error: ") and "bogus" in err and "\n" not in err, err
