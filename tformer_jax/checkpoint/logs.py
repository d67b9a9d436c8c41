"""Orbax/TensorStore noise kept off the console: the debug log (WORKDIR/debug.log), the one-line error text,
and the log filter/unraisable hook a Checkpointer installs while in use."""
from __future__ import annotations

import datetime
import logging
import os
import re
import sys
import traceback
from typing import Any, Callable

import jax
from etils import epath

from tformer_jax.checkpoint.common import CHECKPOINT_DIR, _is_local

DEBUG_LOG = "debug.log"
_MAX_ERROR_CHARS = 300   # of an Orbax/TensorStore error quoted in a one-line message
_LIBRARY_DIRS = (f"{os.sep}orbax{os.sep}", f"{os.sep}tensorstore{os.sep}")
# asyncio's "Future exception was never retrieved" for a failed TensorStore write/read (at exit)
_LIBRARY_TEXT = re.compile(r"orbax|tensorstore|OCDBT", re.IGNORECASE)


def _short(e: BaseException, limit: int = _MAX_ERROR_CHARS) -> str:
  """`Type: message` on one line, without TensorStore's spec dumps; an OS error's reason first."""
  raw = str(e)
  text = raw.split("See full TensorStore details")[0]
  text = re.sub(r"\s*\[tensorstore_spec=.*", "", text, flags=re.S)
  text = " ".join(text.split()).rstrip(".")
  msg = f"{type(e).__name__}: {text}" if text else type(e).__name__
  code = re.search(r"os_error_code='(\d+)'", raw)
  if code:
    msg = f"{os.strerror(int(code.group(1)))} ({msg})"
  elif isinstance(e, OSError) and e.strerror:
    msg = e.strerror + (f": {os.fspath(e.filename)}" if e.filename else "")
  return msg if len(msg) <= limit else msg[:limit] + " ..."


# -- the debug log: library tracebacks and noise, kept off the console ----------------------------

def _debug_log_path(directory: epath.Path) -> epath.Path:
  """WORKDIR/debug.log for WORKDIR/checkpoints; `<directory>/debug.log` otherwise."""
  return directory.parent / DEBUG_LOG if directory.name == CHECKPOINT_DIR else directory / DEBUG_LOG


def _append_debug(path: epath.Path | None, text: str) -> bool:
  """Append `text` to the debug log; False if there is none or it cannot be written."""
  if path is None or not _is_local(path):
    return False
  stamp = datetime.datetime.now().isoformat(sep=" ", timespec="milliseconds")
  try:
    with open(os.fspath(path), "a") as f:
      f.write(f"--- {stamp} [process {jax.process_index()}, pid {os.getpid()}] {text.rstrip()}\n")
  except OSError:
    return False
  return True


def _format_exc(e: BaseException) -> str:
  return "".join(traceback.format_exception(type(e), e, e.__traceback__))


def _tb_in_library(tb: Any) -> bool:
  while tb is not None:
    if any(d in tb.tb_frame.f_code.co_filename for d in _LIBRARY_DIRS):
      return True
    tb = tb.tb_next
  return False


class _LibraryNoise(logging.Filter):
  """Sends Orbax/TensorStore WARNING+ log records (tracebacks from their background threads, failed
  reads, asyncio's reports of their futures' unretrieved errors) and the "Event loop is closed"
  unraisable errors that a failed TensorStore read leaves behind to the debug log of the latest
  Checkpointer, instead of the console. Records it cannot write there pass through unchanged; every
  other record and unraisable error is untouched."""

  def __init__(self) -> None:
    super().__init__()
    self.path: epath.Path | None = None
    self._previous_hook: Callable[[Any], Any] | None = None

  def attach(self, path: epath.Path) -> None:
    self.path = path
    for name in ("absl", "asyncio"):
      logger = logging.getLogger(name)
      if self not in logger.filters:
        logger.addFilter(self)
    if sys.unraisablehook != self._unraisable:   # (re)install: pytest swaps the hook per test
      self._previous_hook = sys.unraisablehook
      sys.unraisablehook = self._unraisable

  def filter(self, record: logging.LogRecord) -> bool:
    if self.path is None or record.levelno < logging.WARNING:
      return True
    exc = record.exc_info[1] if record.exc_info else None
    if not (any(d in record.pathname for d in _LIBRARY_DIRS)
            or (exc is not None and _tb_in_library(exc.__traceback__))
            or (record.name == "asyncio" and _LIBRARY_TEXT.search(f"{record.getMessage()} {exc}"))):
      return True
    text = f"{record.levelname} {record.name}: {record.getMessage()}"
    if exc is not None:
      text += "\n" + _format_exc(exc)
    return not _append_debug(self.path, text)

  def _unraisable(self, unraisable: Any) -> None:
    exc = unraisable.exc_value
    noise = ((isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed")
             or _tb_in_library(unraisable.exc_traceback)
             or "orbax" in repr(getattr(unraisable, "object", None)))
    if noise and exc is not None and _append_debug(self.path, "unraisable (ignored): " + _format_exc(exc)):
      return
    (self._previous_hook or sys.__unraisablehook__)(unraisable)


_NOISE = _LibraryNoise()
