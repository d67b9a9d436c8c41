"""Compile time of the train step (scan_layers vs unrolled layers, at several depths), or its memory.

  python -m tformer_jax.bench compile --layers 2,24 [--config=configs/bench/gpt2_cpu.py --repeats 2 \
      --config.model.remat=full]
  python -m tformer_jax.bench compile --memory --config=configs/bench/llama_1b_gpu.py \
      --loss_chunks=0,8192 --cast_params=off,on --remats=none,dots --json=OUT.json

For each depth and layout it builds the real train step (tformer_jax.train.step.make_train_step,
state donated) on abstract inputs (jax.eval_shape: nothing is allocated or run) and times
trace + lowering (`jit(...).lower`) and XLA compilation (`.compile()`) separately; with --repeats the
fastest of the repeats counts (cases interleaved). With scan_layers the layer stack is one
`nn.scan`, so compile time should hardly grow with depth: `scan_growth` = total time at the deepest
over the shallowest depth (target <= 1.5); `unrolled_growth` is the same for the unrolled stack.
Prints a table, then one JSON line.

--memory: XLA's compiled memory analysis of the train step at the config's own depth and layout, for
every combination of --loss_chunks (train.loss_chunk values), --cast_params (auto/off/on: the matmul
weights cast to the compute dtype once per step; auto = train_step's default) and --remats (model.remat
values); an empty list keeps the config's value. Per case: argument, output and alias bytes (alias = the
donated state reused for the new state), temp bytes (XLA's scratch: activations, logits, gradients) and
total = argument + output - alias + temp; then the loss alone (ops.losses.nll_sum, value and gradients)
at each --loss_chunks value. Nothing is allocated or run, so a GPU-sized step can be measured on a CPU: a
config asking for cuDNN attention is measured, off a GPU, with the reference backend and blockwise
attention (FlashAttention-style, O(L) memory as cuDNN's) and says so. XLA:CPU's figures are not the
GPU's (other fusions, bf16 matmuls through float32 on CPUs without native support); compare cases.
"""
from __future__ import annotations

import sys
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from absl import flags

from tformer_jax import backends, cli_common
from tformer_jax.bench import emit, train as train_bench
from tformer_jax.nn import Transformer
from tformer_jax.ops import losses
from tformer_jax.train import loop, optim, precision, state as state_lib, step as step_lib


def define_flags(fv: flags.FlagValues) -> None:
  flags.DEFINE_string("layers", "2,24", "comma-separated depths", flag_values=fv)
  flags.DEFINE_string("modes", "scan,unrolled", "scan, unrolled or both (comma-separated)", flag_values=fv)
  flags.DEFINE_integer("repeats", 1, "time each case this many times, keep the fastest", lower_bound=1, flag_values=fv)
  flags.DEFINE_string("json", None, "also write the result dict to this file", flag_values=fv)
  flags.DEFINE_bool("memory", False, "compiled memory analysis instead of compile time", flag_values=fv)
  flags.DEFINE_string("loss_chunks", "", "--memory: train.loss_chunk values (comma-separated)", flag_values=fv)
  flags.DEFINE_string("cast_params", "auto", "--memory: auto, off, on (comma-separated)", flag_values=fv)
  flags.DEFINE_string("remats", "", "--memory: model.remat values (comma-separated)", flag_values=fv)


def parse_args(argv: Sequence[str] | None) -> Any:
  return cli_common.parse(argv, define_flags, doc=__doc__, prog="python -m tformer_jax.bench compile",
                          config=train_bench.DEFAULT_CONFIG)


def compile_case(cfg: Any, layers: int, scan: bool) -> dict[str, float]:
  """Trace+lower and compile seconds of the train step for `layers` layers (scanned or not), under the
  backend of cfg.runtime."""
  cfg = cfg.copy_and_resolve_references()
  cfg.model.num_layers, cfg.model.scan_layers = layers, scan
  t0 = time.perf_counter()
  lowered = lower_train_step(cfg)
  t1 = time.perf_counter()
  train_bench.compile_with(lowered, {})
  t2 = time.perf_counter()
  return {"trace_lower_s": t1 - t0, "compile_s": t2 - t1, "total_s": t2 - t0}


