"""The training loop: data -> sharded jit steps -> metrics/progress -> checkpoints -> a sample.

`train(cfg, workdir)` is the whole job; scripts/train.py only parses flags and calls it.
Resumable after any crash: parameters, optimizer state, step, RNG and the data iterator are restored
from the latest good checkpoint, so a resumed run continues bit-for-bit.
"""
from __future__ import annotations

import json
import logging
import math
import os
import pathlib
import signal
import time
from typing import Any, Callable

import flax.linen as nn
import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils
from tqdm.auto import tqdm

from tformer_jax import backends, checkpoint, config as config_lib, decode
from tformer_jax.checkpoint import Checkpointer
from tformer_jax.data import pipeline, prepared as prepared_lib
from tformer_jax.parallel import mesh as mesh_lib, pmap as pmap_lib
from tformer_jax.train import (
  branch as branch_lib,
  init_from,
  objectives,
  setup as setup_lib,
  state as state_lib,
  workdir as workdir_lib,
)
from tformer_jax.train.metrics import MetricWriter, bytes_per_token, eval_summary
from tformer_jax.train.setup import resolve_model_config as resolve_model_config  # re-exported (bench, tests)

log = logging.getLogger("tformer_jax")


class TrainingError(RuntimeError):
  """The run stopped for a reason the user must look at (e.g. repeated non-finite steps)."""


def prepare_workdir(workdir: str | os.PathLike) -> pathlib.Path:
  path = pathlib.Path(workdir).expanduser()
  try:
    path.mkdir(parents=True, exist_ok=True)
    probe = path / f".write_test.{os.getpid()}"  # one per process: multi-host runs share the workdir
    probe.write_text("ok")
    probe.unlink()
  except OSError as e:
    raise config_lib.ConfigError(f"workdir: {path} is not writable ({e.strerror or e})") from None
  return path


def _install_stop_handlers() -> dict[str, Any]:
  flag = {"signal": None}

  def handler(signum, _frame):
    flag["signal"] = signal.Signals(signum).name

  for sig in (signal.SIGTERM, signal.SIGINT):
    try:
      signal.signal(sig, handler)
    except ValueError:  # not the main thread
      pass
  return flag


EvalHook = Callable[[ml_collections.ConfigDict, Any, Any], Callable[[Any], dict[str, float]]]


def _names_eval_tasks(cfg: ml_collections.ConfigDict) -> bool:
  return bool(str(cfg.train.get("eval_tasks", "") or "").strip(",\t "))


def train(cfg: ml_collections.ConfigDict, workdir: str | os.PathLike, *,
          source_resolved: bool = False, eval_hook: EvalHook | None = None) -> dict[str, float]:
  """Train (or resume) the experiment `cfg` in `workdir`. Returns the final metrics.
  source_resolved: cfg already has train.init_from's architecture (the command line resolved it,
  `cli_common.resolve_source`, with its model overrides on top); otherwise it is resolved here.
  eval_hook: train.eval_tasks' evaluator, built as eval_hook(cfg, model, tokenizer) before the first step and
  called with the host params at each evaluation (its metrics are logged with the loss); the caller passes it
  (tformer-train: `tformer_jax.eval.in_training.HarnessEval`), as train sits below eval."""
  if not source_resolved:
    cfg = init_from.resolve(cfg)                  # fine-tuning: the source's architecture and tokenizer
  config_lib.validate(cfg)  # fail on config errors before touching data or compiling
  cfg = branch_lib.resolve(cfg, workdir)          # train.branch_from: the source's step, pinned
  if eval_hook is None and _names_eval_tasks(cfg):
    raise config_lib.ConfigError("train.eval_tasks: this caller passed no eval_hook (pass "
                                 "eval_hook=tformer_jax.eval.in_training.HarnessEval, as tformer-train does)")
  note = config_lib.warmup_note(cfg.optim, int(cfg.train.steps)) if "optim" in cfg else None
  if note and jax.process_index() == 0:
    log.warning(note)
  cfg = init_from.check_data_tokenizer(cfg)       # a prepared corpus: its own tokenizer (a mismatch is an error)
  cfg = config_lib.resolved(cfg)                  # model.vocab_size 0: the tokenizer's
  if cfg.model.vocab_size == 0:                   # ... known once the data is (a synthetic task's)
    cfg = cfg.copy_and_resolve_references()
    with cfg.unlocked():
      cfg.model.vocab_size = pipeline.tokenizer_for(cfg.data).vocab_size
  mesh = mesh_lib.make_mesh(cfg.mesh)
  mesh_lib.check_layout(cfg, mesh)
  # the C++ kernels are single-device custom calls: only pmap (per device) or a 1-device mesh
  devices = mesh.size if cfg.mesh.parallelism == "jit" else 1
  runtime = backends.resolve_runtime(cfg, mesh_devices=devices, quiet=jax.process_index() != 0)
  stop = _install_stop_handlers()   # before the first long operation: a signal then ends the run cleanly
  new_workdir = not pathlib.Path(workdir).expanduser().exists()
  workdir_lib.check_owned(workdir)  # a user's own folder: refused before the lock file is written
  lock = _lock_workdir(workdir)
  try:
    with backends.use(runtime.backend):
      return _train(cfg, workdir, mesh, runtime, stop, eval_hook)
  except BaseException:
    if lock is not None and new_workdir:  # a run that failed before saving anything leaves no workdir
      workdir_lib.remove_if_unused(workdir)
    raise
  finally:
    if lock is not None:
      lock.release()


