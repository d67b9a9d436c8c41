#!/usr/bin/env python
"""`python scripts/train.py` = `tformer-train` (tformer_jax/cli/train.py; --help)."""
from tformer_jax.cli.train import *  # noqa: F403 (the command's functions, for tests and notebooks)
from tformer_jax.cli.train import entry

if __name__ == "__main__":
  entry()
