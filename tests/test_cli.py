"""The command lines as a user meets them: every command is a console entry point of the installed
package (a wheel, outside the checkout, finds its default configs), --print_config lists every field."""
import ast
import importlib
import json
import os
import pathlib
import subprocess
import sys

import pytest

from tformer_jax import cli_common
from tformer_jax.train.metrics import read_metrics

from train_utils import run, train_cmd

tomllib = pytest.importorskip("tomllib")

REPO = pathlib.Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def test_every_package_folder_is_listed_and_every_command_is_an_entry_point():
  setup = PYPROJECT["tool"]["setuptools"]
  found = {".".join(d.relative_to(REPO).parts) for d in (REPO / "tformer_jax").rglob("*")
           if d.is_dir() and (d / "__init__.py").is_file()}
  found |= {"tformer_jax"} | {"tformer_jax." + ".".join(d.relative_to(REPO).parts)
                              for d in [REPO / "configs", *(REPO / "configs").rglob("*")]
                              if d.is_dir() and (d / "__init__.py").is_file()}
  assert set(setup["packages"]) == found
  scripts = PYPROJECT["project"]["scripts"]
  for name, target in scripts.items():
    module, func = target.split(":")
    assert callable(getattr(importlib.import_module(module), func)), name
  commands = {p.stem for p in (REPO / "tformer_jax" / "cli").glob("*.py") if p.stem != "__init__"}
  targets = {t.split(":")[0] for t in scripts.values()}
  for c in commands:
    assert f"tformer_jax.cli.{c}" in targets, f"tformer_jax/cli/{c}.py has no console entry point"
    wrapper = REPO / "scripts" / f"{c}.py"
    assert wrapper.is_file() and len(wrapper.read_text().splitlines()) <= 10, f"scripts/{c}.py: not a thin wrapper"


def test_print_config_lists_every_field_with_value_and_description(capsys):
  with pytest.raises(SystemExit) as e:
    cli_common.parse(["--config.model.num_layers=3", "--print_config", "--config=llama_tiny"], config="required")
  assert e.value.code == 0
  lines = capsys.readouterr().out.splitlines()
  cfg = cli_common.load_named_config("llama_tiny")
  fields = []

  def walk(node, prefix):
    for k, v in node.items():
      (walk(v, f"{prefix}{k}.") if hasattr(v, "items") else fields.append(f"{prefix}{k}"))
  walk(cfg, "")
  assert len(lines) == len(fields)
  for line in lines:
    name, rest = line.split(" = ", 1)
    assert name in fields and "  # " in rest, line            # a value and a description, every field
  assert any(line.startswith("model.num_layers = 3 ") for line in lines)


def test_configs_by_shipped_name_and_a_clear_error_otherwise():
  assert cli_common.find_config_file("llama_tiny") == REPO / "configs" / "llama_tiny.py"
  assert cli_common.find_config_file("bench/gpt2_cpu.py") == REPO / "configs" / "bench" / "gpt2_cpu.py"
  with pytest.raises(cli_common.UsageError, match=r"config file nope not found; the shipped configs are: .*llama_tiny"):
    cli_common.find_config_file("nope")


@pytest.mark.slow
def test_wheel_installed_outside_the_checkout_runs_its_commands(tmp_path):
  """`pip install .` (a real wheel, not editable), then the commands from another directory."""
  wheels, target = tmp_path / "wheels", tmp_path / "site"
  subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(REPO),
                  "-w", str(wheels)], check=True, cwd=tmp_path, capture_output=True)
  subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                  *map(str, wheels.glob("*.whl"))], check=True, capture_output=True)
  env = {**os.environ, "PYTHONPATH": str(target), "JAX_PLATFORMS": "cpu"}
  run = lambda *a: subprocess.run([sys.executable, *a], cwd=tmp_path, env=env, capture_output=True,  # noqa: E731
                                  text=True, timeout=300)
  r = run("-c", "import tformer_jax, sys; print(tformer_jax.__file__)")
  assert r.stdout.startswith(str(target)), r.stdout + r.stderr          # the wheel, not the checkout
  r = run("-m", "tformer_jax.cli.generate", "--random_init", "--config=llama_tiny", "--prompt=To be",
          "--max_new_tokens=8", "--temperature=0")
  assert r.returncode == 0 and r.stdout.startswith("To be"), r.stderr[-2000:]
  r = run("-m", "tformer_jax.bench", "train", "--help")            # its default config ships inside
  assert r.returncode == 0 and "usage:" in r.stdout, r.stderr[-2000:]
  # every entry point imports from the wheel: one interpreter imports them all, each one's file named
  modules = [script.split(":")[0] for script in PYPROJECT["project"]["scripts"].values()]
  r = run("-c", "import importlib, sys\nfor m in sys.argv[1:]:\n  print(m, importlib.import_module(m).__file__)",
          *modules)
  assert r.returncode == 0, r.stdout[-1000:] + r.stderr[-1000:]
  files = dict(line.split(" ", 1) for line in r.stdout.splitlines())
  assert list(files) == modules and all(f.startswith(str(target)) for f in files.values()), files
  tree = ast.parse((target / "tformer_jax" / "configs" / "shakespeare_char.py").read_text())
  assert any(isinstance(n, ast.FunctionDef) and n.name == "get_config" for n in tree.body)