def _lock_workdir(workdir: str | os.PathLike) -> workdir_lib.WorkdirLock | None:
  """Process 0 takes the workdir's lock; every process learns whether it got it."""
  lock, error = None, None
  if jax.process_index() == 0:
    try:
      lock = workdir_lib.WorkdirLock(workdir).acquire()
    except workdir_lib.WorkdirBusy as e:
      error = e
  if jax.process_count() > 1 and not int(multihost_utils.broadcast_one_to_all(np.int32(error is None))):
    error = error or workdir_lib.WorkdirBusy(f"workdir: {workdir} is in use (process 0 could not lock it)")
  if error is not None:
    raise error
  return lock


def _train(cfg: ml_collections.ConfigDict, workdir: str | os.PathLike, mesh: jax.sharding.Mesh,
           runtime: backends.Runtime, stop: dict[str, Any], eval_hook: EvalHook | None = None) -> dict[str, float]:
  """The loop over named steps: train, evaluate every eval_every, save every ckpt_every, stop on a signal."""
  run = _Run(cfg, workdir, mesh, runtime, eval_hook)
  steps = cfg.train.steps
  try:
    for step in range(run.start, steps):
      run.train_step(step)
      done = step + 1
      if done % cfg.train.eval_every == 0 or done == steps:
        run.evaluate(done)
      if done % cfg.train.ckpt_every == 0 or done == steps or stop["signal"]:
        run.save(done, force=bool(stop["signal"]))
      if stop["signal"]:
        run.report_stop(stop["signal"], done)
        break
    run.flush()
    run.ckpt.wait()   # raises if the last save failed
  finally:
    run.close()
  return run.result(sample=not stop["signal"])


