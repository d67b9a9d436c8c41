#!/usr/bin/env python
"""Run a multi-process (multi-host style) job on this machine, on CPU devices.

  tformer-launch-local --processes 2 --devices-per-process 2 -- \\
      --config=shakespeare_char --workdir=runs/mp --config.mesh.rules=fsdp

starts N copies of tformer-train (or --script) that join one jax.distributed run over
127.0.0.1:PORT (a free port unless --port), each with D fake CPU devices. Their output is streamed
with a [pN] prefix. If any process fails, the others are stopped (SIGTERM, then SIGKILL after
--grace seconds) and the launcher exits with the failing process's status; SIGINT/SIGTERM to the
launcher are forwarded to every process (train.py then saves a checkpoint and exits 0).
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from absl import flags

from tformer_jax import cli_common


def free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def worker_env(process_id: int, processes: int, port: int, devices: int,
               base: dict[str, str] | None = None) -> dict[str, str]:
  """The environment of process `process_id`: coordinator, ids, D CPU devices."""
  env = dict(os.environ if base is None else base)
  flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", "")).strip()
  env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
  env.setdefault("JAX_PLATFORMS", "cpu")
  env["PYTHONUNBUFFERED"] = "1"
  env["TFORMER_COORDINATOR"] = f"127.0.0.1:{port}"
  env["TFORMER_NUM_PROCESSES"] = str(processes)
  env["TFORMER_PROCESS_ID"] = str(process_id)
  return env


def worker_cmd(script: str | None, args: list[str]) -> list[str]:
  """A worker's command line: `script` (a path) or, by default, tformer-train (`-m tformer_jax.cli.train`)."""
  program = [script] if script else ["-m", "tformer_jax.cli.train"]
  return [sys.executable, *program, "--distributed", *args]


def _stream(tag: str, pipe, out) -> None:
  for line in iter(pipe.readline, ""):
    out.write(f"[{tag}] {line if line.endswith(chr(10)) else line + chr(10)}")
    out.flush()
  pipe.close()


def _stop(procs: list[subprocess.Popen], grace: float) -> None:
  for p in procs:
    if p.poll() is None:
      p.send_signal(signal.SIGTERM)
  deadline = time.monotonic() + grace
  for p in procs:
    try:
      p.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      p.kill()
      p.wait()


def _status(code: int) -> int:
  return 128 - code if code < 0 else code  # killed by signal N -> 128 + N, like a shell


def launch(processes: int, devices: int, port: int, args: list[str], script: str, grace: float) -> int:
  procs: list[subprocess.Popen] = []
  threads = []
  for i in range(processes):
    p = subprocess.Popen(worker_cmd(script, args), env=worker_env(i, processes, port, devices),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                         start_new_session=True)
    procs.append(p)
    t = threading.Thread(target=_stream, args=(f"p{i}", p.stdout, sys.stdout), daemon=True)
    t.start()
    threads.append(t)
  forwarded = {"signal": None}

  def forward(signum, _frame):
    forwarded["signal"] = signum
    for p in procs:
      if p.poll() is None:
        p.send_signal(signum)

  for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, forward)
  code = 0
  while True:
    codes = [p.poll() for p in procs]
    failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
    if failed:
      i, c = failed[0]
      print(f"[launch] process {i} exited with status {_status(c)}; stopping the others", file=sys.stderr,
            flush=True)
      _stop(procs, grace)
      code = _status(c)
      break
    if all(c == 0 for c in codes):
      break
    time.sleep(0.1)
  for t in threads:
    t.join(timeout=5)
  return code


def define_flags(fv: flags.FlagValues) -> None:
  flags.DEFINE_integer("processes", None, "number of processes (N; required)", flag_values=fv)
  flags.DEFINE_integer("devices-per-process", 1, "fake CPU devices each (D)", flag_values=fv)
  flags.DEFINE_integer("port", 0, "coordinator port on 127.0.0.1 (0 = a free one)", flag_values=fv)
  flags.DEFINE_string("script", None, "the program to run (default: tformer-train)", flag_values=fv)
  flags.DEFINE_float("grace", 10.0, "seconds between SIGTERM and SIGKILL", flag_values=fv)


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  ours, rest = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
  a = cli_common.parse(ours, define_flags, doc=__doc__, prog="tformer-launch-local")
  if a.processes is None:
    cli_common.fail("pass --processes=N")
  if a.processes < 1 or a.devices_per_process < 1:
    cli_common.fail("--processes and --devices-per-process must be >= 1")
  return launch(a.processes, a.devices_per_process, a.port or free_port(), rest, a.script, a.grace)



def entry() -> None:
  """The `tformer-launch-local` console command."""
  sys.exit(main())


if __name__ == "__main__":
  entry()
