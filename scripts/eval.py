#!/usr/bin/env python
"""`python scripts/eval.py` = `tformer-eval` (tformer_jax/cli/eval.py; --help)."""
from tformer_jax.cli.eval import *  # noqa: F403 (the command's functions, for tests and notebooks)
from tformer_jax.cli.eval import entry

if __name__ == "__main__":
  entry()
