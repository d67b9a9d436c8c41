"""The README is a front door that stays true: at most ~150 lines, no commit hashes, its Python quick start
runs as written, and every command line in it names a script, console command, config and config field that
exist (each guide it links exists too)."""
from __future__ import annotations

import importlib.util
import pathlib
import re
import shlex

import pytest

from tformer_jax.config import default_config

tomllib = pytest.importorskip("tomllib")   # Python 3.11+
REPO = pathlib.Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
CONSOLE = set(PYPROJECT["project"]["scripts"])
EXTRAS = set(PYPROJECT["project"]["optional-dependencies"])


def _blocks(lang: str) -> list[str]:
  return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def _command_lines() -> list[list[str]]:
  """Each command of the ```bash blocks as tokens, comments dropped, backslash continuations joined."""
  out = []
  for block in _blocks("bash"):
    for line in block.replace("\\\n", " ").splitlines():
      tokens = shlex.split(line, comments=True)
      if tokens:
        out.append(tokens)
  return out


def test_readme_is_short_and_has_no_commit_hashes():
  lines = README.splitlines()
  assert len(lines) <= 150, f"README.md has {len(lines)} lines; the reference material belongs in docs/"
  hashes = re.findall(r"(?<![\w/.-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}(?![\w/.-])", README)
  assert not hashes, hashes
  assert not re.search(r"\b\d{1,2}:\d\d( UTC)?\b", README), "clock times belong in a results log, not the README"


def test_readme_links_exist():
  links = re.findall(r"\]\(([^)#]+)\)", README)
  assert links and all((REPO / link).exists() for link in links), [x for x in links if not (REPO / x).exists()]
  for guide in sorted((REPO / "docs").glob("*.md")):      # every guide is reachable from the front door
    assert f"docs/{guide.name}" in README, guide.name


def _config_path(name: str) -> pathlib.Path:
  p = pathlib.Path(name)
  return REPO / p if p.suffix == ".py" else REPO / "configs" / f"{name}.py"


def _has_field(cfg, dotted: str) -> bool:
  node = cfg
  for part in dotted.split("."):
    if part not in node:
      return False
    node = node[part]
  return True


def test_readme_commands_name_what_exists():
  cfg = default_config()
  commands = _command_lines()
  assert len(commands) >= 10, commands
  for tokens in commands:
    head, rest = tokens[0], tokens[1:]
    if head == "bash":
      assert (REPO / rest[0]).is_file(), f"{rest[0]}: no such script"
    elif head == "python":
      assert (REPO / rest[0]).is_file() if rest[0] != "-m" else importlib.util.find_spec(rest[1]), tokens
    elif head == "pip":
      assert rest[0] == "install", tokens
      for spec in rest[1:]:
        extras = re.fullmatch(r"-e|\.|\.\[([\w,-]+)\]", spec)
        assert extras, f"{spec}: not an install of this checkout"
        assert set(filter(None, (extras.group(1) or "").split(","))) <= EXTRAS, f"{spec}: unknown extra"
    else:
      assert head in CONSOLE, f"{head}: not a console command in pyproject.toml"
    for token in rest:
      if m := re.fullmatch(r"--config=(.+)", token):
        assert _config_path(m.group(1)).is_file(), f"{token}: no such config"
      elif m := re.fullmatch(r"--config\.([\w.]+)=.*", token):
        assert _has_field(cfg, m.group(1)), f"{token}: no such config field"


@pytest.mark.parametrize("index", range(2))
def test_readme_python_snippets_run(index, tmp_path, monkeypatch):
  """The quick start's Python blocks, in order (the second reuses the first's imports), run as written."""
  blocks = _blocks("python")
  assert len(blocks) == 2, "the quick start has two Python snippets (the ops, the model with HF files)"
  monkeypatch.chdir(tmp_path)                        # save_hf writes its directory here
  scope: dict = {}
  for block in blocks[: index + 1]:
    exec(compile(block, f"README.md python block {blocks.index(block) + 1}", "exec"), scope)   # noqa: S102
  if index == 0:
    assert scope["out"].shape == (2, 32, 4, 16)
  else:
    assert scope["logits"].shape == (1, 16, scope["cfg"].vocab_size)
    assert (tmp_path / "tiny_llama" / "config.json").is_file()
    reloaded = scope["model"].apply({"params": scope["params"]}, scope["tokens"])   # the model load_hf gave
    assert float(abs(reloaded - scope["logits"]).max()) <= 1e-5
