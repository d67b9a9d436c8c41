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
one line `error: ...` on stderr and exit status 2; an unknown field names the closest valid ones
(`error: model.num_layer: unknown field; did you mean model.num_layers?`).

A command's `__main__` runs under `run_main`, the one map from exceptions to exit statuses: the errors
a user can cause (`ANTICIPATED`: a config rule, data, checkpoints, Orbax/TensorStore storage, HF
conversion, distributed start-up, a stopped run) are one line `error: ...` and status 2; anything
else keeps its traceback:

    if __name__ == "__main__":
      sys.exit(cli_common.run_main(main))      # scripts/train.py: cli_common.exit_process(...)
"""
from __future__ import annotations

import difflib
import inspect
import io
import json
import logging
import os
import pathlib
import re
import sys
import textwrap
import threading
import time
import tokenize
import types
from typing import Any, Callable, Mapping, NoReturn, Sequence

import ml_collections
from absl import flags
from ml_collections import config_flags

from tformer_jax import config as config_lib, host_alloc
from tformer_jax.config import ConfigError, check_field_path, default_config, load_config_file as _load

REPO = pathlib.Path(__file__).resolve().parents[1]
HELP_FLAGS = ("help", "helpshort", "helpfull")
CONFIG_HINT = "pass --config=NAME (a shipped config such as llama_tiny, or a file with get_config())"
_OVERRIDE = re.compile(r"^--?(?:no)?config\.([^=]+)")      # --config.a.b[=v], --noconfig.a.b (booleans)

# The errors a user can cause, by name: `run_main` prints them as one line and exits 2. Named, not
# imported, because most live in modules that import jax, which a command may never load (and then
# cannot raise). Subclasses count (WorkdirBusy is a ConfigError).
ANTICIPATED = (
    "tformer_jax.config.ConfigError",                   # a config rule; bad distributed settings
    "tformer_jax.cli_common.UsageError",                # the command line
    "tformer_jax.data.corpora.DataError",               # corpora, tokenizers, the pipeline
    "tformer_jax.checkpoint.CheckpointError",           # missing, unreadable or mismatched checkpoints
    "tformer_jax.interop.hf_config.HFConfigError",      # an architecture HF cannot hold, or we cannot
    "tformer_jax.interop.hf.HFWeightsError",
    "tformer_jax.parallel.distributed.DistributedError",  # a coordinator that cannot be reached
    "tformer_jax.train.loop.TrainingError",             # a run stopped for the user to look at
    "builtins.FileNotFoundError", "builtins.FileExistsError", "builtins.NotADirectoryError",
    "builtins.IsADirectoryError", "builtins.PermissionError",
)
# Errors raised inside these packages (their own classes, or ValueError/OSError/... from their code)
# are checkpoint storage failures met while restoring or saving: anticipated too.
STORAGE_PACKAGES = ("orbax", "tensorstore")
_BUG_TYPES = (TypeError, AttributeError, NameError, ImportError, AssertionError, NotImplementedError,
              RecursionError, SyntaxError)
_MAX_STORAGE_CHARS = 600


class UsageError(Exception):
  """A command line that cannot run: reported as one `error: ...` line, exit status 2."""


def one_line(e: BaseException) -> str:
  """An exception's message on one line (lines joined by '; ', or ' ' after a ':')."""
  text = ""
  for line in (s.strip() for s in str(e).splitlines()):
    if line:
      text += line if not text else (" " if text.endswith(":") else "; ") + line
  return text or type(e).__name__


def _anticipated_classes() -> tuple[type, ...]:
  out = []
  for name in ANTICIPATED:
    module, _, cls = name.rpartition(".")
    c = getattr(sys.modules.get(module), cls, None)
    if isinstance(c, type):
      out.append(c)
  return tuple(out)


def _storage_package(e: BaseException) -> str | None:
  """'orbax' / 'tensorstore' when `e` is their error (their class, or raised in their code)."""
  if isinstance(e, _BUG_TYPES):
    return None
  top = type(e).__module__.split(".")[0]
  if top in STORAGE_PACKAGES:
    return top
  tb = e.__traceback__
  while tb is not None and tb.tb_next is not None:
    tb = tb.tb_next
  path = tb.tb_frame.f_code.co_filename.replace("\\", "/") if tb is not None else ""
  return next((pkg for pkg in STORAGE_PACKAGES if f"/{pkg}/" in path), None)


def error_message(e: BaseException) -> str | None:
  """The one line a command prints for `e`, or None when `e` is unexpected (keep its traceback)."""
  if isinstance(e, _anticipated_classes()):
    return one_line(e)
  pkg = _storage_package(e)
  if pkg is not None:
    text = one_line(e)
    if len(text) > _MAX_STORAGE_CHARS:
      text = text[:_MAX_STORAGE_CHARS] + " ..."
    return f"checkpoint storage ({pkg}): {type(e).__name__}: {text}"
  return None


