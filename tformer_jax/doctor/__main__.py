"""`python -m tformer_jax.doctor` = `tformer-doctor` (tformer_jax/doctor/command.py)."""
from tformer_jax.doctor.command import entry

if __name__ == "__main__":
  entry()
