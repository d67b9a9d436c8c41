"""`tformer-doctor --config=NAME [--workdir=RUN]`: the troubleshooting checklists run on a config
(tformer_jax/doctor/command.py, also `python -m tformer_jax.doctor`); `--help` for its flags."""
from tformer_jax.doctor.command import define_flags, entry, main  # noqa: F401 (the command's names)

if __name__ == "__main__":
  entry()
