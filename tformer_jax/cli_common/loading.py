"""Where a command's config comes from: a shipped experiment by name, a file with get_config(), or a
run's config.json; `--config.a.b=v` overrides parsed by each field's type; train.init_from resolved."""
from __future__ import annotations

import json
import pathlib
import re
from typing import Any, Mapping, Sequence

import ml_collections
from absl import flags
from ml_collections import config_flags

from tformer_jax.cli_common.errors import UsageError, flag_error_line, one_line
from tformer_jax.config import ConfigError, check_field_path, default_config, load_config_file as _load

REPO = pathlib.Path(__file__).resolve().parents[2]
CONFIG_HINT = "pass --config=NAME (a shipped config such as llama_tiny, or a file with get_config())"
_OVERRIDE = re.compile(r"^--?(?:no)?config\.([^=]+)")      # --config.a.b[=v], --noconfig.a.b (booleans)


def check_overrides(cfg: ml_collections.ConfigDict, argv: Sequence[str]) -> None:
  """ConfigError for the first `--config.a.b[=v]` in argv whose field `cfg` does not have, naming
  the closest valid fields (before absl parses them, whose error would name only the last part)."""
  for arg in argv:
    if arg == "--":
      break
    m = _OVERRIDE.match(arg)
    if m:
      check_field_path(cfg, m.group(1))


def config_dirs() -> list[pathlib.Path]:
  """Where shipped experiment files live: the checkout's configs/ and, in an installed package,
  tformer_jax/configs (pyproject.toml maps configs/ there)."""
  dirs = [REPO / "configs", pathlib.Path(__file__).resolve().parents[1] / "configs"]
  return [d for d in dirs if d.is_dir()]


def shipped_configs() -> list[str]:
  """The shipped experiments by name ('llama_tiny', 'bench/gpt2_cpu', ...)."""
  names = {str(f.relative_to(d).with_suffix("")) for d in config_dirs() for f in d.rglob("*.py")
           if f.name != "__init__.py"}
  return sorted(names)


def find_config_file(path: str | pathlib.Path) -> pathlib.Path:
  """An experiment file: the path as given (from the cwd), else relative to the checkout, else a
  shipped config by path or name (`configs/llama_tiny.py`, `llama_tiny`, `bench/gpt2_cpu`)."""
  p = pathlib.Path(path)
  if p.is_file():
    return p
  if not p.is_absolute():
    rel = p.parts[1:] if p.parts and p.parts[0] == "configs" else p.parts
    for d in [REPO] + config_dirs():
      for candidate in (d / p, d.joinpath(*rel), d.joinpath(*rel).with_suffix(".py")):
        if rel and candidate.is_file():
          return candidate
  raise UsageError(f"config file {path} not found; the shipped configs are: {', '.join(shipped_configs())}")


def load_named_config(path: str | pathlib.Path) -> ml_collections.ConfigDict:
  """A config by name, path or workdir: `get_config()` of an experiment file (a shipped name or a path, found by
  `find_config_file`), or the config.json of a workdir (a training run, or one `tformer-convert --from-hf` wrote).
  `config.load_config_file` is the plain one: a Python file by its path."""
  if pathlib.Path(path).is_dir() and (pathlib.Path(path) / "config.json").is_file():
    return workdir_config(path)
  file = find_config_file(path)
  try:
    return _load(file)
  except ConfigError:
    raise
  except Exception as e:  # noqa: BLE001 - the user's file: any error in it is theirs, named in one line
    raise UsageError(config_file_error(file, e)) from e


def config_file_error(file: pathlib.Path, e: BaseException) -> str:
  """One line for an exception raised while an experiment file ran (its module, or its get_config()): the
  file and line where it happened, the exception's type and message."""
  if isinstance(e, SyntaxError) and e.filename and pathlib.Path(e.filename).resolve() == file.resolve():
    return f"config file {file}:{e.lineno}: SyntaxError: {e.msg} (the file does not parse)"
  line, tb = None, e.__traceback__
  while tb is not None:                      # the last frame in the user's file
    if pathlib.Path(tb.tb_frame.f_code.co_filename).resolve() == file.resolve():
      line = tb.tb_lineno
    tb = tb.tb_next
  where = f"{file}:{line}" if line is not None else str(file)
  return f"config file {where}: {type(e).__name__}: {one_line(e)}"


