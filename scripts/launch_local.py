#!/usr/bin/env python
"""`python scripts/launch_local.py` = `tformer-launch-local` (tformer_jax/cli/launch_local.py; --help)."""
from tformer_jax.cli.launch_local import *  # noqa: F403 (the command's functions, for tests and notebooks)
from tformer_jax.cli.launch_local import entry

if __name__ == "__main__":
  entry()
