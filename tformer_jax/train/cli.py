"""`python scripts/train.py --config=configs/X.py --workdir=runs/x [--config.a.b=v ...]`."""
from __future__ import annotations

import logging
import sys

from absl import app, flags
from ml_collections import config_flags

from tformer_jax.config import ConfigError
from tformer_jax.host_alloc import maybe_reexec

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment file with get_config(); override fields with --config.x.y=v.",
    lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory: checkpoints, metrics, config.json.")
_DIST = flags.DEFINE_bool("distributed", False, "Call jax.distributed.initialize (multi-host).")
_COORD = flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (multi-host).")
_NPROC = flags.DEFINE_integer("num_processes", None, "Total processes (multi-host).")
_PID = flags.DEFINE_integer("process_id", None, "This process's id (multi-host).")


def _main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
  logging.getLogger("absl").setLevel(logging.WARNING)
  if _DIST.value or _COORD.value:
    from tformer_jax.parallel.distributed import initialize  # noqa: PLC0415 (jax: only after maybe_reexec)
    initialize(_COORD.value, _NPROC.value, _PID.value)
  from tformer_jax.train.loop import TrainingError, train  # noqa: PLC0415 (jax: only after maybe_reexec)
  try:
    train(_CONFIG.value, _WORKDIR.value)
  except (ConfigError, TrainingError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  except Exception as e:  # data errors etc.: one clear line, not a traceback
    from tformer_jax.data.corpora import DataError  # noqa: PLC0415 (tformer_jax.data: grain + jax, only after maybe_reexec)
    if isinstance(e, DataError):
      print(f"error: {e}", file=sys.stderr)
      sys.exit(2)
    raise


def main():
  maybe_reexec()  # tcmalloc / hugetlb: see tformer_jax/host_alloc.py
  flags.mark_flags_as_required(["config", "workdir"])
  app.run(_main)


if __name__ == "__main__":
  main()
