#!/usr/bin/env python
"""`python scripts/ablate.py` = `tformer-ablate` (tformer_jax/cli/ablate.py; --help)."""
from tformer_jax.cli.ablate import *  # noqa: F403 (the command's functions, for tests and notebooks)
from tformer_jax.cli.ablate import entry

if __name__ == "__main__":
  entry()
