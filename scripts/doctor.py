#!/usr/bin/env python
"""`python scripts/doctor.py` = `tformer-doctor` (tformer_jax/cli/doctor.py; --help)."""
from tformer_jax.cli.doctor import *  # noqa: F403 (the command's functions, for tests and notebooks)
from tformer_jax.cli.doctor import entry

if __name__ == "__main__":
  entry()
