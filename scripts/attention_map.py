#!/usr/bin/env python
"""`python scripts/attention_map.py` = `tformer-attention-map` (tformer_jax/cli/attention_map.py; --help)."""
from tformer_jax.cli.attention_map import *  # noqa: F403 (the command's functions, for tests and notebooks)
from tformer_jax.cli.attention_map import entry

if __name__ == "__main__":
  entry()