def test_eval_reproduces_the_loops_final_val_loss_and_scores_other_data(tmp_path, capsys):
  from tformer_jax.cli import eval as eval_cli
  work = tmp_path / "run"
  r = run(train_cmd(work, "--config.train.steps=3"))
  assert r.returncode == 0, r.stderr[-2000:]
  # quiet output: no jax start-up INFO (libtpu), no allocator note
  assert "xla_bridge" not in r.stderr and "libtpu" not in r.stderr and "note:" not in r.stderr, r.stderr[-2000:]
  final = [m for m in read_metrics(work) if "val_loss" in m][-1]
  res = eval_cli.main([f"--workdir={work}"])
  for k in ("val_loss", "val_bpb", "val_accuracy"):
    assert res[k] == pytest.approx(final[k], rel=1e-5), k
  assert res["tokens"] == 2 * 8 * 32                       # train.eval_batches x batch x seq_len
  out = capsys.readouterr().out.strip().splitlines()
  assert json.loads(out[-1]) == res                          # the last line is the JSON
  train = eval_cli.main([f"--workdir={work}", "--split=train", "--batches=3", "--config.data.seq_len=16"])
  assert train["tokens"] == 3 * 8 * 16 and 0 < train["train_loss"] < 6
  with pytest.raises(SystemExit) as e:
    eval_cli.main([f"--workdir={work}", f"--hf={tmp_path}"])
  assert e.value.code == 2


def test_loggers_jsonl_only_wandb_missing_is_one_line_and_wandb_offline_when_installed(tmp_path):
  import importlib.util

  from tformer_jax.config import ConfigError, default_config, validate
  from tformer_jax.train.metrics import MetricWriter
  cfg = default_config()
  cfg.train.loggers = "tensorboard"
  with pytest.raises(ConfigError, match="^train.loggers: 'tensorboard' lacks jsonl"):
    validate(cfg, check_paths=False)
  cfg.train.loggers = "jsonl,mlflow"
  with pytest.raises(ConfigError, match="^train.loggers: unknown value 'mlflow'"):
    validate(cfg, check_paths=False)
  (tmp_path / "a").mkdir()
  w = MetricWriter(tmp_path / "a", loggers=("jsonl",))
  w.write(1, {"loss": 2.5})
  w.close()
  assert read_metrics(tmp_path / "a") == [{"step": 1, "loss": 2.5}] and not (tmp_path / "a" / "tb").exists()
  cfg.train.loggers = "jsonl,wandb"
  if importlib.util.find_spec("wandb") is None:
    with pytest.raises(ConfigError, match=r"^train.loggers: 'wandb' needs the wandb package \(pip install wandb\)"):
      validate(cfg, check_paths=False)
    pytest.skip("wandb is not installed (pip install -e .[trackers]): its offline run is not exercised")
  validate(cfg, check_paths=False)
  (tmp_path / "b").mkdir()
  w = MetricWriter(tmp_path / "b", loggers=("jsonl", "wandb"), run_config={"model": {"d_model": 8}})
  w.write(1, {"loss": 2.5})
  w.close()
  assert list((tmp_path / "b" / "wandb").glob("offline-run-*/run-*.wandb"))


def _hidden_extra_error(monkeypatch, capsys, tmp_path, module: str, command: str, argv: list[str]) -> str:
  """`command`'s main(argv) with `module` hidden (sys.modules[module] = None: not importable, as after
  `pip install .` without the extra): the one line it prints, exit status 2."""
  cli = importlib.import_module(f"tformer_jax.cli.{command}")
  monkeypatch.setitem(sys.modules, module, None)
  monkeypatch.chdir(tmp_path)
  capsys.readouterr()
  with pytest.raises(SystemExit) as e:
    cli.main(argv)
  err = capsys.readouterr().err.strip()
  assert e.value.code == 2 and "\n" not in err and "Traceback" not in err, err
  return err


@pytest.mark.parametrize("module, extra, command, argv, what", [
    ("aiohttp", "serve", "serve", ["--random_init", "--config=llama_tiny"], "tformer-serve"),
    ("lm_eval", "eval", "eval", ["--hf=hf", "--tasks=shakespeare_ppl"], "tformer-eval --tasks"),
    ("libtpu", "tpu-aot", "aot", ["--config=llama_tiny", "--topology=v5e:2x2"], "tformer-aot"),
    ("wandb", "trackers", "train", ["--config=llama_tiny", "--workdir=run", "--config.train.loggers=jsonl,wandb"],
     "tformer-train with train.loggers=...wandb"),
    ("lm_eval", "eval", "train", ["--config=llama_tiny", "--workdir=run", "--config.train.eval_tasks=shakespeare_ppl"],
     "tformer-train with train.eval_tasks"),
    ("gguf", "gguf", "convert", ["--from-gguf=m.gguf", "--out=hf"], "tformer-convert --from-gguf"),
    ("gguf", "gguf", "convert", ["--from-hf=m.gguf", "--to=work"], "tformer-convert --from-hf=FILE.gguf"),
])
def test_a_missing_extra_is_one_line_naming_it(monkeypatch, capsys, tmp_path, module, extra, command, argv, what):
  """Every command whose optional extra is missing says which to install (cli_common.require_extra), before it
  loads anything: tformer-serve without aiohttp was a ModuleNotFoundError traceback."""
  (tmp_path / "hf").mkdir()
  err = _hidden_extra_error(monkeypatch, capsys, tmp_path, module, command, argv)
  assert err == f"error: {what} needs the '{extra}' extra: pip install 'tformer-jax[{extra}]' ({module} is not " \
                "installed)", err
  assert not (tmp_path / "run").exists() and not (tmp_path / "work").exists()
