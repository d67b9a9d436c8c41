"""`parse`: one command's absl flags (fresh FlagValues, --help, --config and --print_config) into a
namespace with the config loaded and overridden; an unknown flag names the closest flag or config field."""
from __future__ import annotations

import difflib
import pathlib
import sys
import textwrap
import types
from typing import Any, Callable, Sequence

import ml_collections
from absl import flags

from tformer_jax import backends, config as config_lib
from tformer_jax.cli_common.describe import describe_config
from tformer_jax.cli_common.errors import UsageError, fail, flag_error_line, one_line
from tformer_jax.cli_common.loading import (
  CONFIG_HINT,
  apply_flags,
  check_overrides,
  load_named_config,
  resolve_source,
  workdir_config,
)
from tformer_jax.config import ConfigError, default_config

HELP_FLAGS = ("help", "helpshort", "helpfull")


def _config_paths(cfg: Any, prefix: str = "") -> list[str]:
  out = []
  for key in cfg.keys():
    if isinstance(cfg[key], ml_collections.ConfigDict):
      out += _config_paths(cfg[key], f"{prefix}{key}.")
    else:
      out.append(prefix + key)
  return out


def unknown_flag_hint(name: str, fv: flags.FlagValues, cfg: Any = None) -> str:
  """' (did you mean --config.train.steps?)' for an unknown --NAME: a near-identical flag of the command,
  else (a command with --config) the config field of that name, else the closest flag or field; '' if
  nothing is close."""
  name = name.replace("-", "_")
  own = [f.name for f in _own_flags(fv)]
  near = difflib.get_close_matches(name, own, n=1, cutoff=0.85)
  if near or "config" not in fv:
    close = near or difflib.get_close_matches(name, own, n=1, cutoff=0.7)
    return f" (did you mean --{close[0]}?)" if close else ""
  paths = _config_paths(cfg if cfg is not None else default_config())
  exact = [p for p in paths if p.rsplit(".", 1)[-1] == name or p == name]
  if exact:
    return " (did you mean " + " or ".join(f"--config.{p}" for p in exact[:3]) + "?)"
  close = difflib.get_close_matches(name, own, n=1, cutoff=0.7)
  if close:
    return f" (did you mean --{close[0]}?)"
  leaves = {p.rsplit(".", 1)[-1]: p for p in paths}
  close = difflib.get_close_matches(name, list(leaves), n=1, cutoff=0.75)
  return f" (did you mean --config.{leaves[close[0]]}?)" if close else ""


def _flag_error(e: BaseException, fv: flags.FlagValues, cfg: Any = None) -> str:
  """One line for a flag error; an unknown flag names the closest flag or config field."""
  if isinstance(e, flags.UnrecognizedFlagError) and getattr(e, "flagname", None):
    fields = ", --print_config the config fields" if "print_config" in fv else ""
    return (f"unknown command line flag --{e.flagname}{unknown_flag_hint(e.flagname, fv, cfg)}; --help lists "
            f"the flags{fields}")
  return flag_error_line(e)


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


def choices(text: str, allowed: Sequence[str], what: str) -> list[str]:
  """The comma-separated names of `text` (a flag's value), each one of `allowed`; a usage error (one line,
  exit 2) naming the first that is not."""
  names = [x.strip() for x in text.split(",") if x.strip()]
  for name in names:
    if name not in allowed:
      fail(f"unknown {what} {name!r}; expected one of {tuple(allowed)}")
  return names


def check_model_source(args: types.SimpleNamespace) -> None:
  """The model a decoding command runs: exactly one of --workdir, --hf, --random_init (which needs
  --config); a usage error in one line otherwise."""
  sources = [name for name in ("workdir", "hf", "random_init") if getattr(args, name)]
  if len(sources) != 1:
    fail("pass exactly one of --workdir=RUN, --hf=DIR, --random_init")
  if args.random_init and args.config is None:
    fail("--random_init needs --config=NAME (a shipped config such as llama_tiny, or a file)")


def _common_flags(config: bool | str, from_workdir: bool) -> flags.FlagValues:
  """Fresh FlagValues with --help (and, for a command with a config, --config and --print_config)."""
  fv = flags.FlagValues()
  flags.DEFINE_bool("help", False, "show this help and exit", short_name="h", flag_values=fv)
  for name in HELP_FLAGS[1:]:
    flags.DEFINE_bool(name, False, "same as --help", flag_values=fv)
  if config is not False:
    default = config if isinstance(config, str) and config != "required" else None
    run = "; without it, the config.json of --workdir's run" if from_workdir else ""
    flags.DEFINE_string("config", default, f"experiment file with get_config(): a path or a shipped name "
                        f"(llama_tiny, bench/gpt2_cpu, ...), or a workdir (its config.json){run}. Override any "
                        "field with --config.a.b=value, anywhere on the line; --print_config lists them",
                        flag_values=fv)
    flags.DEFINE_bool("print_config", False, "print every config field with its value (overrides "
                      "applied) and its description, then exit", flag_values=fv)
  return fv


