"""Code shape the linter does not check: every file of the package and the benchmarks fits in 600 lines and
every function in 100 (ruff's C901 bounds their branching, pyproject.toml)."""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAX_LINES = 100
MAX_FILE_LINES = 600
# Functions still over the limit, each until its owner splits it into named steps.
PENDING: set[tuple[str, str]] = set()


def _long_functions(root: pathlib.Path, base: pathlib.Path = ROOT) -> list[tuple[str, str, int]]:
  """(file relative to base, function, lines) of every function or method under root over MAX_LINES
  lines, decorators excluded."""
  out = []
  for path in sorted(root.rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        lines = node.end_lineno - node.lineno + 1
        if lines > MAX_LINES:
          out.append((path.relative_to(base).as_posix(), node.name, lines))
  return out


def test_no_function_over_100_lines():
  found = [f for d in ("tformer_jax", "benchmarks") for f in _long_functions(ROOT / d)]
  over = [f"{path}: {name} ({n} lines)" for path, name, n in found if (path, name) not in PENDING]
  assert not over, "functions over 100 lines: " + "; ".join(over)
  still = {(path, name) for path, name, _ in found}
  assert PENDING <= still, f"no longer over 100 lines, drop from PENDING: {sorted(PENDING - still)}"


def test_the_length_check_sees_a_long_function(tmp_path):
  body = "\n".join(f"  x{i} = {i}" for i in range(MAX_LINES))
  (tmp_path / "m.py").write_text(f"def long():\n{body}\n\n\ndef short():\n  return 1\n")
  assert _long_functions(tmp_path, tmp_path) == [("m.py", "long", MAX_LINES + 1)]


def test_no_file_over_600_lines():
  over = [f"{p.relative_to(ROOT).as_posix()} ({n} lines)" for d in ("tformer_jax", "benchmarks")
          for p in sorted((ROOT / d).rglob("*.py")) if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]
  assert not over, "files over 600 lines (split them into modules of one idea each): " + "; ".join(over)
