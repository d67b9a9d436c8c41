#!/usr/bin/env python
"""`python scripts/aot.py` = `tformer-aot` (tformer_jax/cli/aot.py; --help)."""
from tformer_jax.cli.aot import *  # noqa: F403 (the command's functions, for tests and notebooks)
from tformer_jax.cli.aot import entry

if __name__ == "__main__":
  entry()