def _command_config(fv: flags.FlagValues, args: types.SimpleNamespace, config: bool | str, from_workdir: bool,
                    from_hf: bool) -> tuple[ml_collections.ConfigDict | None, bool]:
  """(the command's config before overrides, whether it is a run's config.json: already resolved) from
  --config, --workdir's run or --hf (the defaults); (None, False) where a command may go without."""
  hf_dir = getattr(args, "hf", None) if from_hf else None
  cfg, from_run = None, False
  if fv.config:
    cfg, from_run = load_named_config(fv.config), pathlib.Path(fv.config).is_dir() and not hf_dir
  elif from_workdir and getattr(args, "workdir", None):
    cfg, args.config_file = workdir_config(args.workdir), str(pathlib.Path(args.workdir) / "config.json")
    from_run = True
  elif hf_dir:
    cfg = default_config()
  elif config == "required":
    raise UsageError(CONFIG_HINT + (" (or --workdir=RUN)" if from_workdir else "")
                     + (" (or --hf=DIR)" if from_hf else ""))
  if cfg is not None and hf_dir:
    cfg.train.init_from = f"hf:{hf_dir}"       # the directory is the model
  return cfg, from_run


def _parse_flags(argv: list[str], define: Callable[[flags.FlagValues], None] | None, doc: str, prog: str,
                 config: bool | str, from_workdir: bool) -> tuple[flags.FlagValues, list[str]]:
  """(the command's FlagValues, parsed; the arguments left for --config.a.b=v overrides). Prints the
  help and exits 0 for -h/--help; a flag error prints one line and exits 2."""
  if backends.idle_libtpu():
    import jax  # noqa: PLC0415 (only here: tformer-prepare and --help never import jax)
    jax.config.update("jax_platforms", "cpu")     # before any backend starts: no libtpu start-up errors
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()       # grain's worker processes read absl's global flags
  fv = _common_flags(config, from_workdir)
  if define is not None:
    define(fv)
  try:
    rest = fv([prog] + argv, known_only=config is not False)
  except (flags.Error, ValueError) as e:
    fail(_flag_error(e, fv))
  if any(fv[name].value for name in HELP_FLAGS):
    print(help_text(fv, doc, prog))
    raise SystemExit(0)
  return fv, rest


def parse(argv: Sequence[str] | None, define: Callable[[flags.FlagValues], None] | None = None, *,
          doc: str = "", prog: str | None = None, config: bool | str = False,
          from_workdir: bool = False, from_hf: bool = False) -> types.SimpleNamespace:
  """Flags of one command -> a namespace: every flag by name ('-' read as '_') and, for a command with
  a config, `config` (the ConfigDict), `config_file` and `overrides` ({'a.b': value}).

  define: adds the command's flags to the FlagValues it is given.
  config: False (no --config), True (optional), 'required', or a default config file.
  from_workdir: without --config, use the run of the command's --workdir flag.
  from_hf: the command's --hf=DIR is the model: the config (--config's, or the defaults) gets
    train.init_from=hf:DIR, so its architecture, max_len and tokenizer are the directory's and
    --config.a.b=v overrides apply on top.
  A config with train.init_from is resolved here, once (`resolve_source`): every command (and
  --print_config) sees the model that will run.
  `-h` / `--help` prints the flags and exits 0; a usage error prints one line and exits 2.
  """
  prog = prog or pathlib.Path(sys.argv[0]).name
  fv, rest = _parse_flags(list(sys.argv[1:] if argv is None else argv), define, doc, prog, config, from_workdir)
  args = types.SimpleNamespace(**{f.name.replace("-", "_"): f.value for f in _own_flags(fv)})
  print_config = bool(getattr(args, "print_config", False))
  if config is False:
    if len(rest) > 1:
      fail(f"unexpected arguments: {' '.join(rest[1:])}")
    return args
  args.config_file, args.config, args.overrides = fv.config, None, {}
  try:
    cfg, from_run = _command_config(fv, args, config, from_workdir, from_hf)
    if cfg is None and print_config:
      cfg = default_config()
    if cfg is None:
      if len(rest) > 1:
        extra = " (--config.a.b=v overrides need --config=FILE)" if rest[1].startswith("--config.") else ""
        raise UsageError(f"unexpected arguments: {' '.join(rest[1:])}{extra}")
      return args
    check_overrides(cfg, rest[1:])
    args.config, args.overrides, positional = apply_flags(cfg, [prog] + rest[1:], lock=True)
    if positional:
      raise UsageError(f"unexpected arguments: {' '.join(positional)}")
    if not from_run:
      args.config = resolve_source(args.config, args.overrides)   # train.init_from: the real model
    args.config = config_lib.resolved(args.config)     # model.vocab_size 0: the tokenizer's
    if print_config:
      print(describe_config(args.config))
      raise SystemExit(0)
  except (UsageError, ConfigError) as e:
    fail(one_line(e))
  except (flags.Error, AttributeError, KeyError, TypeError, ValueError, OSError) as e:
    fail(_flag_error(e, fv, locals().get("cfg")))
  return args
