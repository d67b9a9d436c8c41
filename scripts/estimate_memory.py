#!/usr/bin/env python
"""`python scripts/estimate_memory.py` = `tformer-estimate` (tformer_jax/cli/estimate_memory.py; --help)."""
from tformer_jax.cli.estimate_memory import *  # noqa: F403 (the command's functions, for tests and notebooks)
from tformer_jax.cli.estimate_memory import entry

if __name__ == "__main__":
  entry()
