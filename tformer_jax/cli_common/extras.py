"""The optional extras a command needs (pyproject.toml's [project.optional-dependencies]): a missing one is one
line naming the extra and the pip command, before anything loads.

    cli_common.require_extra("tformer-serve", "serve")
    # error: tformer-serve needs the 'serve' extra: pip install 'tformer-jax[serve]' (aiohttp is not installed)
"""
from __future__ import annotations

import importlib.util

from tformer_jax.cli_common.errors import fail

# extra -> the modules it installs that the commands import (the first missing one is named)
EXTRAS = {
    "serve": ("aiohttp",),
    "eval": ("lm_eval",),
    "tpu-aot": ("libtpu",),
    "trackers": ("wandb",),
    "reference": ("torch", "transformers"),
    "gguf": ("gguf",),
}


def missing_module(extra: str) -> str | None:
  """The first module of `extra` that cannot be imported (a module hidden as sys.modules[name] = None counts
  as missing), else None."""
  for name in EXTRAS[extra]:
    try:
      if importlib.util.find_spec(name) is None:
        return name
    except (ImportError, ValueError):           # a parent package missing, or a module without a spec
      return name
  return None


def extra_message(what: str, extra: str, module: str) -> str:
  return f"{what} needs the '{extra}' extra: pip install 'tformer-jax[{extra}]' ({module} is not installed)"


def require_extra(what: str, extra: str) -> None:
  """`what` (a command, or a command and its flag) cannot run without `extra`: one line `error: ...`, exit 2."""
  module = missing_module(extra)
  if module is not None:
    fail(extra_message(what, extra, module))
