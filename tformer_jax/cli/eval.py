"""Score a model on a corpus: loss (nats/token), perplexity, bits per byte and token accuracy.

  tformer-eval --workdir=runs/x                          # the run's own validation batches (its config)
  tformer-eval --workdir=runs/x --config.data.corpus=kjv --batches=50
  tformer-eval --workdir=runs/x --split=train
  tformer-eval --hf=path/to/hf_model --corpus=shakespeare --seq_len=512 --batch_size=8
  tformer-eval --hf=path/to/hf_model --config.data.corpus=text:notes/ --config.data.seq_len=2048
  tformer-eval --workdir=runs/x --tasks=shakespeare_next_line,shakespeare_ppl --limit=50   # lm-eval harness
  tformer-eval --hf=DIR --tasks=hellaswag --num_fewshot=10 --include_path=my_tasks/

A workdir is scored with its config.json (any --config.a.b=v override applies: another corpus,
tokenizer, seq_len or batch size) and its latest checkpoint (--step for another); by default on the
batches the training loop evaluates (train.eval_batches evenly spaced windows of the validation
split), so the result is the loop's final val_loss. An HF directory is the model (its architecture and
max_len: `--hf=DIR` is train.init_from=hf:DIR over --config's or the default config) and is scored with
its own tokenizer.json; `--config.data.*` overrides apply to both. --corpus, --seq_len and --batch_size
are short for --config.data.corpus/seq_len/batch_size. Prints a progress bar, a summary line and, last,
one JSON line: `tokens` counts the distinct tokens scored; when the split is shorter than the windows,
they overlap, and the line says how many windows at what stride (`tokens_scored` counts each window's).
An encoder (causal=False) is scored on its masked LM (train/objectives.py, the loop's fixed masks):
loss and accuracy over the masked tokens.

--tasks=NAME[,NAME] runs EleutherAI's lm-evaluation-harness instead (the `eval` extra: pip install
'tformer-jax[eval]') with the `tformer` model class (tformer_jax/eval/harness.py) on the tasks named:
the harness's own, the shipped offline ones (tformer_jax/eval/tasks: shakespeare_next_line,
shakespeare_ppl, shakespeare_continue) and those of --include_path. It prints the harness's results
table (after the checkpoint step it scored) and writes its JSON, the step in its "tformer" entry (--json, or
lm-eval's --output_path=DIR: DIR/<model>/results_<time>.json; default WORKDIR/eval_harness.json or
./eval_harness.json for --hf).
--batch_size is then the requests per step (default 8).
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import pathlib
import re
import sys
import time
from typing import Any, Sequence

import jax
import numpy as np
from absl import flags
from tqdm.auto import tqdm

from tformer_jax import backends, cli_common, config as config_lib, model_loading
from tformer_jax.checkpoint import restore_params
from tformer_jax.data import pipeline
from tformer_jax.nn import Transformer
from tformer_jax.train import metrics as metrics_lib, setup as setup_lib, step as step_lib


def define_flags(fv: flags.FlagValues) -> None:
  flags.DEFINE_string("workdir", None, "a training workdir (config.json + checkpoints/)", flag_values=fv)
  flags.DEFINE_string("hf", None, "a Hugging Face model directory (with its tokenizer.json)", flag_values=fv)
  flags.DEFINE_integer("step", None, "checkpoint step of --workdir (default: the latest)", flag_values=fv)
  flags.DEFINE_enum("split", "val", ["val", "train"], "which split of the corpus", flag_values=fv)
  flags.DEFINE_integer("batches", 0, "batches to score (evenly spaced windows over the split); 0 = the "
                       "config's train.eval_batches", flag_values=fv)
  flags.DEFINE_string("corpus", None, "corpus spec (shakespeare, kjv, text:PATH, prepared:DIR); = "
                      "--config.data.corpus", flag_values=fv)
  flags.DEFINE_integer("seq_len", None, "tokens per window; = --config.data.seq_len", flag_values=fv)
  flags.DEFINE_integer("batch_size", None, "windows per batch; = --config.data.batch_size", flag_values=fv)
  flags.DEFINE_string("json", None, "also write the result to this file", flag_values=fv)
  flags.DEFINE_string("output_path", None, "with --tasks, lm-eval's results folder: the JSON goes to "
                      "PATH/<model>/results_<time>.json (a PATH ending in .json is the file itself)", flag_values=fv)
  flags.DEFINE_string("tasks", None, "lm-evaluation-harness tasks, comma-separated (the harness mode)",
                      flag_values=fv)
  flags.DEFINE_string("include_path", None, "a folder of more harness task YAMLs (with --tasks)", flag_values=fv)
  flags.DEFINE_integer("num_fewshot", None, "few-shot examples per prompt (with --tasks; default: the task's)",
                       flag_values=fv)
  flags.DEFINE_float("limit", None, "documents per task (with --tasks): a count, or a fraction below 1",
                     flag_values=fv)
  flags.DEFINE_integer("max_length", None, "context tokens (with --tasks; default: the model's max_len)",
                       flag_values=fv)


def parse_args(argv: Sequence[str] | None) -> Any:
  args = cli_common.parse(argv, define_flags, doc=__doc__, prog="tformer-eval", config=True, from_workdir=True,
                          from_hf=True)
  if bool(args.workdir) == bool(args.hf):
    cli_common.fail("pass exactly one of --workdir=RUN, --hf=DIR")
  harness_only = [f for f in ("include_path", "num_fewshot", "limit", "max_length") if getattr(args, f) is not None]
  if harness_only and not args.tasks:
    cli_common.fail(f"--{harness_only[0]} needs --tasks=NAME[,NAME] (the lm-evaluation-harness mode)")
  if args.tasks is not None and not [t for t in args.tasks.split(",") if t.strip()]:
    cli_common.fail("--tasks: name at least one harness task")
  if args.limit is not None and args.limit <= 0:
    cli_common.fail(f"--limit must be > 0, got {args.limit:g}")
  if args.output_path is not None and not args.tasks:
    cli_common.fail("--output_path needs --tasks=NAME[,NAME] (lm-eval's results folder; --json otherwise)")
  if args.output_path is not None and args.json is not None:
    cli_common.fail("pass one of --json=FILE, --output_path=PATH (the results folder)")
  if args.json is not None:
    check_output_file("--json", pathlib.Path(args.json))
  if args.output_path is not None:
    out = pathlib.Path(args.output_path)
    if out.suffix == ".json":
      check_output_file("--output_path", out)
    elif out.exists() and not out.is_dir():
      cli_common.fail(f"--output_path={out}: a file, not a results folder (a PATH ending in .json is the file)")
    else:
      _check_writable("--output_path", out)
  return args


def _ours(path: pathlib.Path) -> bool:
  """Whether `path` holds a result tformer-eval wrote (its JSON: the loss line, or the harness's with 'tformer')."""
  try:
    res = json.loads(path.read_text())
  except (OSError, ValueError):
    return False
  return isinstance(res, dict) and ("tformer" in res or {"source", "split", "objective"} <= set(res))


def _check_writable(flag: str, folder: pathlib.Path) -> None:
  """A usage error unless `folder` (or its nearest existing parent, where it would be created) is a writable folder."""
  near = folder
  while not near.exists() and near.parent != near:
    near = near.parent
  if not near.is_dir() or not os.access(near, os.W_OK | os.X_OK):
    cli_common.fail(f"{flag}: {near} is not a writable folder")


def check_output_file(flag: str, path: pathlib.Path) -> None:
  """Before any evaluation: a result file can be written at `path`, and replaces nothing but an earlier
  result of tformer-eval (a user's own file is refused, untouched)."""
  if path.is_dir():
    cli_common.fail(f"{flag}={path}: a folder, not a file")
  if path.exists() and not _ours(path):
    cli_common.fail(f"{flag}={path}: exists and is not a result tformer-eval wrote; pass another path (nothing "
                    "was changed)")
  _check_writable(flag, path.parent)


def _data_config(args: Any) -> Any:
  """The config whose data section is scored: the run's or, for --hf, the HF model's (its architecture
  and tokenizer: cli_common.parse), overrides applied."""
  cfg = args.config
  for field in ("corpus", "seq_len", "batch_size"):
    if getattr(args, field) is not None:
      cfg.data[field] = getattr(args, field)
  if args.hf and "data.tokenizer" not in args.overrides:
    cfg.data.tokenizer = f"hf:{args.hf}"
  return cfg


def coverage(ds: Any, data_cfg: Any, num_batches: int) -> dict[str, Any]:
  """What `pipeline.eval_batches` scores: its windows, their length, the smallest stride between
  neighbours (None for one window) and the distinct token positions they predict."""
  seq, total = int(data_cfg.seq_len), num_batches * int(data_cfg.batch_size)
  parts = ds.parts()
  counts = (pipeline.mixture_quotas([p.weight for p in parts], total, allow_zero=True) if len(parts) > 1
            else (total,))
  distinct, strides = 0, []
  for part, k in zip(parts, counts):
    last = len(part.val) - (seq + 1)
    starts = np.linspace(0, last, k).round().astype(np.int64) if k > 1 else np.zeros(k, np.int64)
    covered = np.zeros(len(part.val), np.bool_)
    for s in starts:
      covered[s + 1:s + 1 + seq] = True
    distinct += int(covered.sum())
    if k > 1:
      strides.append(int(np.diff(starts).min()))
  return {"windows": total, "window_len": seq, "stride": min(strides) if strides else None,
          "distinct": distinct}


def load(args: Any, cfg: Any, vocab_size: int) -> tuple[Any, Any, int | None]:
  """(model, params, checkpoint step): the workdir's (the step restored: the latest usable one unless
  --step), computing in its training precision, or the HF model's (step None)."""
  if args.hf:
    model, params, _ = model_loading.load_hf(args.hf)
    if vocab_size > model.cfg.vocab_size:
      raise config_lib.ConfigError(f"{args.hf}: its tokenizer's vocabulary ({vocab_size}) is larger than the "
                                   f"model's ({model.cfg.vocab_size})")
    return model, params, None
  _, params, step = restore_params(args.workdir, args.step, with_step=True)
  model = Transformer(setup_lib.resolve_model_config(cfg, vocab_size))
  return model, model_loading.check_params(model, params, str(args.workdir)), step


def run_harness(args: Any) -> dict[str, Any]:
  """--tasks: lm-evaluation-harness on the tformer model; prints the results table, writes the JSON."""
  cli_common.require_extra("tformer-eval --tasks", "eval")
  try:
    import lm_eval  # noqa: PLC0415 (the optional `eval` extra)

    from tformer_jax.eval import harness  # noqa: PLC0415 (imports lm_eval)
  except ImportError as e:                     # installed but broken (a dependency of its own missing)
    cli_common.fail(cli_common.extra_message("tformer-eval --tasks", "eval", getattr(e, "name", None) or "lm_eval"))
  names = [t.strip() for t in args.tasks.split(",") if t.strip()]
  if args.include_path and not pathlib.Path(args.include_path).is_dir():
    cli_common.fail(f"--include_path={args.include_path}: not a folder")
  manager, unknown = harness.task_manager_for(names, args.include_path)
  if unknown:
    cli_common.fail(f"--tasks: unknown harness task {unknown[0]!r} (the shipped ones: "
                    f"{', '.join(harness.shipped_tasks())}; more with --include_path=DIR)")
  ckpt_step = None
  if args.hf:
    lm = harness.TformerLM(hf=args.hf, batch_size=args.batch_size or 8, max_length=args.max_length)
  else:
    _, params, ckpt_step = restore_params(args.workdir, args.step, with_step=True)
    model = model_loading.model_from_config(args.config)
    lm = harness.TformerLM(model=model, params=model_loading.check_params(model, params, str(args.workdir)),
                           tokenizer=model_loading.tokenizer_from_config(args.config), config=args.config,
                           batch_size=args.batch_size or 8, max_length=args.max_length)
    lm.source = str(args.workdir)
  limit = None if args.limit is None else int(args.limit) if args.limit >= 1 else float(args.limit)
  t0 = time.perf_counter()
  res = lm_eval.simple_evaluate(model=lm, tasks=names, num_fewshot=args.num_fewshot, limit=limit,
                                task_manager=manager, log_samples=False)
  res["tformer"] = {"source": lm.source, "step": ckpt_step, "seconds": round(time.perf_counter() - t0, 3),
                    "batch_size": lm.batch_size, "max_length": lm.max_length}
  print(f"{lm.source}" + ("" if ckpt_step is None else f": checkpoint step {ckpt_step}"))
  print(lm_eval.utils.make_table(res))
  if "groups" in res:
    print(lm_eval.utils.make_table(res, "groups"))
  out = _harness_output(args, lm.source)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(res, indent=2, default=lm_eval.utils.handle_non_serializable) + "\n")
  print(f"wrote {out}")
  return res


