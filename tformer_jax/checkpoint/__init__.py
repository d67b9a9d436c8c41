"""Orbax checkpointing for the train loop: async saves, resume from the latest good step, cross-mesh restore.

Layout: `<workdir>/checkpoints/<step>/` with four Orbax items

  state     the whole train-state pytree (StandardSave: params, opt_state, loss scale, rng, step); a
            LoRA run (train.lora) saves its adapters as params and their optimizer state, not the
            frozen base (`merge_lora` rebuilds the model from the train.init_from it points to, at the
            step and with the weights' sha256 recorded in <workdir>/lora_base.json when the run started)
  data      the data iterator's state dict (JSON; absent when the loop passed None)
  meta      {"step": step, **meta} (JSON: the resolved config, anything else), plus the reserved key
            "_checkpoint": {"format": 1, "items": [...]} naming the items saved with the step
  manifest  the integrity manifest (JSON): for every array of `state` its dtype, shape and a 64-bit
            checksum of its bytes (`array_checksums`), and sha256 digests of `data` and `meta`

  ckpt = Checkpointer(workdir / "checkpoints", max_to_keep=3)   # CheckpointError if not writable
  restored = ckpt.restore(abstract_state, require_data_state=True)  # None: no checkpoint yet
  if restored is not None:
    step, state, data_state, meta = restored
  for step in ...:
    ckpt.check()                                  # every step: a finished async save that failed raises
    ...
    ckpt.save(step, state, it.get_state(), {"step": step})   # async: returns once arrays are on host
  ckpt.close()                                    # waits for the last save, raises if it failed

`abstract_state` is a pytree of `jax.ShapeDtypeStruct` (or arrays) whose `.sharding` says where each
tensor goes, so a checkpoint written on one mesh restores onto another mesh or device count.

Save failures stop the caller, in one line: `CheckpointError` is raised by the constructor when the
directory is not writable (probed with a real file), by `save` when a save cannot start (its step
directory is created before `save` returns, so a read-only or vanished directory fails there) or
when the previous async save failed, by `check()` (non-blocking) once a failed async save has
finished (a full disk), and by `wait()`/`close()` before exit. Each failure is raised once; steps
saved before it stay restorable. Orbax's tracebacks go to the debug log, `WORKDIR/debug.log`
(`<directory>/debug.log` when the directory is not named `checkpoints`).

Damage: if the newest step cannot be read (a truncated or missing file), is missing an item it was
saved with (its `data` or `manifest`), or fails its manifest (a changed byte), `restore` logs one
WARNING line naming the step and the reason and falls back to the previous step; nothing is deleted.
The next `save` moves such known-bad step directories aside to `<step>.corrupt` (still on disk) so
that the resumed run can write those steps again. Steps written before manifests existed restore
unverified. When no step is usable the CheckpointError is one line. A shape mismatch between the
checkpoint and the target (an incompatible config) raises `CheckpointError` listing the tensors,
without falling back. Orbax/TensorStore warnings, errors and the "Event loop is closed" noise of
failed reads go to the debug log instead of the console while a Checkpointer is in use.
"""
from __future__ import annotations

from tformer_jax.checkpoint.common import (
    CHECKPOINT_DIR,
    DATA,
    FORMAT,
    MANIFEST,
    META,
    STATE,
    CheckpointError,
    PyTree,
    log,
)
from tformer_jax.checkpoint.integrity import (
    array_checksums,
    shape_mismatches,
)
from tformer_jax.checkpoint.logs import (
    DEBUG_LOG,
)
from tformer_jax.checkpoint.manager import (
    Checkpointer,
    _wait,
)
from tformer_jax.checkpoint.params import (
    BASE_FILE,
    CONFIG_FILE,
    base_identity,
    check_base,
    lora_of,
    merge_lora,
    params_digest,
    pinned_step,
    read_base,
    read_base_record,
    restore_params,
    write_base_record,
)

__all__ = [
    "CHECKPOINT_DIR",
    "CheckpointError",
    "DATA",
    "FORMAT",
    "log",
    "MANIFEST",
    "META",
    "PyTree",
    "STATE",
    "DEBUG_LOG",
    "array_checksums",
    "shape_mismatches",
    "_wait",
    "Checkpointer",
    "BASE_FILE",
    "CONFIG_FILE",
    "base_identity",
    "check_base",
    "lora_of",
    "merge_lora",
    "params_digest",
    "pinned_step",
    "read_base",
    "read_base_record",
    "restore_params",
    "write_base_record",
]
