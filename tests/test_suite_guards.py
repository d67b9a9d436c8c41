"""The suite's own guards, as CI runs them (scripts/test.sh): a worker that crashes ends the run at once, failed,
and a stuck test is ended by pytest-timeout instead of holding CI to its limit.

Each case runs pytest in a subprocess on a two-file suite written to a temporary folder (no jax imported there)
with scripts/test.sh's xdist flags, and asserts the exit status and the time it took.
"""
import pathlib
import subprocess
import sys
import time

import pytest

pytest.importorskip("xdist")
pytest.importorskip("pytest_timeout")

XDIST = ["-n", "2", "--dist", "loadfile", "--no-loadscope-reorder", "--max-worker-restart=0", "-p", "no:cacheprovider"]
# A file of slow tests beside the faulty one (4 s in all). After a crash xdist schedules nothing new; the other
# worker ends the file it holds, and the run ends failed.
SLOW = "import time\n\n" + "".join(f"def test_slow_{i}():\n  time.sleep(1)\n\n\n" for i in range(4))


def _suite(tmp_path: pathlib.Path, faulty: str, *args: str) -> tuple[int, float, str]:
  (tmp_path / "test_a_faulty.py").write_text(faulty)
  (tmp_path / "test_b_slow.py").write_text(SLOW)
  (tmp_path / "pytest.ini").write_text("[pytest]\n")
  t0 = time.monotonic()
  r = subprocess.run([sys.executable, "-m", "pytest", *XDIST, *args, str(tmp_path)], cwd=tmp_path,
                     capture_output=True, text=True, timeout=120)
  return r.returncode, time.monotonic() - t0, r.stdout + r.stderr


def test_a_crashed_worker_fails_the_run_quickly(tmp_path):
  crash = "import os, signal\n\n\ndef test_crash():\n  os.kill(os.getpid(), signal.SIGSEGV)\n"
  code, took, out = _suite(tmp_path, crash)
  assert code != 0, out[-2000:]
  assert "crashed while running 'test_a_faulty.py::test_crash'" in out, out[-2000:]
  assert took < 30, f"the run went on for {took:.0f} s after a worker crashed"


def test_a_stuck_test_is_ended_by_the_timeout(tmp_path):
  stuck = "import threading\n\n\ndef test_stuck():\n  threading.Event().wait()\n"
  code, took, out = _suite(tmp_path, stuck, "--timeout=2", "--timeout-method=thread")
  assert code != 0, out[-2000:]
  assert "crashed while running 'test_a_faulty.py::test_stuck'" in out, out[-2000:]   # the timeout ended it
  assert took < 30, f"a stuck test held the run for {took:.0f} s"
