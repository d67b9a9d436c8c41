"""Faults injected into tformer-prepare for the tests: a crash (or a signal) right after the N-th shard a run
commits, and spawned workers that are up before the first unit.

  python tests/prepare_faults.py --kill-after=N [--signal=KILL|STOP|INT] -- <tformer-prepare flags>

runs the command with the fault installed. SIGKILL is sent to the process itself, as a crash; any other
signal to its process group, as a terminal's Ctrl-C is.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import logging
import os
import signal
import sys

from tformer_jax.data.prepared import workers, writer

log = logging.getLogger("tformer_jax.data.prepared")


def kill_after(shards: int, name: str = "KILL") -> None:
  """Signal SIG`name` once the writer has committed `shards` shards in this run."""
  close = writer.ShardWriter.close
  state = {"armed": True}

  def close_then_signal(self, next_position):
    close(self, next_position)
    if state["armed"] and self.committed_this_run >= shards:
      log.warning("SIG%s after %d shards (test hook)", name, self.committed_this_run)
      if name == "KILL":
        os.kill(os.getpid(), signal.SIGKILL)
      state["armed"] = False
      os.killpg(os.getpgrp(), getattr(signal, "SIG" + name))

  writer.ShardWriter.close = close_then_signal


def wait_for_workers(monkeypatch) -> None:
  """The pool's spawned processes are up before it takes the first unit (so a small input reaches them)."""
  init = workers.Pool.__init__

  def init_then_wait(self, n):
    init(self, n)
    concurrent.futures.wait(self._starting)

  monkeypatch.setattr(workers.Pool, "__init__", init_then_wait)


def main() -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--kill-after", type=int, required=True)
  p.add_argument("--signal", default="KILL")
  args, rest = p.parse_known_args()
  kill_after(args.kill_after, args.signal.upper())
  from tformer_jax.cli import prepare  # noqa: PLC0415 (after the fault is installed)
  return prepare.main([a for a in rest if a != "--"])


if __name__ == "__main__":
  sys.exit(main())
