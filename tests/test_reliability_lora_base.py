"""A LoRA run is bound to the exact base it trained on (WORKDIR/lora_base.json: the base's step and the sha256
of its weights). An HF base exported again in place (a real `tformer-convert --overwrite` of other weights) is
refused by every reader (restore_params, tformer-eval, tformer-convert) and by a resumed run, in one line naming
both digests; a workdir base that trains on is read at the pinned step, not its latest, and once that step has
rotated away the refusal names it."""
from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from tformer_jax import cli_common
from tformer_jax.checkpoint import BASE_FILE, CheckpointError, restore_params
from tformer_jax.cli import convert, eval as eval_cli
from tformer_jax.train import loop

import train_utils


def _base_cfg(steps: int, seed: int = 0, **over):
  """A tiny Llama (SwiGLU, RMSNorm, RoPE: an architecture HF holds) on Shakespeare's characters."""
  c = train_utils.tiny_config(steps, **over)
  c.model.activation, c.model.tie_embeddings = "swiglu", False
  c.train.seed, c.train.ckpt_every, c.train.eval_every, c.train.max_to_keep = seed, 1, steps, 3
  return c


def _lora_cfg(source: str, steps: int):
  c = _base_cfg(steps)
  c.train.init_from = source
  c.train.lora.rank, c.train.lora.alpha, c.train.lora.targets = 2, 4.0, "q,v"
  c.train.ckpt_every = steps
  return c


def _one_line(err: str) -> str:
  lines = [x for x in err.splitlines() if x.strip()]
  assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
  return lines[0]


def _same(a, b) -> bool:
  return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_an_hf_base_exported_again_is_refused_by_every_reader(tmp_path, capsys):
  one, two, base, run = tmp_path / "one", tmp_path / "two", tmp_path / "base_hf", tmp_path / "lora"
  loop.train(_base_cfg(1, seed=0), one)
  loop.train(_base_cfg(1, seed=1), two)
  assert convert.main(["--from", str(one), "--to-hf", str(base)]) == 0
  loop.train(_lora_cfg(f"hf:{base}", 2), run)
  record = json.loads((run / BASE_FILE).read_text())
  assert record["source"] == f"hf:{base}" and record["step"] is None and len(record["sha256"]) == 64
  _, before = restore_params(run)

  assert convert.main(["--from", str(two), "--to-hf", str(base), "--overwrite"]) == 0    # a real re-export
  with pytest.raises(CheckpointError, match=r"the LoRA base of .* changed: hf:.*base_hf has weights sha256 "
                                            r"[0-9a-f]{12} now, the run trained on hf:.*base_hf with sha256 "
                                            + record["sha256"][:12]):
    restore_params(run)
  capsys.readouterr()
  assert cli_common.run_main(eval_cli.main, [f"--workdir={run}", "--batches=1"]) == 2
  assert record["sha256"][:12] in _one_line(capsys.readouterr().err)
  assert cli_common.run_main(convert.main, ["--from", str(run), "--to-hf", str(tmp_path / "merged")]) == 2
  assert record["sha256"][:12] in _one_line(capsys.readouterr().err)
  assert not (tmp_path / "merged").exists()
  with pytest.raises(CheckpointError, match=r"the LoRA base of .* changed"):
    loop.train(_lora_cfg(f"hf:{base}", 3), run)             # a resumed run: refused, nothing written
  assert json.loads((run / BASE_FILE).read_text()) == record

  assert convert.main(["--from", str(one), "--to-hf", str(base), "--overwrite"]) == 0    # the base put back
  assert _same(restore_params(run)[1], before)


def test_a_workdir_base_that_trains_on_is_read_at_the_pinned_step(tmp_path):
  base, run = tmp_path / "base", tmp_path / "lora"
  loop.train(_base_cfg(2), base)
  loop.train(_lora_cfg(str(base), 2), run)
  assert json.loads((run / BASE_FILE).read_text())["step"] == 2
  _, before = restore_params(run)
  loop.train(_base_cfg(3), base)                            # the base trains on: step 3 is its latest
  assert restore_params(base, with_step=True)[2] == 3
  assert _same(restore_params(run)[1], before)              # the LoRA model still merges step 2
  again = loop.train(_lora_cfg(str(base), 3), run)          # and resumes on step 2's weights
  assert again["step"] == 3
  loop.train(_base_cfg(5), base)                            # max_to_keep=3: step 2 rotates away
  with pytest.raises(CheckpointError, match=r"train\.init_from=.*base at step 2, the step the run trained on, "
                                            r"cannot be read: .*no checkpoint step 2 .*available: \[3, 4, 5\]"):
    restore_params(run)
