"""The output directory `prepare` owns: which files are ours, the lock a run holds, the checks before it
writes (resume, refuse, replace), and the atomic exchange of a replacement (built in a partial directory
beside it, `partial_dir`, which a later run removes when its writer is dead: `clean_partials`)."""
from __future__ import annotations

import ctypes
import datetime
import errno
import fcntl
import json
import logging
import os
import pathlib
import re
import shutil
import socket
import sys
import tempfile
from typing import Any

from tformer_jax.data.corpora import DataError, sha256_file
from tformer_jax.data.prepared.dataset import FORMAT, LOCK, MANIFEST, PROGRESS, TOKENIZER_EXTRAS, json_of

log = logging.getLogger(__name__)


def _differences(a: dict[str, Any], b: dict[str, Any]) -> str:
  keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
  return ", ".join(keys) or "nothing"


def ours(name: str) -> bool:
  """A name `prepare` may write (it deletes only such files, and only in a directory it owns)."""
  return (name in (MANIFEST, PROGRESS, LOCK, "tokenizer.model", "tokenizer.json", *TOKENIZER_EXTRAS)
          or name.endswith(".tmp") or (name.startswith("shard-") and name.endswith(".npy")))


def owned(root: pathlib.Path) -> bool:
  """Whether `root` holds a prepared dataset, an unfinished prepare or a prepare's lock (ours to write)."""
  manifest, progress, lock = (json_of(root / n) if (root / n).is_file() else None for n in (MANIFEST, PROGRESS, LOCK))
  return ((isinstance(manifest, dict) and manifest.get("format") == FORMAT)
          or (isinstance(progress, dict) and isinstance(progress.get("arguments"), dict)
              and progress["arguments"].get("format") == FORMAT)
          or (isinstance(lock, dict) and lock.get("format") == FORMAT))


def clear(root: pathlib.Path) -> None:
  """Delete the files of ours in a directory we own (never the lock: it is held)."""
  for p in root.iterdir():
    if ours(p.name) and p.name != LOCK and p.is_file():
      p.unlink()


def refuse_foreign(root: pathlib.Path) -> None:
  """DataError unless `root` is missing, empty or ours with nothing else in it."""
  if not root.exists():
    return
  if not root.is_dir():
    raise DataError(f"output {root} exists and is not a directory")
  names = sorted(p.name for p in root.iterdir())
  if not names:
    return
  foreign = names if not owned(root) else [n for n in names if not ours(n)]
  if foreign:
    raise DataError(f"output {root} holds files that are not part of a prepared dataset ({', '.join(foreign[:5])}"
                    f"{', ...' if len(foreign) > 5 else ''}): choose an empty or new directory (tformer-prepare "
                    "writes only into a directory of its own and deletes no file it did not write)")


class Lock:
  """`root/.prepare.lock`: an flock held while a prepare writes `root` (the kernel drops it when the holder
  dies), the holder's pid and command in the file for the message."""

  def __init__(self, root: pathlib.Path):
    self.path = root / LOCK
    self.fd: int | None = None

  def acquire(self) -> Lock:
    while True:
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        holder = json_of(self.path) or {}
        os.close(fd)
        raise DataError(f"output {self.path.parent} is being written by another tformer-prepare (pid "
                        f"{holder.get('pid', '?')} on {holder.get('host', '?')} since {holder.get('started', '?')}): "
                        "wait for it to finish, or choose another --out") from None
      try:
        same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
      except FileNotFoundError:
        same = False
      if same:          # else the holder we waited for removed the file: lock the new one
        break
      os.close(fd)
    info = {"format": FORMAT, "pid": os.getpid(), "host": socket.gethostname(),
            "started": datetime.datetime.now().isoformat(timespec="seconds"), "argv": sys.argv}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(info).encode(), 0)
    self.fd = fd
    return self

  def release(self, remove: bool) -> None:
    if self.fd is None:
      return
    try:
      if remove:
        self.path.unlink(missing_ok=True)
    finally:
      fcntl.flock(self.fd, fcntl.LOCK_UN)
      os.close(self.fd)
      self.fd = None


def check_out_dir(root: pathlib.Path, args: dict[str, Any], overwrite: bool) -> dict[str, Any] | None:
  """(Under the lock) the progress to resume from; None to start afresh; {'complete': True} for a finished
  dataset of these arguments; {'overwrite': True} to build a replacement beside it. DataError when the
  directory holds something else."""
  refuse_foreign(root)
  if overwrite and any((root / n).is_file() for n in (MANIFEST, PROGRESS)):
    return {"overwrite": True}
  for name in (MANIFEST, PROGRESS):
    file = root / name
    if not file.is_file():
      continue
    found = json_of(file)
    if not isinstance(found, dict):
      raise DataError(f"{file} is unreadable: pass --overwrite to prepare {root} again")
    old = found.get("arguments", {})
    if old != args:
      what = "a prepared dataset" if name == MANIFEST else "an unfinished prepare"
      raise DataError(f"output {root} holds {what} made with other arguments (differing: "
                      f"{_differences(old, args)}): pass --overwrite to replace it, or choose another directory")
    if name == MANIFEST:
      return {"complete": True}
    return found
  clear(root)                                     # only leftovers of a run stopped before its first commit
  return None


