"""tformer-serve and tformer-generate at start-up: a --max_len a learned position table cannot represent is one
line (status 2) before any weights are read, and the engine itself refuses it; a busy port, a host that does not
resolve and a port out of range are one line, checked before the model is loaded (the run's checkpoints are
missing here: had the model been loaded first, the error would name them)."""
from __future__ import annotations

import json
import socket

import pytest

from tformer_jax import model_loading
from tformer_jax.cli import generate, serve
from tformer_jax.serve import Engine

import train_utils

pytest.importorskip("aiohttp")

LEARNED = ["--config=gpt2_tiny", "--config.model.d_model=32", "--config.model.num_layers=1",
           "--config.model.num_heads=2", "--config.model.max_len=64", "--config.data.seq_len=32", "--random_init"]


def _error(main, argv, capsys) -> str:
  capsys.readouterr()
  with pytest.raises(SystemExit) as e:
    main(argv)
  err = capsys.readouterr().err.strip()
  assert e.value.code == 2 and err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
  return err


def test_a_max_len_past_a_learned_table_is_refused_at_start_up(capsys):
  err = _error(serve.main, [*LEARNED, "--max_len=512", "--port=0"], capsys)
  assert "--max_len=512 exceeds this model's max_len=64 (learned positions" in err, err
  err = _error(generate.main, [*LEARNED, "--chat", "--max_len=65"], capsys)
  assert "--max_len=65 exceeds this model's max_len=64" in err, err
  model, params, _ = model_loading.random_init(serve.parse_args([*LEARNED, "--max_len=64"]).config)
  with pytest.raises(ValueError, match="max_len=128 exceeds the model's max_len=64"):
    Engine(model, params, num_slots=1, max_len=128)
  assert Engine(model, params, num_slots=1, max_len=64).max_len == 64       # the table's length is fine


@pytest.fixture
def unloadable_run(tmp_path):
  """A run's config.json without checkpoints: loading its model would fail with 'no checkpoints'."""
  work = tmp_path / "run"
  work.mkdir()
  (work / "config.json").write_text(json.dumps(train_utils.tiny_config(2).to_dict()))
  return work


def test_a_busy_port_a_bad_host_and_port_70000_are_one_line_before_loading(unloadable_run, capsys):
  with socket.socket() as busy:
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    err = _error(serve.main, [f"--workdir={unloadable_run}", f"--port={port}"], capsys)
    assert f"--port={port}: is in use" in err, err
  err = _error(serve.main, [f"--workdir={unloadable_run}", "--host=no-such-host.invalid"], capsys)
  assert "--host=no-such-host.invalid: cannot be resolved" in err, err
  err = _error(serve.main, [f"--workdir={unloadable_run}", "--port=70000"], capsys)
  assert "--port=70000: must be in 0..65535" in err, err
  err = _error(serve.main, [f"--workdir={unloadable_run}", "--port=0"], capsys)   # a free port: then the model
  assert "no checkpoints" in err, err