def _harness_output(args: Any, source: str) -> pathlib.Path:
  """--json; or lm-eval's --output_path layout (PATH/<model, sanitized as lm-eval does>/results_<time>.json,
  a PATH ending in .json being the file); else WORKDIR/eval_harness.json (./eval_harness.json for --hf)."""
  if args.output_path:
    path = pathlib.Path(args.output_path)
    if path.suffix == ".json":
      return path
    model = re.sub(r"[\"<>:/|\\?*\[\]]+", "__", source)
    return path / model / f"results_{datetime.datetime.now().strftime('%Y-%m-%dT%H-%M-%S.%f')}.json"
  return pathlib.Path(args.json or (pathlib.Path(args.workdir) / "eval_harness.json" if args.workdir
                                    else "eval_harness.json"))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = parse_args(argv)
  if args.tasks is not None:
    return run_harness(args)
  cfg = _data_config(args)
  config_lib.validate(cfg)
  ds = pipeline.build_dataset(cfg.data)
  if ds.task is not None:
    raise config_lib.ConfigError("data.corpus: synthetic tasks are scored by training (exact match), not here")
  model, params, ckpt_step = load(args, cfg, ds.vocab_size)
  if args.split == "train":
    ds = dataclasses.replace(ds, val_tokens=ds.train_tokens, mixture=())
  n = args.batches or int(cfg.train.eval_batches)
  batches = pipeline.eval_batches(ds, cfg.data, n)
  cover = coverage(ds, cfg.data, n)
  runtime = backends.resolve_runtime(cfg, model=model.cfg, quiet=True)
  with backends.use(runtime.backend):
    step = jax.jit(lambda p, b: step_lib.eval_step(p, b, model=model))
    t0 = time.perf_counter()
    totals: dict[str, float] = {}
    for batch in tqdm(batches, desc="eval", unit="batch", disable=None, file=sys.stderr):
      for k, v in step(params, batch).items():
        totals[k] = totals.get(k, 0.0) + float(v)
  seconds = time.perf_counter() - t0
  prefix = "val_" if args.split == "val" else "train_"
  causal = bool(model.cfg.causal)
  objective = "next_token" if causal else "masked_lm"
  res: dict[str, Any] = {
      "source": str(args.workdir or args.hf), "step": ckpt_step, "corpus": str(cfg.data.corpus),
      "split": args.split,
      "model": {k: getattr(model.cfg, k) for k in ("d_model", "num_layers", "num_heads", "kv_heads", "vocab_size",
                                                  "max_len", "position")},
      "objective": objective,
      "batches": n, "tokens": cover["distinct"] if causal else int(totals["count"]),
      "tokens_scored": int(totals["count"]), "windows": cover["windows"], "seq_len": cover["window_len"],
      "stride": cover["stride"],
      **metrics_lib.eval_summary(totals, metrics_lib.bytes_per_token(ds), prefix=prefix),
      "seconds": round(seconds, 3)}
  at = "" if ckpt_step is None else f" (checkpoint step {ckpt_step})"
  overlap = cover["stride"] is not None and cover["stride"] < cover["window_len"]
  counted = (f"{res['tokens']:,} distinct tokens in {cover['windows']} windows of {cover['window_len']} "
             f"overlapping at stride {cover['stride']}, {res['tokens_scored']:,} scored" if overlap and causal
             else f"{res['tokens_scored']:,} tokens")
  print(f"{res['source']}{at} on {res['corpus']} ({args.split}, {counted}): loss "
        f"{res[prefix + 'loss']:.4f} nats/token, ppl {res[prefix + 'ppl']:.3f}, {res[prefix + 'bpb']:.4f} "
        f"bits/byte, {'masked-token ' if objective == 'masked_lm' else ''}accuracy {res[prefix + 'accuracy']:.4f}")
  line = json.dumps(res)
  print(line)
  if args.json:
    pathlib.Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.json).write_text(line + "\n")
  return res


def entry() -> None:
  """The `tformer-eval` console command."""
  cli_common.exit_process(cli_common.run_main(main))   # bounded: no thread left behind holds the exit


if __name__ == "__main__":
  entry()
