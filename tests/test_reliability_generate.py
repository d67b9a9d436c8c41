"""tformer-generate's anticipated errors are one line, status 2: sampling flags out of range, a stop token the
model cannot emit, a prompt longer than a learned-position model holds, an empty prompts file; a prompts file
keeps its line numbers (a blank line does not renumber the outputs)."""
from __future__ import annotations

import pathlib
import re

import pytest

from tformer_jax.cli import generate

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = [f"--config={REPO / 'configs' / 'gpt2_tiny.py'}", "--config.model.d_model=32", "--config.model.num_layers=1",
        "--config.model.num_heads=2", "--config.model.max_len=32", "--config.data.seq_len=32", "--random_init",
        "--temperature=0", "--max_new_tokens=2", "--noscan_layers"]


def _error(argv, capsys) -> str:
  capsys.readouterr()
  with pytest.raises(SystemExit) as e:
    generate.main([*TINY, *argv])
  err = capsys.readouterr().err.strip()
  assert e.value.code == 2 and err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
  return err


@pytest.mark.parametrize("flag, match", [
    ("--temperature=-1", r"--temperature: must be >= 0"),
    ("--top_p=0", r"--top_p: must be in \(0, 1\]"),
    ("--top_p=1.5", r"--top_p: must be in \(0, 1\]"),
    ("--top_k=-3", r"--top_k: must be >= 0"),
    ("--max_new_tokens=0", r"--max_new_tokens: must be >= 1"),
    ("--repetition_penalty=0", r"--repetition_penalty: must be > 0"),
])
def test_sampling_flags_out_of_range_are_one_line(flag, match, capsys):
  assert re.search(match, _error(["--prompt=To be", flag], capsys))


def test_a_prompt_longer_than_learned_positions_hold_is_one_line(capsys):
  err = _error(["--prompt=" + "a" * 40], capsys)
  assert re.search(r"prompt 0 .*40 tokens.* max_len=32", err), err


def test_an_empty_prompts_file_is_one_line(tmp_path, capsys):
  empty = tmp_path / "empty.txt"
  empty.write_text("\n  \n")
  assert f"--prompts_file: {empty} holds no prompt" in _error([f"--prompts_file={empty}"], capsys)


def test_a_prompts_file_keeps_its_line_numbers(tmp_path, capsys):
  f = tmp_path / "prompts.txt"
  f.write_text("To be\n\nor not\n")
  capsys.readouterr()
  assert generate.main([*TINY, f"--prompts_file={f}"]) == 0
  out = capsys.readouterr().out
  heads = re.findall(r"=== \[(.*?)\] ===", out)
  assert heads == [f"{f}:1", f"{f}:3"], out


def test_a_stop_token_outside_the_vocabulary_is_one_line(capsys):
  """--stop='z' is the byte tokenizer's token 122; a 100-token model cannot emit it (was a ValueError traceback
  from decode's request check)."""
  err = _error(["--config.model.vocab_size=100", "--prompt=ab", "--stop=z"], capsys)
  assert "--stop='z' is token 122, outside this model's vocabulary of 100 tokens" in err, err
