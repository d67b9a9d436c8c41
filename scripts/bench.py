#!/usr/bin/env python
"""`python scripts/bench.py` = `tformer-bench` (tformer_jax/cli/bench.py; --help)."""
from tformer_jax.cli.bench import *  # noqa: F403 (the command's functions, for tests and notebooks)
from tformer_jax.cli.bench import entry

if __name__ == "__main__":
  entry()
