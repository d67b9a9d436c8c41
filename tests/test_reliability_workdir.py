"""What users do with a workdir after (and while) training: an HF directory given to train.init_from without hf:
says so; a converted workdir is not trained in (use train.init_from); a resumed run on another corpus is refused
with its files untouched; a LoRA rank above a projection's smaller side is refused; a reader of a workdir whose
trainer keeps saving and rotating steps reports no false damage; tformer-eval checks --json at start and never
replaces a file it did not write; a fine-tuning run (train.init_from) prints its INFO lines, val_loss included;
tformer-convert's outputs honour the umask and name their step (test_reliability_hf.py)."""
from __future__ import annotations

import hashlib
import logging
import pathlib
import threading

import numpy as np
import pytest

from tformer_jax import cli_common
from tformer_jax.checkpoint import Checkpointer, restore_params
from tformer_jax.cli import convert, eval as eval_cli
from tformer_jax.config import ConfigError
from tformer_jax.train import init_from, loop, workdir as workdir_lib

import train_utils


def _files(root: pathlib.Path) -> dict[str, str]:
  return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
          for p in sorted(root.rglob("*")) if p.is_file()}


def _swiglu(steps: int, **over):
  c = train_utils.tiny_config(steps, **over)
  c.model.activation, c.model.tie_embeddings = "swiglu", False     # an architecture HF holds
  return c


@pytest.fixture(scope="module")
def base(tmp_path_factory):
  work = tmp_path_factory.mktemp("base") / "run"
  loop.train(_swiglu(2), work)
  return work


def test_an_hf_dir_without_the_prefix_and_a_converted_workdir_say_what_to_do(base, tmp_path):
  hf_dir, converted = tmp_path / "hf", tmp_path / "converted"
  assert convert.main(["--from", str(base), "--to-hf", str(hf_dir)]) == 0
  c = _swiglu(2)
  c.train.init_from = str(hf_dir)
  with pytest.raises(ConfigError, match=rf"train\.init_from={hf_dir}: a Hugging Face model directory .*; prefix it "
                                        rf"with hf: \(train\.init_from=hf:{hf_dir}\)"):
    init_from.resolve(c)
  assert convert.main(["--from-hf", str(hf_dir), "--to", str(converted)]) == 0
  before = _files(converted)
  with pytest.raises(ConfigError, match=rf"workdir: {converted} is a converted model .*use train\.init_from"):
    loop.train(_swiglu(2), converted)
  assert _files(converted) == before


def test_resuming_on_another_corpus_is_refused_and_keeps_every_file(base, tmp_path):
  work = tmp_path / "run"
  loop.train(_swiglu(2), work)
  before = _files(work)
  c = _swiglu(3)
  c.data.corpus = "text:" + str(train_utils.REPO / "README.md")
  with pytest.raises(ConfigError, match=r"holds checkpoints of a run on shakespeare.*this config trains on text:"):
    loop.train(c, work)
  assert _files(work) == before


def test_a_lora_rank_above_a_projection_is_refused(base, tmp_path):
  c = _swiglu(2)
  c.train.init_from = str(base)
  c.train.lora.rank, c.train.lora.targets = 65, "q,v"     # q/v of a d_model=64 model: 64 x 64
  with pytest.raises(ConfigError, match=r"^train\.lora\.rank: 65 exceeds the smaller side of attn/wq \(64 x 64\)"):
    loop.train(c, tmp_path / "lora")
  assert not (tmp_path / "lora").exists()


def test_a_reader_of_a_workdir_being_saved_and_rotated_reports_no_damage(base, tmp_path, caplog):
  """A trainer (this test, holding the workdir's lock as tformer-train does) saves a step every few ms with
  max_to_keep=2 while restore_params reads: every read returns a step's params, no step is called damaged."""
  work = tmp_path / "run"
  work.mkdir()
  (work / "config.json").write_text((base / "config.json").read_text())
  _, params = restore_params(base)
  stop, saved = threading.Event(), []

  def trainer() -> None:
    with workdir_lib.WorkdirLock(work), Checkpointer(work / "checkpoints", max_to_keep=2) as ckpt:
      for s in range(1, 400):
        if stop.is_set():
          break
        ckpt.save(s, {"params": params}, {"next_index": s}, {}, force=True)
        ckpt.wait()
        saved.append(s)

  t = threading.Thread(target=trainer)
  t.start()
  try:
    while not saved:
      pass
    reads = []
    with caplog.at_level(logging.WARNING):
      for _ in range(25):
        _, got, step = restore_params(work, with_step=True)
        reads.append(step)
        np.testing.assert_array_equal(got["embed"], params["embed"])
  finally:
    stop.set()
    t.join()
  assert len(set(reads)) > 1, reads                   # the reads met a directory that was changing
  assert not [r for r in caplog.records if "damaged" in r.getMessage()], caplog.text


def _eval(argv) -> int:
  """tformer-eval's exit status, as its console entry runs it."""
  try:
    return cli_common.run_main(eval_cli.main, argv)
  except SystemExit as e:
    return e.code


def test_eval_checks_its_json_at_start_and_replaces_only_its_own(base, tmp_path, capsys):
  mine = tmp_path / "notes.json"
  mine.write_text('{"my": "notes"}\n')
  capsys.readouterr()
  assert _eval([f"--workdir={base}", "--batches=1", f"--json={mine}"]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("error: --json=") and "is not a result tformer-eval wrote" in err and "\n" not in err, err
  assert mine.read_text() == '{"my": "notes"}\n'
  assert _eval([f"--workdir={base}", "--batches=1", f"--json={tmp_path / 'missing' / 'x' / 'r.json'}"]) == 0
  out = tmp_path / "r.json"
  for _ in range(2):                                   # its own result: replaced
    assert _eval([f"--workdir={base}", "--batches=1", f"--json={out}"]) == 0
  assert _eval([f"--workdir={base}", "--batches=1", f"--json={tmp_path}"]) == 2


def test_a_fine_tuning_run_prints_its_info_lines(tmp_path):
  """train.init_from imports orbax while the command line is parsed, which left a WARNING handler on the root
  logger: the CLI's logging set-up did nothing, and no val_loss was printed."""
  src = tmp_path / "base"
  loop.train(train_utils.tiny_config(1, **{"model.activation": "gelu"}), src)     # train_cmd's architecture
  res = train_utils.run(train_utils.train_cmd(tmp_path / "ft", "--config.train.steps=2", "--config.train.eval_every=2",
                                              f"--config.train.init_from={src}"))
  assert res.returncode == 0, res.stderr[-2000:]
  assert "INFO tformer_jax: step 2: val_loss" in res.stderr, res.stderr[-2000:]
  assert "initialised parameters from" in res.stderr and "model: " in res.stderr
