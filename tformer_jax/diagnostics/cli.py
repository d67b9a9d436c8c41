"""Config handling shared by the diagnostics commands: `--config=FILE` plus `--config.a.b=value`
overrides (the same spelling as scripts/train.py), split off before argparse sees the rest."""
from __future__ import annotations

import ast
from typing import Any, Sequence

import ml_collections

from tformer_jax.config import ConfigError


def parse_value(text: str) -> Any:
  """'3' -> 3, '1e-3' -> 0.001, 'true' -> True, '(1,2)' -> (1, 2), anything else -> the string."""
  low = text.strip().lower()
  if low in ("true", "false"):
    return low == "true"
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


def set_field(cfg: ml_collections.ConfigDict, dotted: str, value: Any) -> None:
  """cfg.a.b = value, with the value cast to the field's type (int -> float allowed)."""
  node = cfg
  *path, last = dotted.split(".")
  for p in path:
    if p not in node:
      raise ConfigError(f"{dotted}: unknown config field {p!r}")
    node = node[p]
  if last not in node:
    raise ConfigError(f"{dotted}: unknown config field {last!r}")
  old = node[last]
  if isinstance(old, bool):
    value = value if isinstance(value, bool) else str(value).lower() == "true"
  elif isinstance(old, float) and isinstance(value, (int, float)):
    value = float(value)
  elif isinstance(old, int) and isinstance(value, float) and value.is_integer():
    value = int(value)
  elif isinstance(old, str):
    value = str(value)
  elif isinstance(old, tuple) and isinstance(value, list):
    value = tuple(value)
  node[last] = value


def apply_overrides(cfg: ml_collections.ConfigDict, overrides: dict[str, Any]) -> ml_collections.ConfigDict:
  """A copy of cfg with dotted-key overrides applied (values already parsed or strings)."""
  out = ml_collections.ConfigDict(cfg.to_dict())
  for key, value in overrides.items():
    set_field(out, key, parse_value(value) if isinstance(value, str) else value)
  return out


def split_config_args(argv: Sequence[str]) -> tuple[str | None, dict[str, str], list[str]]:
  """(config path, {'a.b': 'value'} overrides, the remaining args) from a command line."""
  path, overrides, rest = None, {}, []
  args = list(argv)
  i = 0
  while i < len(args):
    a = args[i]
    if a.startswith("--config.") or a.startswith("--config="):
      key, eq, val = a[2:].partition("=")
      if not eq:                       # --config.x VALUE
        i += 1
        val = args[i] if i < len(args) else ""
      if key == "config":
        path = val
      else:
        overrides[key[len("config."):]] = val
    elif a == "--config":
      i += 1
      path = args[i] if i < len(args) else None
    else:
      rest.append(a)
    i += 1
  return path, overrides, rest


def load_config(path: str | None, overrides: dict[str, str], workdir: str | None = None
                ) -> ml_collections.ConfigDict:
  """The config file (or a workdir's config.json when no file is given) with overrides applied."""
  from tformer_jax import config as config_lib
  if path:
    from tformer_jax.decode_io import load_config_file
    cfg = load_config_file(path)
  elif workdir:
    import json
    import pathlib
    cfg = config_lib.default_config()
    saved = json.loads((pathlib.Path(workdir) / "config.json").read_text())
    for section, fields in saved.items():
      if section in cfg and isinstance(fields, dict):
        for k, v in fields.items():
          if k in cfg[section] and not isinstance(cfg[section][k], ml_collections.ConfigDict):
            set_field(cfg, f"{section}.{k}", v)
          elif k in cfg[section]:
            cfg[section][k] = ml_collections.ConfigDict(v)
  else:
    raise ConfigError("config: pass --config=configs/<name>.py (or --workdir of a training run)")
  return apply_overrides(cfg, overrides)