class _Run:
  """One training run's state between the loop's steps: the program, data, checkpointer, writer and the
  metrics of the step dispatched last (`pending`: read only after the next step is dispatched)."""

  def __init__(self, cfg: ml_collections.ConfigDict, workdir: str | os.PathLike, mesh: jax.sharding.Mesh,
               runtime: backends.Runtime, eval_hook: EvalHook | None = None):
    workdir_lib.check_architecture(workdir, cfg)   # before anything in the workdir changes
    workdir_lib.check_data(workdir, cfg)           # a resumed run: the data it started on
    self.cfg, self.mesh, self.work = cfg, mesh, prepare_workdir(workdir)
    backends.enable_compilation_cache(cfg.data.cache_dir)
    self.is_main = jax.process_index() == 0
    self.ds = pipeline.build_dataset(cfg.data)
    # model, optimizer, abstract sharded state and the jitted steps: the same builder as tformer_jax/aot/
    self.program = setup_lib.build(cfg, mesh, runtime.backend, vocab_size=self.ds.vocab_size)
    self.model = self.program.model
    objectives.check_mask_token(self.model.cfg, self.ds.vocab_size)   # encoders: a [MASK] id of their own
    self.ckpt = Checkpointer(self.work / "checkpoints", max_to_keep=cfg.train.max_to_keep)
    # the prepared data: the same as when the run started (a resume), its shards intact (hashed once)
    run_data = prepared_lib.check_run_data(self.work, pipeline.prepared_datasets(self.ds),
                                           resuming=self.ckpt.latest_step() is not None,
                                           cache_dir=cfg.data.get("cache_dir") or None)
    self.it = pipeline.train_iterator(self.ds, cfg.data, process_index=jax.process_index(),
                                      process_count=jax.process_count())
    self.base_record: dict[str, Any] | None = None   # a LoRA run's base (load_lora_base)
    self.state, self.start = self._restore_or_init()
    backends.release_free_memory()   # the loading's transients (backends/cpu/host_alloc.py: kept mapped otherwise)
    self.heap = backends.ReleaseOnGrowth()
    self.n_params = state_lib.param_count(self.state.params) + state_lib.param_count(self.state.frozen or {})
    if self.program.lora_scale is not None and self.is_main:
      log.info("LoRA: %s adapter parameters trained (rank %d, targets %s) on a frozen base of %s",
               f"{state_lib.param_count(self.state.params):,}", cfg.train.lora.rank, cfg.train.lora.targets,
               f"{state_lib.param_count(self.state.frozen):,}")
    if self.is_main:  # only now: a config that cannot restore this workdir has changed nothing in it
      (self.work / "config.json").write_text(cfg.to_json_best_effort(indent=2))
      (self.work / "runtime.json").write_text(json.dumps(runtime.as_dict(), indent=2))
      prepared_lib.write_run_data(self.work, run_data)
      if self.base_record is not None:
        checkpoint.write_base_record(self.work, self.base_record)
    self.eval_set = [self.to_global(b) for b in pipeline.eval_batches(
        self.ds, cfg.data, cfg.train.eval_batches, process_index=jax.process_index(),
        process_count=jax.process_count())]
    self.bpt = bytes_per_token(self.ds)
    # train.eval_tasks: harness tasks with the loss (names checked here, before the first step)
    self.harness_eval = (eval_hook(cfg, self.model, self.ds.tokenizer)
                         if eval_hook is not None and _names_eval_tasks(cfg) else None)
    self.writer = MetricWriter(self.work, enabled=self.is_main, truncate_after=self.start,
                               loggers=config_lib.parse_loggers(cfg.train.get("loggers", "jsonl,tensorboard")),
                               run_config=cfg.to_dict(), project=str(cfg.train.get("wandb_project", "tformer_jax")))
    if self.is_main:
      log.info("model: %s parameters; mesh %s; rules %s", f"{self.n_params:,}", dict(mesh.shape), cfg.mesh.rules)
    self.progress = _progress(self.is_main, self.start, cfg.train.steps)
    self.final: dict[str, float] = {}
    self.pending: tuple[int, Any] | None = None
    self.saved: int | None = None   # the step of the last save of this run
    self.t_last, self.steps_since = time.perf_counter(), 0

  def _restore_or_init(self) -> tuple[Any, int]:
    """(state, first step): the latest good checkpoint's (with its data iterator state), else a new state
    (train.init_from's weights loaded first: their random init is never computed). A LoRA run's frozen
    base is never saved: init_from holds it."""
    cfg, program, model = self.cfg, self.program, self.model
    abstract, lora = program.abstract, program.lora_scale is not None
    restored = self.ckpt.restore(abstract.replace(frozen=None), require_data_state=True)  # without its iterator: damage
    if restored is not None:
      start, state, data_state, _ = restored
      if lora:
        frozen, self.base_record = init_from.load_lora_base(cfg.train.init_from, abstract.frozen,
                                                            model.cfg.num_layers, self.work, resuming=True)
        state = state.replace(frozen=frozen)
      if data_state:
        self.it.set_state(data_state)
      log.info("resumed from step %d", start)
    elif cfg.train.get("branch_from"):   # a new branch: the source's whole state at its step (train/branch.py)
      state, data_state = branch_lib.restore(cfg.train.branch_from, abstract.replace(frozen=None))
      start = int(state.step)
      if data_state:
        self.it.set_state(data_state)
      log.info("branched from %s (step %s)", *cfg.train.branch_from.rsplit("@", 1))
    else:
      given = {}
      if cfg.train.init_from:
        if lora:   # the base's step and weights, recorded (WORKDIR/lora_base.json): every reader checks them
          given["frozen"], self.base_record = init_from.load_lora_base(cfg.train.init_from, abstract.frozen,
                                                                       model.cfg.num_layers, self.work, resuming=False)
        else:
          given["params"] = init_from.load_params(cfg.train.init_from, abstract.params, model.cfg.num_layers)
      with jax.set_mesh(self.mesh), nn.logical_axis_rules(program.rules):
        state = state_lib.create_state(program.init, jax.random.PRNGKey(cfg.train.seed), program.shardings, **given)
      start = 0
      if given:
        log.info("initialised %s from %s", "the frozen base" if lora else "parameters", cfg.train.init_from)
    return state, start

  def to_global(self, local: dict) -> dict:
    """A process-local batch as the step's global arrays (pmap: split over the local devices)."""
    if self.cfg.mesh.parallelism == "pmap":
      return pmap_lib.split_batch(local, self.mesh)
    sharding = self.program.batch_sharding
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in local.items()}

  def train_step(self, step: int) -> None:
    """Dispatches step `step` + 1, then reads the previous step's metrics (so the host never waits on
    the device between steps); train.stats_every's statistics before the step, which donates the state."""
    self.ckpt.check()   # a failed asynchronous save stops the run here, not minutes later
    batch = self.to_global(next(self.it))
    stats_every = int(self.cfg.train.get("stats_every", 0))
    if self.program.stats_step is not None and (step + 1) % stats_every == 0:
      stats = jax.device_get(self.program.stats_step(self.state, batch))
      self.writer.write(step + 1, {f"stats/{k}": float(v) for k, v in stats.items()})
    self.state, metrics = self.program.train_step(self.state, batch)   # dispatch step N+1 ...
    self.flush()                                                         # ... before reading step N's metrics
    self.pending = (step + 1, metrics)
    self.progress.update(1)
    if step - self.start in (1, 2):   # the compiles and the first steps' buffers are behind: their free pages back
      backends.release_free_memory()
      self.heap.reset()
    elif self.heap.check():             # a second temp span mapped (backends.ReleaseOnGrowth): handed back
      log.debug("step %d: the allocator's free heap grew; released", step + 1)

  def flush(self) -> None:
    """Reads and logs the pending step's metrics, if any."""
    if self.pending is not None:
      step_done, metrics = self.pending
      self.pending = None
      self._finish_step(step_done, metrics)

  def _finish_step(self, step_done: int, metrics: Any) -> None:
    cfg = self.cfg
    m = {k: float(v) for k, v in jax.device_get(metrics).items()}
    m["ppl"] = math.exp(min(m["nll"], 50.0))
    m["bpb"] = m["nll"] / math.log(2) / self.bpt
    self.steps_since += 1
    if m["bad_steps"] >= cfg.train.max_nonfinite:
      last = self.ckpt.latest_step()
      kept = ("no checkpoint was saved yet" if last is None
              else f"the last good checkpoint (step {last}) is untouched")
      raise TrainingError(
          f"{int(m['bad_steps'])} consecutive non-finite steps (ending at step {step_done}); the update was "
          f"skipped each time and {kept}. "
          "Check the learning rate/warmup, the data and the precision (fp16 needs loss scaling).")
    if not m["finite"]:
      log.warning("step %d: non-finite loss or gradient; update skipped (%d in a row)", step_done,
                  int(m["bad_steps"]))
    if step_done % cfg.train.log_every == 0 or step_done == cfg.train.steps:
      now = time.perf_counter()
      m["tokens_per_s"] = self.steps_since * cfg.data.batch_size * cfg.data.seq_len / max(now - self.t_last, 1e-9)
      self.t_last, self.steps_since = now, 0
      self.writer.write(step_done, m)
      self.progress.set_postfix(loss=f"{m['loss']:.3f}", lr=f"{m['lr']:.2e}", tok_s=f"{m['tokens_per_s']:.0f}")
    self.final.update(m)

  def evaluate(self, done: int) -> None:
    """The validation loss (and train.eval_tasks) at step `done`, written and logged."""
    self.flush()
    program = self.program
    params = program.eval_params(self.state)
    sums = [program.eval_step(params, b) for b in self.eval_set]
    ev = eval_summary({k: float(sum(float(s[k]) for s in sums)) for k in sums[0]}, self.bpt)
    if self.harness_eval is not None:
      ev.update(self.harness_eval(mesh_lib.to_host(program.full_params(self.state))))
    self.writer.write(done, ev)
    self.final.update(ev)
    backends.release_free_memory()
    self.heap.reset()
    if self.is_main and not self.model.cfg.causal:
      log.info("step %d: val_loss %.4f (masked LM), masked-token accuracy %.4f", done, ev["val_loss"],
               ev["val_accuracy"])
    elif self.is_main:
      log.info("step %d: val_loss %.4f (%.3f bits/byte)", done, ev["val_loss"], ev["val_bpb"])

  def save(self, done: int, force: bool) -> None:
    """Saves step `done` (asynchronously), unless the run is in a streak of non-finite steps."""
    self.flush()
    if self.final.get("bad_steps", 0) > 0:  # never replace good checkpoints by a state mid-NaN-streak
      log.warning("step %d: not saving during a run of non-finite steps", done)
      return
    backends.release_free_memory()   # the host copy of the state reuses no free span: RSS stays level
    self.heap.reset()
    self.ckpt.save(done, self.state.replace(frozen=None), self.it.get_state(), {"step": done}, force=force)
    self.saved = done

  def report_stop(self, signal_name: str, done: int) -> None:
    self.flush()
    if self.saved == done:
      log.warning("%s received: saved step %d, exiting", signal_name, done)
    else:
      last = self.ckpt.latest_step()
      log.warning("%s received at step %d: not saved (non-finite steps); %s, exiting", signal_name,
                  done, "no checkpoint yet" if last is None else f"the last checkpoint is step {last}")

  def close(self) -> None:
    self.progress.close()
    try:
      self.writer.close()
    finally:
      self.ckpt.close(quiet=True)   # an exception already on its way out wins over a late save failure

  def result(self, sample: bool) -> dict[str, float]:
    """The final metrics, with the end-of-training sample (causal models; not after a signal)."""
    cfg, model, state, final = self.cfg, self.model, self.state, self.final
    if sample and cfg.train.sample_tokens > 0 and model.cfg.causal:   # encoders do not generate
      host_params = mesh_lib.to_host(self.program.full_params(state))  # every process: a gather across hosts
      if self.is_main:
        final["sample"] = sample_text(model, host_params, self.ds.tokenizer, cfg, prompt=data_prompt(self.ds, cfg))
        print(f"\n--- sample (step {int(state.step)}) ---\n{final['sample']}\n---", flush=True)
    final["params"] = self.n_params
    final["step"] = int(state.step)
    return final


