#!/usr/bin/env python
"""`python scripts/extrapolate.py` = `tformer-extrapolate` (tformer_jax/cli/extrapolate.py; --help)."""
from tformer_jax.cli.extrapolate import *  # noqa: F403 (the command's functions, for tests and notebooks)
from tformer_jax.cli.extrapolate import entry

if __name__ == "__main__":
  entry()
