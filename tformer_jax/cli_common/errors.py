"""What a command does with an exception: the errors a user can cause (`ANTICIPATED`, checkpoint storage)
are one line `error: ...` on stderr and exit status 2 (`run_main`, `fail`); anything else keeps its traceback."""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Any, Callable, NoReturn

# The errors a user can cause, by name: `run_main` prints them as one line and exits 2. Named, not
# imported, because most live in modules that import jax, which a command may never load (and then
# cannot raise). Subclasses count (WorkdirBusy is a ConfigError).
ANTICIPATED = (
    "tformer_jax.config.ConfigError",                   # a config rule; bad distributed settings
    "tformer_jax.cli_common.errors.UsageError",         # the command line
    "tformer_jax.data.corpora.DataError",               # corpora, tokenizers, the pipeline
    "tformer_jax.checkpoint.CheckpointError",           # missing, unreadable or mismatched checkpoints
    "tformer_jax.interop.families.fields.HFConfigError",  # an architecture HF cannot hold, or we cannot
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
  """`sys.exit(status)`, except that threads left running do not keep the process alive: Orbax's save threads
  wait forever once an async save has failed (e.g. WORKDIR/checkpoints is a file), and the interpreter waits for
  every non-daemon thread at exit. After its work (any status) the command's other threads get `grace_s`
  seconds; then the process exits with `status` without them. A successful command that had to leave some
  says so in one log line naming them (a failed one has already printed its one error line)."""
  deadline = time.monotonic() + grace_s
  others = [t for t in threading.enumerate() if t is not threading.current_thread() and not t.daemon]
  for t in others:
    try:
      t.join(max(0.0, deadline - time.monotonic()))
    except Exception:  # noqa: BLE001 - Orbax's threads raise TimeoutError from join(timeout)
      pass
  alive = [t.name for t in others if t.is_alive()]
  if alive:
    if not status:
      logging.getLogger("tformer_jax").warning("exit: %d thread(s) still running %.0f s after the work ended, "
                                               "exiting without them: %s", len(alive), grace_s, ", ".join(alive))
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
  sys.exit(status)


def setup_logging(level: int = logging.INFO, fmt: str = "%(asctime)s %(levelname)s %(name)s: %(message)s") -> None:
  """The command's logging, set by the command whatever was imported before: the root logger at `level` with
  one stderr handler in `fmt`. A plain StreamHandler already there (the WARNING one orbax's import leaves
  while train.init_from is resolved: basicConfig alone then did nothing, and a fine-tuning run printed none
  of its INFO lines) is replaced; other handlers (a test's log capture, a file) are kept."""
  root = logging.getLogger()
  for h in [h for h in root.handlers if type(h) in (logging.StreamHandler, _Stderr)]:
    root.removeHandler(h)
  handler = _Stderr()
  handler.setFormatter(logging.Formatter(fmt))
  root.addHandler(handler)
  root.setLevel(level)


class _Stderr(logging.StreamHandler):
  """A handler writing to sys.stderr as it is at each record (a command run in-process by a test whose
  captured stderr has since closed writes to the current one)."""

  def __init__(self):
    super().__init__()

  @property
  def stream(self):
    return sys.stderr

  @stream.setter
  def stream(self, value):
    pass


def fail(message: str) -> None:
  """A usage error: one line `error: message` on stderr, exit status 2."""
  print(f"error: {message}", file=sys.stderr)
  raise SystemExit(2)


def flag_error_line(e: BaseException) -> str:
  """One line for an absl / config_flags error (an unknown config field: its name and the closest ones)."""
  while isinstance(e, (AttributeError, KeyError)) and e.args and isinstance(e.args[0], BaseException):
    e = e.args[0]                 # config_flags: AttributeError(KeyError("'x'\nDid you mean ..."))
  if isinstance(e, KeyError):     # (check_overrides reports unknown fields first, with their path)
    text = (str(e.args[0]) if e.args else "?").replace("Did you", "did you")
    return "unknown config field " + "; ".join(s.strip() for s in text.splitlines() if s.strip())
  return one_line(e)