def lower_train_step(cfg: Any, *, cast_params: bool | None = None) -> Any:
  """The real train step (state donated, train.loss_chunk) lowered on abstract inputs, under the backend
  of cfg.runtime: nothing is allocated."""
  backend = backends.resolve_runtime(cfg, quiet=True).backend
  m = loop.resolve_model_config(cfg)
  model = Transformer(m)
  tx, schedule = optim.make_optimizer(cfg.optim, int(cfg.train.steps), backend)
  policy = precision.get_policy(cfg.train.precision)
  seq, batch = int(cfg.data.seq_len), int(cfg.data.batch_size)
  init = state_lib.init_fn(model, tx, policy.initial_loss_scale(), seq)
  with backends.use(backend):
    abstract = jax.eval_shape(lambda r: state_lib.unbox_plain(init(r)), jax.random.PRNGKey(0))
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    step = step_lib.make_train_step(model, tx, schedule, cfg.optim, loss_chunk=int(cfg.train.loss_chunk),
                                    cast_params=cast_params)
    return jax.jit(step, donate_argnums=(0,)).lower(abstract, {"inputs": tokens, "targets": tokens})


MEMORY_FIELDS = ("argument", "output", "alias", "temp", "generated_code")
CAST_CHOICES = {"auto": None, "off": False, "on": True}


