#!/usr/bin/env python
"""Train a transformer LM: python scripts/train.py --config=configs/shakespeare_char.py --workdir=runs/x

Override any field: --config.model.num_layers=4 --config.optim.peak_lr=1e-3. Resumes from the latest
checkpoint in --workdir. SIGTERM/SIGINT save and exit 0.
"""
from tformer_jax.train.cli import main

if __name__ == "__main__":
  main()
