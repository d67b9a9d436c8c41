"""The one command-line syntax of every tool: absl flags, and the experiment config as
`--config=FILE --config.a.b=v` (ml_collections' config_flags), as scripts/train.py spells it.

A command defines its flags in a function and parses its argv with `parse`:

    def define_flags(fv):
      flags.DEFINE_integer("steps", 20, "timed steps", flag_values=fv)

    def main(argv=None):
      args = cli_common.parse(argv, define_flags, doc=__doc__, prog="python -m ...", config="required")
      args.config            # the ConfigDict, overrides applied;  args.steps, args.json, ...

Overrides may stand anywhere on the line, before or after `--config=FILE`; a field's text is parsed by
the field's type (`--config.model.remat=full`, `--config.optim.peak_lr=1e-3`,
`--config.model.scan_layers=false`, `--config.mesh.shape='(2, 2)'`). Where a command takes a
training run (`--workdir=RUN`, `from_workdir=True`) and no `--config`, the config is the run's
config.json over `default_config()`. Every parse uses fresh `FlagValues`, so tests can call several
commands' `main(argv)` in one process. Any usage error, an unknown flag or config field included, is
one line `error: ...` on stderr and exit status 2.
"""
from __future__ import annotations

import json
import pathlib
import sys
import textwrap
import types
from typing import Any, Callable, Mapping, Sequence

import ml_collections
from absl import flags
from ml_collections import config_flags

from tformer_jax.config import default_config, load_config_file as _load

REPO = pathlib.Path(__file__).resolve().parents[1]
HELP_FLAGS = ("help", "helpshort", "helpfull")


class UsageError(Exception):
  """A command line that cannot run: reported as one `error: ...` line, exit status 2."""


def load_config_file(path: str | pathlib.Path) -> ml_collections.ConfigDict:
  """`get_config()` of a config file, by path relative to the cwd or else the repository root."""
  p = pathlib.Path(path)
  if not p.is_file() and not p.is_absolute() and (REPO / p).is_file():
    p = REPO / p
  if not p.is_file():
    raise UsageError(f"config file {path} not found")
  return _load(p)


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

  merge(cfg, json.loads(path.read_text()))
  return cfg


