"""Multi-host start-up: `initialize()` wraps `jax.distributed.initialize` with bounded timeouts.

Where the settings come from, first match wins:
  1. arguments (scripts/train.py --coordinator_address=host:port --num_processes=N --process_id=i)
  2. environment: TFORMER_COORDINATOR, TFORMER_NUM_PROCESSES, TFORMER_PROCESS_ID
     (what scripts/launch_local.py sets)
  3. nothing: jax auto-detects the cluster (SLURM, Open MPI, Cloud TPU pods)

Failure detection: every process sends heartbeats to the coordinator; when a process dies, the
others stop within about TFORMER_HEARTBEAT_TIMEOUT seconds (default 60) with an error, instead of
waiting forever in a collective. TFORMER_INIT_TIMEOUT (default 300) bounds the wait for all
processes to connect; TFORMER_SHUTDOWN_TIMEOUT (default 60) bounds the exit barrier.
Must be called before anything else touches jax (devices, arrays, compilation).
"""
from __future__ import annotations

import inspect
import logging
import os
import socket
import time

import jax

from tformer_jax.config import ConfigError

log = logging.getLogger("tformer_jax")

ENV_COORDINATOR = "TFORMER_COORDINATOR"
ENV_NUM_PROCESSES = "TFORMER_NUM_PROCESSES"
ENV_PROCESS_ID = "TFORMER_PROCESS_ID"
ENV_HEARTBEAT = "TFORMER_HEARTBEAT_TIMEOUT"
ENV_INIT = "TFORMER_INIT_TIMEOUT"
ENV_SHUTDOWN = "TFORMER_SHUTDOWN_TIMEOUT"
DEFAULT_TIMEOUTS = {ENV_HEARTBEAT: 60, ENV_INIT: 300, ENV_SHUTDOWN: 60}


class DistributedError(RuntimeError):
  """The processes of a multi-host run could not connect."""


def _env_int(name: str, default: int | None = None) -> int | None:
  raw = os.environ.get(name, "").strip()
  if not raw:
    return default
  try:
    return int(raw)
  except ValueError:
    raise ConfigError(f"{name}={raw!r}: expected an integer") from None


def settings(coordinator_address: str | None = None, num_processes: int | None = None,
             process_id: int | None = None) -> dict:
  """The keyword arguments for jax.distributed.initialize (arguments, then environment)."""
  coord = coordinator_address or os.environ.get(ENV_COORDINATOR) or None
  nproc = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
  pid = process_id if process_id is not None else _env_int(ENV_PROCESS_ID)
  if coord is not None and ":" not in coord:
    raise ConfigError(f"coordinator address {coord!r}: expected host:port")
  if nproc is not None and nproc < 1:
    raise ConfigError(f"num_processes: must be >= 1, got {nproc}")
  if nproc is not None and pid is not None and not 0 <= pid < nproc:
    raise ConfigError(f"process_id: must be in [0, {nproc}), got {pid}")
  kw = {"coordinator_address": coord, "num_processes": nproc, "process_id": pid}
  # Bounded waits, where this jax version supports them.
  supported = inspect.signature(jax.distributed.initialize).parameters
  for env, arg in ((ENV_HEARTBEAT, "heartbeat_timeout_seconds"), (ENV_INIT, "initialization_timeout"),
                   (ENV_SHUTDOWN, "shutdown_timeout_seconds")):
    if arg in supported:
      kw[arg] = _env_int(env, DEFAULT_TIMEOUTS[env])
  return kw


def wait_for_coordinator(address: str, timeout_s: float, poll_s: float = 0.25) -> None:
  """Wait until the coordinator's port accepts connections, up to `timeout_s`; else DistributedError.

  Processes other than 0 call this first: when jax's client cannot register with the coordinator in
  time, it aborts the whole process from C++ (`LOG(FATAL)`, exit status 134), which no Python handler
  sees. Process 0 is the coordinator and may start later, so this polls."""
  host, _, port = address.rpartition(":")
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      with socket.create_connection((host.strip("[]"), int(port)), timeout=max(0.1, min(5.0, timeout_s))):
        return
    except (OSError, ValueError) as e:
      if time.monotonic() + poll_s >= deadline:
        raise DistributedError(
            f"distributed: cannot reach the coordinator {address} within {timeout_s:g} s (is process 0 "
            f"running, and the address right and reachable from here?): {e}") from None
    time.sleep(poll_s)


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> None:
  """Join the multi-host run (idempotent). With nothing given anywhere, jax auto-detects the cluster."""
  if jax.distributed.is_initialized():
    return
  kw = settings(coordinator_address, num_processes, process_id)
  explicit = {k: kw[k] for k in ("coordinator_address", "num_processes", "process_id")}
  if kw["coordinator_address"] and kw["process_id"]:           # not process 0, which hosts the service
    wait_for_coordinator(kw["coordinator_address"], float(_env_int(ENV_INIT, DEFAULT_TIMEOUTS[ENV_INIT])))
  try:
    jax.distributed.initialize(**kw)
  except ValueError as e:  # jax found neither settings nor a known cluster environment
    raise ConfigError(
        f"distributed: {e} Pass --coordinator_address/--num_processes/--process_id, set "
        f"{ENV_COORDINATOR}/{ENV_NUM_PROCESSES}/{ENV_PROCESS_ID}, or run under SLURM/Open MPI/a TPU pod "
        f"(got {explicit})") from None
  except RuntimeError as e:
    if "only be called once" in str(e) or "must be called before" in str(e):
      raise
    raise DistributedError(
        f"distributed: could not join the run at {kw['coordinator_address'] or '<auto-detected>'} as "
        f"process {kw['process_id']} of {kw['num_processes']} within {kw.get('initialization_timeout')} s "
        f"(is process 0 running and the port reachable?): {e}") from None
  log.info("distributed: process %d of %d, %d local / %d global devices", jax.process_index(),
           jax.process_count(), jax.local_device_count(), jax.device_count())