def workdir_config(workdir: str | pathlib.Path) -> ml_collections.ConfigDict:
  """A training run's config: `default_config()` updated from RUN/config.json (fields this version of
  the code no longer has are skipped)."""
  path = pathlib.Path(workdir) / "config.json"
  if not path.is_file():
    raise UsageError(f"{path} not found: is {workdir} a training workdir?")
  cfg = default_config()

  def merge(dst: ml_collections.ConfigDict, src: Mapping[str, Any]) -> None:
    for key, value in src.items():
      if key not in dst:
        continue
      if isinstance(dst[key], ml_collections.ConfigDict) and isinstance(value, Mapping):
        merge(dst[key], value)
      else:
        dst[key] = tuple(value) if isinstance(dst[key], tuple) and isinstance(value, list) else value

  try:
    saved = json.loads(path.read_text())
  except (OSError, ValueError) as e:
    raise UsageError(f"{path}: not a readable run config ({getattr(e, 'strerror', None) or e}); restore it, or "
                     "move it away and pass --config") from None
  if not isinstance(saved, Mapping):
    raise UsageError(f"{path}: not a run config (a JSON {type(saved).__name__}, not an object)")
  merge(cfg, saved)
  return cfg


def apply_flags(cfg: ml_collections.ConfigDict, argv: list[str], lock: bool
           ) -> tuple[ml_collections.ConfigDict, dict[str, Any], list[str]]:
  """config_flags on `cfg` (changed in place): (cfg, {path: value} applied, positional args left)."""
  fv = flags.FlagValues()
  holder = config_flags.DEFINE_config_dict("config", cfg, "the experiment config", flag_values=fv,
                                           lock_config=lock, sys_argv=argv)
  rest = fv(argv)
  return holder.value, dict(fv["config"].override_values), rest[1:]


def override(cfg: ml_collections.ConfigDict, overrides: Mapping[str, Any]) -> ml_collections.ConfigDict:
  """A copy of `cfg` with {'a.b': value} set: a string value is parsed exactly as `--config.a.b=value`
  on a command line (by the field's type); other values are assigned as they are."""
  out = cfg.copy_and_resolve_references()
  out.lock()                                     # an unknown field is an error, not a new field
  text = {k: v for k, v in overrides.items() if isinstance(v, str)}
  values = {k: v for k, v in overrides.items() if not isinstance(v, str)}
  try:
    for key in overrides:
      check_field_path(out, key)
  except ConfigError as e:
    raise UsageError(str(e)) from None
  try:
    out.update_from_flattened_dict(values)
    if text:
      apply_flags(out, ["override"] + [f"--config.{k}={v}" for k, v in text.items()], lock=True)
  except (flags.Error, AttributeError, KeyError, TypeError, ValueError) as e:
    raise UsageError(flag_error_line(e)) from e
  if not cfg.is_locked:
    out.unlock()
  return out


def load_config(path: str | None = None, overrides: Mapping[str, Any] | None = None,
                workdir: str | None = None) -> ml_collections.ConfigDict:
  """The config file (or a run's config.json) with overrides, as a command line would give it (train.init_from
  resolved: `resolve_source`)."""
  if path:
    cfg = load_named_config(path)
  elif workdir:
    cfg = workdir_config(workdir)
  else:
    raise UsageError(CONFIG_HINT)
  out = override(cfg, overrides or {})
  from_run = not path or pathlib.Path(path).is_dir()       # a run's config.json: resolved already
  return out if from_run else resolve_source(out, overrides or {})


def resolve_source(cfg: ml_collections.ConfigDict, overrides: Mapping[str, Any]) -> ml_collections.ConfigDict:
  """cfg with train.init_from's architecture, max_len and tokenizer, the command line's model.*
  overrides on top (`train.init_from.resolve`); cfg itself without init_from. A run's own config.json
  is already resolved and is not passed here."""
  if "train" not in cfg or not str(cfg.train.get("init_from", "") or ""):
    return cfg
  from tformer_jax.train import init_from  # noqa: PLC0415 (jax: only for a config that reads a source)
  return init_from.resolve(cfg, overrides)
