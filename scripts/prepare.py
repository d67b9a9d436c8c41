#!/usr/bin/env python
"""`python scripts/prepare.py` = `tformer-prepare` (tformer_jax/cli/prepare.py; --help)."""
from tformer_jax.cli.prepare import *  # noqa: F403 (the command's functions, for tests and notebooks)
from tformer_jax.cli.prepare import entry

if __name__ == "__main__":
  entry()
