#!/usr/bin/env python
"""`python scripts/convert.py` = `tformer-convert` (tformer_jax/cli/convert.py; --help)."""
from tformer_jax.cli.convert import *  # noqa: F403 (the command's functions, for tests and notebooks)
from tformer_jax.cli.convert import entry

if __name__ == "__main__":
  entry()
