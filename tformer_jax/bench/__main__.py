"""`python -m tformer_jax.bench ...` = `tformer-bench ...` (tformer_jax/bench/command.py)."""
from tformer_jax.bench.command import entry

if __name__ == "__main__":
  entry()