def run_main(main: Callable[..., Any], *args: Any) -> int:
  """`main(*args)` as a command: an anticipated error (`error_message`) is one line `error: ...` on
  stderr and exit status 2; any other exception keeps its traceback. Returns main's int status, 0 for
  anything else it returns: `sys.exit(cli_common.run_main(main))`."""
  try:
    result = main(*args)
  except Exception as e:
    message = error_message(e)
    if message is None:
      raise
    sys.stdout.flush()
    print(f"error: {message}", file=sys.stderr)
    return 2
  return result if isinstance(result, int) and not isinstance(result, bool) else 0


def exit_process(status: int, grace_s: float = 10.0) -> NoReturn:
  """`sys.exit(status)`, except that after a failure (status != 0) threads a failed library call left
  blocked do not keep the process alive: Orbax's save threads wait forever once an async save has
  failed (e.g. WORKDIR/checkpoints is a file), and the interpreter waits for them at exit. They get
  `grace_s` seconds; then the process exits with `status` without them."""
  if status:
    deadline = time.monotonic() + grace_s
    others = [t for t in threading.enumerate() if t is not threading.current_thread() and not t.daemon]
    for t in others:
      try:
        t.join(max(0.0, deadline - time.monotonic()))
      except Exception:  # noqa: BLE001 - Orbax's threads raise TimeoutError from join(timeout)
        pass
    if any(t.is_alive() for t in others):
      logging.shutdown()
      sys.stdout.flush()
      sys.stderr.flush()
      os._exit(status)
  sys.exit(status)


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
  dirs = [REPO / "configs", pathlib.Path(__file__).resolve().parent / "configs"]
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


def load_config_file(path: str | pathlib.Path) -> ml_collections.ConfigDict:
  """`get_config()` of an experiment file (`find_config_file`), or the config.json of a workdir
  (a training run, or one `tformer-convert --from-hf` wrote)."""
  if pathlib.Path(path).is_dir() and (pathlib.Path(path) / "config.json").is_file():
    return workdir_config(path)
  return _load(find_config_file(path))


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
  try:
    for key in overrides:
      check_field_path(out, key)
  except ConfigError as e:
    raise UsageError(str(e)) from None
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
  """The config file (or a run's config.json) with overrides, as a command line would give it (train.init_from
  resolved: `resolve_source`)."""
  if path:
    cfg = load_config_file(path)
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


_SECTION_CLASSES = {"ModelConfig": "model.", "RopeScaling": "model.rope_scaling.", "MoEConfig": "model.moe."}
_FIELD = re.compile(r"^\s+(\w+)(?:\s*:\s*[^=]+)?\s*=")
_SECTION = re.compile(r"^\s+c\.(\w+)\s*=\s*ml_collections\.ConfigDict")


_NESTED = re.compile(r"^\s+(\w+)\s*=\s*ml_collections\.ConfigDict")


def _nested(lines: list[str], row: int) -> str:
  """'lora.' for a field inside `lora=ml_collections.ConfigDict(dict(...))` within a section, else ''."""
  indent = len(lines[row - 1]) - len(lines[row - 1].lstrip())
  for back in range(row - 2, -1, -1):
    above = lines[back]
    if above.strip() and not above.strip().startswith("#") and len(above) - len(above.lstrip()) < indent:
      m = _NESTED.match(above)
      return m.group(1) + "." if m else ""
  return ""


def field_docs() -> dict[str, str]:
  """{'model.num_kv_heads': '0 = num_heads (MHA); 1 = MQA; ...', ...}: the comments beside the fields in
  tformer_jax/config.py (the dataclasses and default_config), a comment-only line continuing the
  field above it; an enum field's values are listed from its tuple (`enum_fields`). The schema's one
  source of descriptions."""
  source = inspect.getsource(config_lib)
  docs: dict[str, str] = {}
  prefix, last, last_line = None, None, -1
  lines = source.splitlines()
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    if tok.type != tokenize.COMMENT:
      continue
    row = tok.start[0]
    text = tok.string.lstrip("#").strip()
    line = lines[row - 1]
    if line.strip().startswith("#"):
      if last is not None and row == last_line + 1:
        docs[last] += " " + text
        last_line = row
      continue
    m = _FIELD.match(line)
    # the section a field belongs to: the nearest class or `c.<name> = ConfigDict` above it
    for back in range(row - 1, -1, -1):
      above = lines[back]
      cls = re.match(r"^class (\w+)", above)
      sec = _SECTION.match(above)
      if cls or sec or above.startswith("def "):
        prefix = _SECTION_CLASSES.get(cls.group(1)) if cls else (sec.group(1) + "." if sec else None)
        break
    if m and prefix:
      last, last_line = prefix + _nested(lines, row) + m.group(1), row
      docs[last] = text
    else:
      last = None
  for key, allowed in enum_fields().items():
    docs[key] = enum_doc(docs.get(key, ""), allowed)
  return docs