SAMPLE_PROMPT_TOKENS = 16


def data_prompt(ds: Any, cfg: ml_collections.ConfigDict) -> str:
  """The end-of-training sample's prompt: train.sample_prompt, or when it is '' the opening
  SAMPLE_PROMPT_TOKENS tokens of the validation split (text of the run's own data and tokenizer)."""
  prompt = str(cfg.train.sample_prompt)
  if prompt or ds.task is not None:
    return prompt
  val = ds.parts()[0].val
  return ds.tokenizer.decode([int(t) for t in np.asarray(val[:min(SAMPLE_PROMPT_TOKENS, len(val))])])


def sample_text(model, params, tokenizer, cfg, seed: int = 0, prompt: str | None = None) -> str:
  """`prompt` (default train.sample_prompt) continued by train.sample_tokens tokens, sampled as cfg.decode says."""
  text = cfg.train.sample_prompt if prompt is None else prompt
  prompt = [int(t) for t in tokenizer.encode(text)] or [0]
  max_new = cfg.train.sample_tokens
  if model.cfg.position == "learned":
    max_new = min(max_new, model.cfg.max_len - len(prompt))
  out = decode.generate(model, params, [prompt], max_new_tokens=max_new,
                        temperature=cfg.decode.temperature, top_k=cfg.decode.top_k, top_p=cfg.decode.top_p,
                        repetition_penalty=cfg.decode.repetition_penalty, rng=jax.random.PRNGKey(seed))
  tokens = np.asarray(out[0] if isinstance(out, tuple) else out)[0]
  return text + tokenizer.decode([int(t) for t in tokens])


def _progress(enabled: bool, start: int, total: int):
  return tqdm(total=total, initial=start, disable=not enabled, dynamic_ncols=True, unit="step",
              mininterval=2.0)
