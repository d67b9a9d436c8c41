"""Branched runs: `train.branch_from=WORKDIR[@STEP]` starts a new run in its own workdir from another run's
whole state at STEP (default: that run's latest step): parameters, optimizer state (moments, step count),
RNG, loss scale and the data iterator's position. The source is only read.

The use: one long run at a constant learning rate (optim.schedule=wsd with decay_fraction=0, or a wsd run
whose decay is still ahead), and cooldowns branched from any of its checkpoints, each in its own workdir
(Hägele et al. 2024: the loss of a cooldown from step k is the loss of a run trained for its length):

  tformer-train --config=configs/experiments/wsd_cooldown.py --config.optim.decay_fraction=0 \\
      --config.train.steps=4000 --workdir=runs/stable
  tformer-train --config=configs/experiments/wsd_cooldown.py --config.train.branch_from=runs/stable@3000 \\
      --config.train.steps=3600 --workdir=runs/cool_3000_600

train.steps is the branch's last step, as in every run (a resume's too): the branch trains steps
STEP+1 .. train.steps, and under optim.schedule=wsd it decays over exactly those steps (from peak_lr at
STEP to min_lr_ratio * peak_lr at train.steps: `optim.make_schedule`'s decay_start = STEP), so its steps are
bitwise those of one uninterrupted wsd run whose decay starts at STEP. Other schedules continue as the
branch's config says (e.g. a cosine over train.steps). The branch's config.json records the source as
'ABSOLUTE_WORKDIR@STEP'; a branch that was interrupted resumes from its own checkpoints and keeps that step
even when the source has saved newer ones since. A workdir that already holds checkpoints resumes only the
branch it records: another source or step, or a run that was not a branch, is one line, and so is a branch
whose workdir is its source or inside it (the source is never written).

The branch must train the same architecture with the same optimizer (its state is restored as it is):
either difference is one line naming both values, before anything compiles.
"""
from __future__ import annotations

import json
import logging
import os
import pathlib
from typing import Any

import ml_collections
import orbax.checkpoint as ocp

from tformer_jax import config as config_lib
from tformer_jax.checkpoint import CheckpointError
from tformer_jax.checkpoint.common import CHECKPOINT_DIR, DATA, MANIFEST, META, STATE, _path
from tformer_jax.checkpoint.integrity import (
  _check_items,
  _mismatch_error,
  _user_meta,
  _verify_arrays,
  _verify_json,
  shape_mismatches,
)
from tformer_jax.checkpoint.manager import _check_restored, _first_good, _registry, _state_tree
from tformer_jax.config.validate import parse_branch_from

log = logging.getLogger("tformer_jax")
FIELD = "train.branch_from"


def _manager(source: str) -> ocp.CheckpointManager:
  """A read-only Orbax manager over SOURCE/checkpoints (creates nothing)."""
  options = ocp.CheckpointManagerOptions(create=False, enable_async_checkpointing=False,
                                         cleanup_tmp_directories=False)
  return ocp.CheckpointManager(_path(source) / CHECKPOINT_DIR, options=options, handler_registry=_registry())


def _steps(source: str) -> list[int]:
  manager = _manager(source)
  try:
    return sorted(manager.all_steps())
  finally:
    manager.close()


def _holds_checkpoints(work: pathlib.Path) -> bool:
  ckpt = work / CHECKPOINT_DIR
  return ckpt.is_dir() and any(p.name.isdigit() for p in ckpt.iterdir())


def _recorded(work: pathlib.Path) -> str:
  """The branch_from that a workdir's config.json records ('' when none, or no readable config.json)."""
  try:
    return str(json.loads((work / "config.json").read_text()).get("train", {}).get("branch_from", "") or "")
  except (OSError, ValueError, AttributeError):
    return ""


def _check_workdir(workdir: str | os.PathLike | None, source: str, step: int | None) -> int | None:
  """The step to branch at, given the branch's workdir: a workdir that is the source or inside it is refused; one
  that already holds checkpoints resumes only the branch it records (same source, and the same step when one is
  asked), anything else is one line naming what it holds and what was asked. Unchanged `step` otherwise."""
  if workdir is None or "://" in str(workdir) or "://" in source:
    return step
  work = pathlib.Path(workdir).expanduser().resolve()
  src = pathlib.Path(source)
  if work == src or src in work.parents:
    where = "the source" if work == src else "inside the source"
    raise config_lib.ConfigError(f"{FIELD}: the workdir {work} is {where} {src}: a branch never writes its "
                                 "source; give it a workdir of its own")
  if not _holds_checkpoints(work):
    return step
  asked = f"{source}@{step}" if step is not None else f"{source} (its latest step)"
  recorded = _recorded(work)
  if not recorded:
    raise config_lib.ConfigError(f"{FIELD}: {work} already holds a run that was not branched; asked to branch "
                                 f"from {asked}: use a new workdir for the branch")
  rec_path, rec_step = parse_branch_from(recorded)
  if rec_path != source or (step is not None and step != rec_step):
    raise config_lib.ConfigError(f"{FIELD}: {work} already holds the branch from {recorded}; asked to branch from "
                                 f"{asked}: resume it with that branch_from, or use a new workdir")
  return rec_step