def enum_fields() -> dict[str, tuple[str, ...]]:
  """{field: its allowed values}: the config's own tuples (config.py), which `field_docs` lists."""
  c = config_lib
  model = dict(attention=c.ATTENTIONS, activation=c.ACTIVATIONS, norm=c.NORMS, norm_position=c.NORM_POSITIONS,
               position=c.POSITIONS, rope_layout=c.ROPE_LAYOUTS, remat=c.REMAT_POLICIES, dtype=c.DTYPES,
               param_dtype=c.DTYPES, **{"rope_scaling.type": c.ROPE_SCALINGS, "moe.dispatch": c.MOE_DISPATCH})
  other = {"data.sampling": c.SAMPLINGS, "data.packing": c.PACKINGS, "optim.name": c.OPTIMIZERS,
           "optim.schedule": c.SCHEDULES, "train.precision": c.PRECISIONS, "mesh.parallelism": c.PARALLELISMS,
           "mesh.context_strategy": c.CONTEXT_STRATEGIES, "runtime.backend": c.RUNTIME_BACKENDS,
           "runtime.attention": c.RUNTIME_ATTENTION, "runtime.cpu_kernels": c.AUTO_ON_OFF,
           "runtime.decode_layout": c.DECODE_LAYOUTS, "runtime.moe_exchange": c.RUNTIME_MOE_EXCHANGE,
           "runtime.moe_gmm": c.RUNTIME_MOE_GMM}
  return {**{f"model.{k}": v for k, v in model.items()}, **other}


_OPTION = re.compile(r"\s*([\w.+-]+)(?:\s*\(((?:[^()]|\([^()]*\))*)\))?")


def enum_doc(comment: str, allowed: Sequence[str]) -> str:
  """A field's description with its values listed from `allowed` (so it cannot name a value that does
  not exist): a leading 'a (note) | b | c' in the comment gives the notes, the rest is kept."""
  options, pos = [], 0
  while (m := _OPTION.match(comment, pos)) is not None:
    options.append((m.group(1), m.group(2)))
    pos = m.end()
    if not comment[pos:].lstrip().startswith("|"):
      break
    pos = comment.index("|", pos) + 1
  if len(options) < 2:                      # no list in the comment: the values, then the comment
    return " | ".join(allowed) + (f": {comment}" if comment else "")
  notes = {name: note for name, note in options if note}
  head = " | ".join(f"{v} ({notes[v]})" if v in notes else v for v in allowed)
  return head + comment[pos:]


def describe_config(cfg: ml_collections.ConfigDict) -> str:
  """Every field of `cfg` with its value and its description (`field_docs`), one line each."""
  docs = field_docs()
  rows: list[tuple[str, str]] = []

  def walk(node: Any, prefix: str) -> None:
    for key in sorted(node.keys()) if prefix else list(node.keys()):
      value = node[key]
      if isinstance(value, ml_collections.ConfigDict):
        walk(value, f"{prefix}{key}.")
      else:
        rows.append((f"{prefix}{key}", repr(value)))

  walk(cfg, "")
  width = min(max(len(f"{k} = {v}") for k, v in rows), 60)
  out = []
  for key, value in rows:
    text = f"{key} = {value}"
    doc = docs.get(key, "")
    out.append(f"{text:<{width}}  # {doc}" if doc else text)
  return "\n".join(out)


def _one_line(e: BaseException) -> str:
  while isinstance(e, (AttributeError, KeyError)) and e.args and isinstance(e.args[0], BaseException):
    e = e.args[0]                 # config_flags: AttributeError(KeyError("'x'\nDid you mean ..."))
  if isinstance(e, KeyError):     # (check_overrides reports unknown fields first, with their path)
    text = (str(e.args[0]) if e.args else "?").replace("Did you", "did you")
    return "unknown config field " + "; ".join(s.strip() for s in text.splitlines() if s.strip())
  return one_line(e)


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
  return _one_line(e)


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


def fail(message: str) -> None:
  """A usage error: one line `error: message` on stderr, exit status 2."""
  print(f"error: {message}", file=sys.stderr)
  raise SystemExit(2)


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
    cfg, from_run = load_config_file(fv.config), pathlib.Path(fv.config).is_dir() and not hf_dir
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
  if host_alloc.idle_libtpu():
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
    args.config, args.overrides, positional = _apply(cfg, [prog] + rest[1:], lock=True)
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
