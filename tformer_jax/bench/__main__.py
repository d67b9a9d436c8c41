"""`python -m tformer_jax.bench ...` = `tformer-bench ...` (tformer_jax/cli/bench.py)."""
from tformer_jax.cli.bench import entry

if __name__ == "__main__":
  entry()
