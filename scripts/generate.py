#!/usr/bin/env python
"""`python scripts/generate.py` = `tformer-generate` (tformer_jax/cli/generate.py; --help)."""
from tformer_jax.cli.generate import *  # noqa: F403 (the command's functions, for tests and notebooks)
from tformer_jax.cli.generate import entry

if __name__ == "__main__":
  entry()