def memory_case(cfg: Any, *, cast_params: bool | None = None) -> dict[str, float]:
  """Compiled memory analysis of the train step, in bytes: argument, output, alias, temp,
  generated_code, total (= argument + output - alias + temp), and compile_s."""
  t0 = time.perf_counter()
  compiled = train_bench.compile_with(lower_train_step(cfg, cast_params=cast_params), {})
  ma = compiled.memory_analysis()
  out = {k: int(getattr(ma, f"{k}_size_in_bytes")) for k in MEMORY_FIELDS}
  out["total"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
  out["compile_s"] = round(time.perf_counter() - t0, 2)
  return out


def loss_memory_case(m: Any, batch: int, seq: int, chunk: int) -> dict[str, int]:
  """Compiled memory of the loss alone: value and gradients (w.r.t. the hidden states and the
  unembedding matrix, in the compute dtype) of the token-sum NLL, at chunk (0 = full logits)."""
  dt = jnp.dtype(m.dtype)
  h = jax.ShapeDtypeStruct((batch, seq, m.d_model), dt)
  w = jax.ShapeDtypeStruct((m.d_model, m.vocab_size), dt)
  t = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
  loss = lambda h, w, t: losses.nll_sum(h, w, t, chunk=chunk)  # noqa: E731  (what train_step runs)
  ma = jax.jit(jax.value_and_grad(loss, (0, 1))).lower(h, w, t).compile().memory_analysis()
  return {k: int(getattr(ma, f"{k}_size_in_bytes")) for k in MEMORY_FIELDS}


def gpu_stand_in(cfg: Any) -> str:
  """Off a GPU, a config asking for cuDNN attention is measured with the reference backend and
  blockwise attention (edits cfg); returns the note to print ('' when nothing changed)."""
  if cfg.runtime.attention != "cudnn" or jax.default_backend() == "gpu":
    return ""
  cfg.runtime.attention, cfg.runtime.backend = "blockwise", "reference"
  return (f"note: runtime.attention 'cudnn' needs a GPU; this {jax.default_backend()} measurement uses the "
          "reference backend and blockwise attention (O(L) memory, as cuDNN's flash attention)")


def _list(text: str, default: Any, kind: type, flag: str) -> list[Any]:
  items = [x.strip() for x in text.split(",") if x.strip()]
  if not items:
    return [default]
  try:
    return [kind(x) for x in items]
  except ValueError:
    cli_common.fail(f"--{flag}: expected comma-separated {kind.__name__} values, got {text!r}")
    return []


def memory_main(args: Any) -> dict[str, Any]:
  cfg = args.config.copy_and_resolve_references()
  note = gpu_stand_in(cfg)
  chunks = _list(args.loss_chunks, int(cfg.train.loss_chunk), int, "loss_chunks")
  remats = _list(args.remats, str(cfg.model.remat), str, "remats")
  casts = _list(args.cast_params, "auto", str, "cast_params")
  if any(c not in CAST_CHOICES for c in casts):
    cli_common.fail(f"--cast_params: expected auto, off or on (comma-separated), got {args.cast_params!r}")
  m = loop.resolve_model_config(cfg)
  b, l = int(cfg.data.batch_size), int(cfg.data.seq_len)
  info = train_bench.machine_info()
  print(f"machine: {info['nproc']} cpus ({info['cpu']}), load {info['loadavg']}, backend {info['backend']}, "
        f"jax {info['jax']}; {m.num_layers} layers d_model={m.d_model} vocab={m.vocab_size}, batch {b} x {l}, "
        f"{cfg.train.precision}")
  if note:
    print(note)
  print(backends.resolve_runtime(cfg, quiet=True).summary())
  gib = 2.0 ** 30
  print(f"float32 logits (B x L x V): {b * l * m.vocab_size * 4 / gib:.2f} GiB")
  print(f"{'remat':<7}{'loss_chunk':>11}{'cast':>6}{'argument':>10}{'output':>9}{'alias':>9}{'temp':>9}"
        f"{'total GiB':>11}{'compile s':>11}")
  rows = []
  for remat in remats:
    for chunk in chunks:
      for cast in casts:
        case = cfg.copy_and_resolve_references()
        case.model.remat, case.train.loss_chunk = remat, chunk
        r = memory_case(case, cast_params=CAST_CHOICES[cast])
        print(f"{remat:<7}{chunk:>11}{cast:>6}" + "".join(f"{r[k] / gib:>{w}.2f}" for k, w in (
            ("argument", 10), ("output", 9), ("alias", 9), ("temp", 9), ("total", 11))) + f"{r['compile_s']:>11.1f}")
        rows.append({"remat": remat, "loss_chunk": chunk, "cast_params": cast, **r})
  loss_rows = []
  print(f"the loss alone (value and gradients w.r.t. h {b}x{l}x{m.d_model} and the unembedding, {m.dtype}):")
  for chunk in chunks:
    r = loss_memory_case(m, b, l, chunk)
    print(f"  loss_chunk {chunk:>6}: temp {r['temp'] / gib:.2f} GiB")
    loss_rows.append({"loss_chunk": chunk, **r})
  res: dict[str, Any] = {"bench": "compile_memory", "config": args.config_file,
                         "overrides": train_bench.overrides_list(args), "stand_in": note,
                         "runtime": backends.resolve_runtime(cfg, quiet=True).as_dict(),
                         "logits_f32_bytes": b * l * m.vocab_size * 4, "results": rows, "loss_alone": loss_rows,
                         "machine": info}
  return emit(res, args.json)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = parse_args(argv)
  if args.memory:
    return memory_main(args)
  cfg = args.config
  try:
    depths = [int(x) for x in args.layers.split(",") if x]
  except ValueError:
    depths = []
  modes = [x for x in args.modes.split(",") if x]
  if any(x not in ("scan", "unrolled") for x in modes) or not depths or min(depths) < 1:
    cli_common.fail("--modes takes scan and/or unrolled; --layers at least one depth, each >= 1")
  info = train_bench.machine_info()
  print(f"machine: {info['nproc']} cpus ({info['cpu']}), load {info['loadavg']}, backend {info['backend']}, "
        f"jax {info['jax']}; model d_model={cfg.model.d_model}, remat={cfg.model.remat}")
  print(backends.resolve_runtime(cfg, quiet=True).summary())
  best: dict[tuple[str, int], dict[str, float]] = {}
  for _ in range(max(1, args.repeats)):
    for layers in depths:
      for mode in modes:
        r = compile_case(cfg, layers, mode == "scan")
        key = (mode, layers)
        if key not in best or r["total_s"] < best[key]["total_s"]:
          best[key] = r
  print(f"{'layers':>6} {'mode':<9}{'trace+lower s':>14}{'compile s':>11}{'total s':>9}")
  rows = []
  for (mode, layers), r in sorted(best.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    print(f"{layers:>6} {mode:<9}{r['trace_lower_s']:>14.2f}{r['compile_s']:>11.2f}{r['total_s']:>9.2f}")
    rows.append({"layers": layers, "mode": mode, **{k: round(v, 3) for k, v in r.items()}})
  res: dict[str, Any] = {"bench": "compile", "config": args.config_file,
                         "overrides": train_bench.overrides_list(args),
                         "layers": depths, "repeats": args.repeats, "results": rows, "machine": info}
  lo, hi = min(depths), max(depths)
  for mode in modes:
    if lo != hi and (mode, lo) in best and (mode, hi) in best:
      growth = best[(mode, hi)]["total_s"] / best[(mode, lo)]["total_s"]
      res[f"{mode}_growth"] = round(growth, 3)
      print(f"{mode}: {hi} layers take {growth:.2f}x the time of {lo}" +
            (" (target <= 1.5x)" if mode == "scan" else ""))
  return emit(res, args.json)


if __name__ == "__main__":
  sys.exit(cli_common.run_main(main))