def _apply(cfg: ml_collections.ConfigDict, argv: list[str], lock: bool
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
  for key in values:
    node = out
    for part in key.split("."):
      if not isinstance(node, ml_collections.ConfigDict) or part not in node:
        raise UsageError(f"unknown config field {key!r}")
      node = node[part]
  try:
    out.update_from_flattened_dict(values)
    if text:
      _apply(out, ["override"] + [f"--config.{k}={v}" for k, v in text.items()], lock=True)
  except (flags.Error, AttributeError, KeyError, TypeError, ValueError) as e:
    raise UsageError(_one_line(e)) from e
  if not cfg.is_locked:
    out.unlock()
  return out


def load_config(path: str | None = None, overrides: Mapping[str, Any] | None = None,
                workdir: str | None = None) -> ml_collections.ConfigDict:
  """The config file (or a run's config.json) with overrides, as a command line would give it."""
  if path:
    cfg = load_config_file(path)
  elif workdir:
    cfg = workdir_config(workdir)
  else:
    raise UsageError("pass --config=configs/<name>.py")
  return override(cfg, overrides or {})


def _one_line(e: BaseException) -> str:
  while isinstance(e, (AttributeError, KeyError)) and e.args and isinstance(e.args[0], BaseException):
    e = e.args[0]                 # config_flags: AttributeError(KeyError("'x'\nDid you mean ..."))
  if isinstance(e, KeyError):
    text = (str(e.args[0]) if e.args else "?").replace("Did you", "did you")
    return "unknown config field " + "; ".join(s.strip() for s in text.splitlines() if s.strip())
  return "; ".join(s.strip() for s in str(e).splitlines() if s.strip()) or type(e).__name__


def _own_flags(fv: flags.FlagValues) -> list[flags.Flag]:
  """The command's flags in definition order (not short-name aliases, not --help)."""
  return [fv[name] for name in fv if name == fv[name].name and name not in HELP_FLAGS]


def help_text(fv: flags.FlagValues, doc: str, prog: str) -> str:
  lines = [f"usage: {prog} [flags]", "", (doc or "").strip(), "", "flags:"]
  for flag in _own_flags(fv):
    default = "" if flag.default in (None, "", []) else f" (default: {flag.default_as_str})"
    text = " ".join(flag.help.split())        # absl adds "; \n    repeat this option ..." to lists
    lines += textwrap.wrap(f"--{flag.name}: {text}{default}", 100, initial_indent="  ",
                           subsequent_indent="      ")
  return "\n".join(lines + ["  -h, --help: show this help and exit"])


def fail(message: str) -> None:
  """A usage error: one line `error: message` on stderr, exit status 2."""
  print(f"error: {message}", file=sys.stderr)
  raise SystemExit(2)


def parse(argv: Sequence[str] | None, define: Callable[[flags.FlagValues], None] | None = None, *,
          doc: str = "", prog: str | None = None, config: bool | str = False,
          from_workdir: bool = False) -> types.SimpleNamespace:
  """Flags of one command -> a namespace: every flag by name ('-' read as '_') and, for a command with
  a config, `config` (the ConfigDict), `config_file` and `overrides` ({'a.b': value}).

  define: adds the command's flags to the FlagValues it is given.
  config: False (no --config), True (optional), 'required', or a default config file.
  from_workdir: without --config, use the run of the command's --workdir flag.
  `-h` / `--help` prints the flags and exits 0; a usage error prints one line and exits 2.
  """
  argv = list(sys.argv[1:] if argv is None else argv)
  prog = prog or pathlib.Path(sys.argv[0]).name
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()       # grain's worker processes read absl's global flags
  fv = flags.FlagValues()
  flags.DEFINE_bool("help", False, "show this help and exit", short_name="h", flag_values=fv)
  for name in HELP_FLAGS[1:]:
    flags.DEFINE_bool(name, False, "same as --help", flag_values=fv)
  if config is not False:
    default = config if isinstance(config, str) and config != "required" else None
    run = "; without it, the config.json of --workdir's run" if from_workdir else ""
    flags.DEFINE_string("config", default, f"experiment file with get_config(){run}. Override any "
                        "field with --config.a.b=value, anywhere on the line", flag_values=fv)
  if define is not None:
    define(fv)
  try:
    rest = fv([prog] + argv, known_only=config is not False)
  except (flags.Error, ValueError) as e:
    fail(_one_line(e))
  if any(fv[name].value for name in HELP_FLAGS):
    print(help_text(fv, doc, prog))
    raise SystemExit(0)
  args = types.SimpleNamespace(**{f.name.replace("-", "_"): f.value for f in _own_flags(fv)})
  if config is False:
    if len(rest) > 1:
      fail(f"unexpected arguments: {' '.join(rest[1:])}")
    return args
  args.config_file, args.config, args.overrides = fv.config, None, {}
  try:
    if fv.config:
      cfg = load_config_file(fv.config)
    elif from_workdir and getattr(args, "workdir", None):
      cfg, args.config_file = workdir_config(args.workdir), str(pathlib.Path(args.workdir) / "config.json")
    elif config == "required":
      raise UsageError("pass --config=configs/<name>.py" + (" (or --workdir=RUN)" if from_workdir else ""))
    else:
      cfg = None
    if cfg is None:
      if len(rest) > 1:
        extra = " (--config.a.b=v overrides need --config=FILE)" if rest[1].startswith("--config.") else ""
        raise UsageError(f"unexpected arguments: {' '.join(rest[1:])}{extra}")
      return args
    args.config, args.overrides, positional = _apply(cfg, [prog] + rest[1:], lock=True)
    if positional:
      raise UsageError(f"unexpected arguments: {' '.join(positional)}")
  except UsageError as e:
    fail(str(e))
  except (flags.Error, AttributeError, KeyError, TypeError, ValueError, OSError) as e:
    fail(_one_line(e))
  return args
