#!/usr/bin/env python
"""`python scripts/serve.py` = `tformer-serve` (tformer_jax/cli/serve.py; --help)."""
from tformer_jax.cli.serve import *  # noqa: F403 (the command's functions, for tests and notebooks)
from tformer_jax.cli.serve import entry

if __name__ == "__main__":
  entry()