def resolve(cfg: ml_collections.ConfigDict, workdir: str | os.PathLike | None = None) -> ml_collections.ConfigDict:
  """cfg with train.branch_from as 'ABSOLUTE_WORKDIR@STEP' (the source's latest step when none is given; a
  branch resuming in `workdir` keeps the step it recorded), after checking that the source trained the same
  architecture with the same optimizer and holds that step. Unchanged without branch_from."""
  path, step = parse_branch_from(cfg.train.get("branch_from", ""))
  if not path:
    return cfg
  source = path if "://" in path else str(pathlib.Path(path).expanduser().resolve())
  step = _check_workdir(workdir, source, step)
  try:
    src_cfg = ml_collections.ConfigDict(json.loads((_path(source) / "config.json").read_text()))
  except (OSError, ValueError) as e:
    raise config_lib.ConfigError(f"{FIELD}: cannot read {source}/config.json ({e})") from None
  ours = config_lib.ModelConfig.from_config(config_lib.resolved(cfg).model).architecture()
  theirs = config_lib.ModelConfig.from_config(src_cfg.model).architecture()
  if ours["vocab_size"] == 0:                      # a synthetic task's, known once its data is
    ours.pop("vocab_size")
  diff = [f"model.{k}: {theirs[k]!r} there, {ours[k]!r} here" for k in sorted(theirs)
          if k in ours and ours[k] != theirs[k]]
  if diff:
    raise config_lib.ConfigError(f"{FIELD}: {source} trained another architecture (" + "; ".join(diff[:4])
                                 + "); a branch continues its state: use its config")
  for name in ("name",):
    theirs_v, ours_v = src_cfg.get("optim", {}).get(name, "adamw"), cfg.optim.get(name)
    if theirs_v != ours_v:
      raise config_lib.ConfigError(f"{FIELD}: {source} trained with optim.{name}={theirs_v}, this run sets "
                                   f"{ours_v}: a branch continues its optimizer state; set "
                                   f"--config.optim.{name}={theirs_v}")
  steps = _steps(source)
  if not steps:
    raise config_lib.ConfigError(f"{FIELD}: {source} has no checkpoint to branch from")
  if step is None:
    step = steps[-1]
  elif step not in steps:
    raise config_lib.ConfigError(f"{FIELD}: {source} has no checkpoint step {step}; available: {steps}")
  if step >= cfg.train.steps:
    raise config_lib.ConfigError(f"{FIELD}: step {step} is not before train.steps={cfg.train.steps}: the "
                                 "branch would train no step")
  out = cfg.copy_and_resolve_references()
  with out.unlocked():
    out.train.branch_from = f"{source}@{step}"
  return out


def restore(branch_from: str, abstract_state: Any) -> tuple[Any, dict | None]:
  """(the source's train state at the step `branch_from` names, on `abstract_state`'s shapes and shardings;
  its data-iterator state or None), checked against the step's integrity manifest; the source is only read.
  A damaged or missing step is a CheckpointError (no fallback: the branch point is explicit)."""
  source, step = parse_branch_from(branch_from)
  if step is None:
    raise ValueError(f"branch.restore: {branch_from!r} names no step (resolve it first)")
  manager = _manager(source)
  ckpt_dir = _path(source) / CHECKPOINT_DIR

  def attempt(s: int) -> tuple[Any, dict | None]:
    lines = shape_mismatches(abstract_state, _state_tree(manager, s))
    if lines:
      raise _mismatch_error(ckpt_dir, s, lines)
    step_dir = ckpt_dir / str(s)
    present = {name for name in (DATA, MANIFEST) if (step_dir / name).exists()}
    items = {STATE: ocp.args.StandardRestore(abstract_state), META: ocp.args.JsonRestore()}
    items.update({name: ocp.args.JsonRestore() for name in present})
    out = manager.restore(s, args=ocp.args.Composite(**items))
    _check_restored(abstract_state, out[STATE])
    _check_items(step_dir, out[META], require_data=False)
    data = out[DATA] if DATA in present else None
    if MANIFEST in present:
      manifest = out[MANIFEST]
      _verify_json(manifest, META, _user_meta(out[META]))
      if data is not None:
        _verify_json(manifest, DATA, data)
      _verify_arrays(manifest.get("arrays"), out[STATE])
    return out[STATE], data

  try:
    if step not in manager.all_steps():
      raise CheckpointError(f"{FIELD}: no checkpoint step {step} in {ckpt_dir}")
    _, (state, data), _ = _first_good(ckpt_dir, [step], attempt, explicit=True, debug_log=None)
  finally:
    manager.close()
  if data is None:
    log.warning("%s: step %d of %s has no data-iterator state; the branch reads its data from the start",
                FIELD, step, source)
  return state, data