def exchange_dirs(a: pathlib.Path, b: pathlib.Path) -> None:
  """Swap directories a and b atomically (renameat2 RENAME_EXCHANGE); two renames where the kernel or the
  filesystem lacks it."""
  try:
    libc = ctypes.CDLL(None, use_errno=True)
    at_fdcwd, rename_exchange = -100, 2
    if libc.renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
      return
    err = ctypes.get_errno()
    if err not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
      raise OSError(err, os.strerror(err), str(b))
  except AttributeError:                           # no renameat2 in this libc
    pass
  aside = a.with_name(a.name + ".old")
  os.rename(b, aside)
  os.rename(a, b)
  os.rename(aside, a)


def link_target(d: pathlib.Path) -> pathlib.Path:
  """The directory an output path names: a symlinked --out is its target (replacing it replaces the target's
  contents, as the user meant, never the link)."""
  return d.resolve() if d.is_symlink() else d


def partial_dir(d: pathlib.Path) -> pathlib.Path:
  """A new hidden directory beside `d` to build its replacement in, `.NAME.partial-HOST-PID-XXXXXXXX`: the
  writer's host and pid in the name tell a later run whether it is a dead writer's (`clean_partials`)."""
  tmp = pathlib.Path(tempfile.mkdtemp(dir=d.parent, prefix=f".{d.name}.partial-{socket.gethostname()}-{os.getpid()}-"))
  honour_umask(tmp)              # mkdtemp's 0700: the output is a directory like any other (0755 under umask 022)
  return tmp


def umask() -> int:
  mask = os.umask(0)
  os.umask(mask)
  return mask


def honour_umask(root: pathlib.Path) -> None:
  """`root` and everything under it with the modes an ordinary mkdir / open would give (0777 / 0666 less the
  umask): mkdtemp makes 0700 and some writers (safetensors' save_file) 0600, so a group could not read an output
  meant for sharing."""
  mask = umask()
  for path in [root, *root.rglob("*")]:
    if path.is_symlink():
      continue
    os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:                         # another user's process
    return True
  return True


def clean_partials(d: pathlib.Path) -> list[pathlib.Path]:
  """Remove the partial directories of output `d` (only `.NAME.partial-*` beside it, NAME = d's name) that a
  writer killed on this host left (its pid gone); the ones left (a live writer's, another host's, one without
  a pid from an older version) are named in one warning line with the command that removes them. Returns
  those left."""
  d = d.absolute()
  prefix = f".{d.name}.partial-"
  mine = re.compile(rf"{re.escape(prefix)}(?P<host>.+)-(?P<pid>\d+)-[a-z0-9_]+")
  left = []
  try:
    found = sorted(p for p in d.parent.iterdir() if p.name.startswith(prefix) and p.is_dir() and not p.is_symlink())
  except OSError:                                 # no parent yet, or unreadable: nothing of ours there
    return []
  for p in found:
    m = mine.fullmatch(p.name)
    if m and m["host"] == socket.gethostname() and not _alive(int(m["pid"])):
      shutil.rmtree(p, ignore_errors=True)
      log.info("removed %s (left by a killed run, pid %s)", p, m["pid"])
    else:
      left.append(p)
  if left:
    log.warning("%s: %d partial director%s of an earlier or running write left beside it (a live writer's, another "
                "host's or an older version's); when no write of %s is running: rm -r %s", d, len(left),
                "y" if len(left) == 1 else "ies", d.name, " ".join(f"'{p}'" for p in left))
  return left


def remove_ours(root: pathlib.Path) -> None:
  """Delete `root` (a directory we own) if it then is empty: only our files go."""
  for p in root.iterdir():
    if ours(p.name) and p.is_file():
      p.unlink()
  try:
    root.rmdir()
  except OSError:
    log.warning("left %s: it holds files that prepare did not write", root)


def disk_error(root: pathlib.Path, e: OSError) -> DataError:
  where = f" ({e.filename})" if e.filename else ""
  if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
    hint = "free some space, then rerun the same command to resume (the committed shards are kept)"
  elif e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
    hint = "the output is not writable: choose another --out"
  else:
    hint = "the committed shards are kept; rerun the same command to resume"
  return DataError(f"prepare {root}: {e.strerror or e}{where}: {hint}")


def check_committed(root: pathlib.Path, state: dict[str, Any]) -> None:
  """Before resuming: the committed shards are intact; files past them (an uncommitted shard) are removed."""
  names = set()
  for entry in state["shards"]:
    for kind in ("tokens", "offsets"):
      file = root / entry[kind]
      names.add(entry[kind])
      if not file.is_file() or sha256_file(file) != entry["sha256"][kind]:
        raise DataError(f"{file}: {'missing' if not file.is_file() else 'checksum mismatch'} in the unfinished "
                        f"prepare of {root}; pass --overwrite to start again")
  for p in root.iterdir():
    if p.name.endswith(".tmp") or (p.name.startswith("shard-") and p.name not in names):
      p.unlink()

