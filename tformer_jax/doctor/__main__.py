"""`python -m tformer_jax.doctor` = `tformer-doctor` (tformer_jax/cli/doctor.py)."""
from tformer_jax.cli.doctor import entry

if __name__ == "__main__":
  entry()
