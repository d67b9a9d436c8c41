"""Fine-tuning throughput on published weights: ours against transformers (full) and transformers + peft (LoRA).

  python benchmarks/finetune_vs_peft.py --hf=DIR [--modes=full,lora --batch=8 --seq=512 --steps=3 --warmup=1
                                        --threads=2 --precision=float32 --json=OUT
                                        --variant=model.remat=none,optim.grad_accum=8]

Needs torch, transformers and (for lora) peft: `pip install torch==2.13.0` first (the CPU wheel), then
`pip install -e ".[reference]" "peft>=0.21,<0.22"`; a missing one is named in one line before anything runs.
One process, one model (the HF directory --hf, e.g. SmolLM2-135M-Instruct from `tformer-convert --from-gguf`),
one precision for every contender (--precision: float32 everywhere, or bf16 mixed precision: float32 weights and
optimizer, bfloat16 matmuls; ours train.precision=bf16, theirs the forward under torch.autocast('cpu',
torch.bfloat16), each library's documented way), the same batch x sequence and the same random token batches:
- ours `full`: configs/finetune_hf.py's train step (the one tformer-train compiles: scanned layers, remat
  'full', chunked loss, AdamW, clipping at 1) on the loaded weights; `lora`: configs/finetune_lora.py's
  (rank 8, alpha 16, q,k,v,o over the frozen base);
- theirs `full`: transformers' AutoModelForCausalLM (SDPA attention, no gradient checkpointing: what a
  PyTorch user gets), cross-entropy over every position, clip_grad_norm_(1), torch.optim.AdamW with the
  preset's lr, betas, eps and weight decay; `lora`: the same model under peft's LoraConfig(r=8,
  lora_alpha=16, target_modules=q,k,v,o_proj, lora_dropout=0), AdamW over the adapters.
torch.set_num_threads(--threads); XLA:CPU uses the machine's cores (2 here), so run it with --threads equal
to them. Each contender: built, its first step (compilation, for ours) timed apart, --warmup untimed steps,
then --steps timed steps, blocking on each step's loss; contenders run one after another (each freed before
the next: a full fine-tune in PyTorch at 8 x 512 holds its activations, several GiB), ours first in each
mode. ratio = our tokens/s / theirs. --variant=FIELD=V,...: ours again with those config overrides (as
--config.FIELD=V would set them; repeat the flag for several variants), e.g. another model.remat policy
or micro-batches (optim.grad_accum: the same batch per optimizer step, in parts). peak_rss_gib: each
contender's own high-water mark of this process (reset before it; the shared baseline of the imports
included). Run as a command it re-runs itself under tcmalloc when installed (both
contenders then share that allocator; `allocator` in the JSON). Measure on an otherwise idle machine.
What bounds the ratio: `matmul_gflops` holds each library's best matmul rate at --precision (bf16: bfloat16
operands, float32 accumulation; our kernel on MKL and oneDNN, the BLASes with a bfloat16 gemm) (a 2048^3 product and
the model's FFN products at batch x seq tokens; `by_shape` each: XLA's dot, torch's and our C++ matmul on each
BLAS installed, `ours` the best of XLA and those), timed before the contenders; each
contender's `mflop_per_token` is the matmul work its step executes (analysis.flops.finetune_flops: theirs at no
recompute, ours at its remat; LoRA without the frozen weights' gradients); per mode, `theirs_gflops` is
their step's FLOP rate, `theirs_share_of_torch_matmul` that rate over torch's matmul rate, and
`ceiling_ratio` our best matmul rate over theirs: the ratio ours would reach executing no more FLOPs than
theirs at that rate with nothing else taking time.
Prints one line per contender and one per mode for the bound, then one JSON line.
"""
from __future__ import annotations

import dataclasses
import functools
import gc
import importlib.util
import json
import os
import pathlib
import platform
import sys
import time
from typing import Any, Sequence

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
  sys.path.insert(0, str(REPO))

from tformer_jax import backends  # noqa: E402  (no jax yet: backends imports its names on first use)

if __name__ == "__main__":
  backends.maybe_reexec()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import flags  # noqa: E402

from tformer_jax import cli_common  # noqa: E402
from tformer_jax.analysis import flops as flops_lib  # noqa: E402
from tformer_jax.backends.cpu import kernels as cpu_kernel  # noqa: E402  (the kernels' own benchmark)
from tformer_jax.bench import emit  # noqa: E402
from tformer_jax.cli_common import load_named_config  # noqa: E402
from tformer_jax.config import validate  # noqa: E402
from tformer_jax.parallel import mesh as mesh_lib  # noqa: E402
from tformer_jax.train import init_from, setup as setup_lib, state as state_lib  # noqa: E402

PRESETS = {"full": "finetune_hf", "lora": "finetune_lora"}
LORA_TARGETS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "up": "up_proj", "gate": "gate_proj",
                "down": "down_proj"}


def define_flags(fv: flags.FlagValues) -> None:
  flags.DEFINE_string("hf", None, "the HF model directory (config.json + safetensors)", flag_values=fv)
  flags.DEFINE_list("modes", ["full", "lora"], "full, lora", flag_values=fv)
  flags.DEFINE_integer("batch", 8, "sequences per step", flag_values=fv)
  flags.DEFINE_integer("seq", 512, "tokens per sequence", flag_values=fv)
  flags.DEFINE_integer("steps", 3, "timed steps per contender", flag_values=fv)
  flags.DEFINE_integer("warmup", 1, "untimed steps after the first", flag_values=fv)
  flags.DEFINE_integer("threads", os.cpu_count() or 1, "torch intra-op threads", flag_values=fv)
  flags.DEFINE_enum("precision", "float32", ["float32", "bf16"], "every contender's precision: float32, or bf16 "
                    "mixed precision (ours train.precision=bf16, theirs torch.autocast bfloat16)", flag_values=fv)
  flags.DEFINE_integer("matmul-probe", 2048, "the side of the square product the matmul rates probe beside the "
                       "model's FFN products (n x n x n)", lower_bound=1, flag_values=fv)
  flags.DEFINE_string("json", None, "also write the result to this file", flag_values=fv)
  flags.DEFINE_multi_string("variant", [], "ours again with these config overrides, FIELD=V,... "
                            "(e.g. model.remat=none,optim.grad_accum=8), after the preset: `ours_variants` in the "
                            "JSON; repeat for several", flag_values=fv)


def reset_peak_rss() -> None:
  """Start a new peak (VmHWM) for this process: Linux's clear_refs '5'; a no-op where it is refused."""
  try:
    pathlib.Path("/proc/self/clear_refs").write_text("5")
  except OSError:
    pass


def peak_rss_gib() -> float | None:
  """This process's peak resident set since `reset_peak_rss` (VmHWM), GiB."""
  try:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
      if line.startswith("VmHWM:"):
        return round(int(line.split()[1]) / 2**20, 3)
  except OSError:
    pass
  return None


def parse_variant(text: str) -> dict[str, str]:
  """'a.b=v,c.d=w' -> {'a.b': 'v', 'c.d': 'w'}; a one-line error for an item without '='."""
  items = [t.strip() for t in text.split(",") if t.strip()]
  bad = [t for t in items if "=" not in t]
  if bad or not items:
    cli_common.fail(f"--variant: {text!r} is not FIELD=V,... (e.g. model.remat=none,optim.grad_accum=8)")
  return dict(t.split("=", 1) for t in items)


def our_config(mode: str, hf_dir: str, batch: int, seq: int, variant: dict[str, str] | None = None,
               precision: str = "float32") -> Any:
  """The preset of `mode` on `hf_dir` at batch x seq and train.precision `precision`, with `variant`'s
  overrides, resolved and validated as tformer-train resolves them."""
  cfg = load_named_config(PRESETS[mode])
  cfg.train.init_from = f"hf:{hf_dir}"
  cfg.train.precision = precision
  cfg.data.batch_size, cfg.data.seq_len = batch, seq
  cfg = init_from.resolve(cli_common.override(cfg, variant or {}))
  validate(cfg)
  return cfg


def token_batches(vocab: int, batch: int, seq: int, n: int = 2, seed: int = 0) -> list[np.ndarray]:
  rng = np.random.default_rng(seed)
  return [rng.integers(0, vocab, (batch, seq + 1), dtype=np.int32) for _ in range(n)]


def timed(step: Any, batches: Sequence[Any], warmup: int, steps: int) -> dict[str, Any]:
  """First step (compile) apart, `warmup` untimed, `steps` timed; step(batch) returns a float loss."""
  t0 = time.perf_counter()
  loss = step(batches[0])
  first = time.perf_counter() - t0
  for i in range(warmup):
    loss = step(batches[(i + 1) % len(batches)])
  times = []
  for i in range(steps):
    t0 = time.perf_counter()
    loss = step(batches[(warmup + 1 + i) % len(batches)])
    times.append(time.perf_counter() - t0)
  return {"first_step_s": round(first, 2), "step_s": [round(t, 3) for t in times], "final_loss": round(loss, 5)}


def run_ours(mode: str, cfg: Any, args: Any, batches: Sequence[np.ndarray], variant: dict[str, str] | None = None
             ) -> dict[str, Any]:
  """Ours on `cfg` (our_config of `mode` with `variant`'s overrides): built, the weights loaded, timed."""
  mesh = mesh_lib.make_mesh(cfg.mesh)
  runtime = backends.resolve_runtime(cfg, mesh_devices=1, quiet=True)
  with backends.use(runtime.backend):
    program = setup_lib.build(cfg, mesh, runtime.backend)
    field = "frozen" if program.lora_scale is not None else "params"
    given = {field: init_from.load_params(cfg.train.init_from, getattr(program.abstract, field),
                                          program.model_config.num_layers)}
    state = [state_lib.create_state(program.init, jax.random.PRNGKey(0), program.shardings, **given)]
    del given
    sharding = program.batch_sharding

    def step(toks: np.ndarray) -> float:
      batch = {"inputs": jax.device_put(toks[:, :-1], sharding), "targets": jax.device_put(toks[:, 1:], sharding)}
      state[0], metrics = program.train_step(state[0], batch)
      return float(metrics["loss"])

    out = timed(step, batches, args.warmup, args.steps)
  rt = runtime.as_dict()
  out["trained_params"] = state_lib.param_count(state[0].params)
  out["config"] = {"preset": PRESETS[mode], "overrides": variant or {}, "precision": cfg.train.precision,
                   "remat": cfg.model.remat,
                   "grad_accum": int(cfg.optim.grad_accum), "scan_layers": bool(cfg.model.scan_layers),
                   "loss_chunk": int(cfg.train.loss_chunk),
                   **{k: rt[k] for k in ("backend", "attention", "cpu_kernels", "cpu_matmul", "cpu_blas",
                                         "allocator")}}
  return out


def run_torch(mode: str, cfg: Any, args: Any, batches: Sequence[np.ndarray]) -> dict[str, Any]:
  """transformers (full) or transformers + peft (lora) on args.hf, with the optimizer settings of `cfg` (our
  preset of `mode`, resolved), timed as ours."""
  import torch  # noqa: PLC0415 (the reference contender only)
  import torch.nn.functional as F  # noqa: PLC0415
  import transformers  # noqa: PLC0415

  o = cfg.optim
  model = transformers.AutoModelForCausalLM.from_pretrained(args.hf, dtype=torch.float32, attn_implementation="sdpa")
  model.config.use_cache = False
  if mode == "lora":
    import peft  # noqa: PLC0415
    lo = cfg.train.lora
    targets = [LORA_TARGETS[t.strip()] for t in str(lo.targets).split(",")]
    model = peft.get_peft_model(model, peft.LoraConfig(r=int(lo.rank), lora_alpha=float(lo.alpha),
                                                       target_modules=targets, lora_dropout=0.0, bias="none"))
  model.train()
  params = [p for p in model.parameters() if p.requires_grad]
  opt = torch.optim.AdamW(params, lr=float(o.peak_lr), betas=(float(o.b1), float(o.b2)), eps=float(o.eps),
                          weight_decay=float(o.weight_decay))
  vocab = model.config.vocab_size if mode == "full" else model.base_model.model.config.vocab_size
  bf16 = cfg.train.precision == "bf16"

  def step(toks: np.ndarray) -> float:
    t = torch.from_numpy(toks.astype(np.int64))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):   # the forward only, as torch documents
      logits = model(input_ids=t[:, :-1]).logits
    loss = F.cross_entropy(logits.float().reshape(-1, vocab), t[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, float(o.clip_norm))
    opt.step()
    return float(loss.detach())

  out = timed(step, batches, args.warmup, args.steps)
  out["trained_params"] = sum(p.numel() for p in params)
  out["config"] = {"library": "peft " + peft.__version__ if mode == "lora" else "transformers",
                   "attention": "sdpa", "gradient_checkpointing": False, "torch_threads": torch.get_num_threads(),
                   "autocast": "bfloat16" if bf16 else None}
  return out


def mflop_per_token(cfg: Any, args: Any, adapter_params: int, remat: str | None = None) -> float:
  """Matmul MFLOP a token that a step of `cfg`'s model executes at its remat (or `remat`): analysis.flops.
  finetune_flops, the attention counted causal (the lower triangle, what a flash kernel that skips masked
  blocks computes: torch's SDPA; our chunked kernel computes whole 64-query tiles, a little more), LoRA over
  a frozen base when adapter_params > 0."""
  m = setup_lib.resolve_model_config(cfg)
  m = dataclasses.replace(m, remat=remat) if remat else m
  fl = flops_lib.finetune_flops(m, args.batch, args.seq, adapter_params=adapter_params, attn="causal")
  return round(fl["executed"] / (args.batch * args.seq) / 1e6, 3)


def matmul_rates(shapes: Sequence[tuple[int, int, int]], reps: int = 5, precision: str = "float32") -> dict[str, Any]:
  """Each library's best GFLOP/s (2 m k n FLOPs a call, the fastest of `reps` calls after one) on each (m, k, n)
  product, 2 threads or whatever both were given: XLA's dot, torch.matmul and, where the C++ kernels load,
  their matmul on each BLAS that loads here ('openblas', 'mkl', 'onednn'; runtime.cpu_blas). precision 'bf16':
  bfloat16 operands (XLA's dot and our kernel accumulating in float32; MKL and oneDNN have a bfloat16 gemm).
  {'xla': best over the shapes, 'torch': the same, ..., 'ours': the best of xla and the BLASes,
  'by_shape': {'MxKxN': {'xla', 'torch', ...}}}."""
  import torch  # noqa: PLC0415
  bf16 = precision == "bf16"
  product = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
  blas = ([name for name in cpu_kernel.build.BF16_BLAS if cpu_kernel.build.bf16_blas_available(name)[0]] if bf16
          else [name for name in cpu_kernel.BLAS if cpu_kernel.blas_available(name)[0]])
  kernel = jax.jit(cpu_kernel.matmul_cpu)
  rng = np.random.default_rng(0)
  by_shape = {}
  for m, k, n in shapes:
    a, b = rng.standard_normal((m, k), np.float32), rng.standard_normal((k, n), np.float32)
    xa, xb, ta, tb = jax.device_put(a), jax.device_put(b), torch.from_numpy(a), torch.from_numpy(b)
    if bf16:
      xa, xb, ta, tb = xa.astype(jnp.bfloat16), xb.astype(jnp.bfloat16), ta.bfloat16(), tb.bfloat16()
    calls = {"xla": functools.partial(lambda x, y: product(x, y).block_until_ready(), xa, xb),
             "torch": functools.partial(torch.matmul, ta, tb)}
    calls |= {name: functools.partial(lambda x, y: kernel(x, y).block_until_ready(), xa, xb) for name in blas}
    rates = {}
    for lib, call in calls.items():
      if lib in blas:
        cpu_kernel.load(blas=lib)   # the kernel calls whichever BLAS is loaded (process-wide)
      call()
      best = float("inf")
      for _ in range(reps):
        t0 = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - t0)
      rates[lib] = round(2 * m * k * n / best / 1e9, 1)
    by_shape[f"{m}x{k}x{n}"] = rates
  libs = ("xla", "torch", *blas)
  best_of = {lib: max(r[lib] for r in by_shape.values()) for lib in libs}
  return best_of | {"ours": max(best_of[lib] for lib in ("xla", *blas))} | {"by_shape": by_shape}


def bound(mode_res: dict[str, Any], matmul: dict[str, float]) -> dict[str, Any]:
  """What the two libraries' matmul rates allow: their step's FLOP rate (their executed MFLOP a token x
  tokens/s) as a share of torch's measured matmul rate, and `ceiling_ratio`, the ratio ours would reach
  executing no more FLOPs than theirs at our best measured matmul rate (XLA's or the C++ kernels' BLAS)
  with nothing else costing time. It bounds
  ours only as far as the probed products stand for the step's (a 2048^3 product alone did not: a full
  fine-tune passed it on 2026-12-03) and up to the rates' own noise (+-35% between runs there)."""
  theirs = mode_res["theirs"]
  gflops = theirs["mflop_per_token"] * theirs["tokens_per_s"] / 1e3
  return {"theirs_gflops": round(gflops, 2), "theirs_share_of_torch_matmul": round(gflops / matmul["torch"], 4),
          "ceiling_ratio": round(matmul["ours"] / gflops, 3)}


def rate(r: dict[str, Any], tokens: int) -> float:
  return round(len(r["step_s"]) * tokens / sum(r["step_s"]), 2)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = cli_common.parse(argv, define_flags, doc=__doc__, prog="benchmarks/finetune_vs_peft.py")
  if not args.hf or not (pathlib.Path(args.hf).expanduser() / "config.json").is_file():
    cli_common.fail(f"--hf: {args.hf!r} is not an HF model directory (no config.json)")
  bad = [m for m in args.modes if m not in PRESETS]
  variants = [parse_variant(v) for v in args.variant]
  missing = [m for m, needed in (("torch", True), ("transformers", True), ("peft", "lora" in args.modes))
             if needed and importlib.util.find_spec(m) is None]
  if missing:
    cli_common.fail(f"the reference contenders need {', '.join(missing)}: pip install torch==2.13.0 first (the CPU "
                    "wheel), then pip install -e '.[reference]' 'peft>=0.21,<0.22'")
  if bad or args.steps < 1 or args.warmup < 0 or args.batch < 1 or args.seq < 2:
    cli_common.fail(f"--modes must name full and/or lora (got {bad}); --steps >= 1, --warmup >= 0, "
                    "--batch >= 1, --seq >= 2")
  args.hf = str(pathlib.Path(args.hf).expanduser().resolve())
  # every configuration of ours, the preset's first, resolved and validated before anything loads (a bad override
  # or an invalid combination: one line)
  configs = {mode: [our_config(mode, args.hf, args.batch, args.seq, v, args.precision) for v in ({}, *variants)]
             for mode in args.modes}
  import torch  # noqa: PLC0415 (after the allocator re-exec)
  import transformers  # noqa: PLC0415
  torch.set_num_threads(args.threads)
  hf_config = json.loads((pathlib.Path(args.hf) / "config.json").read_text())
  vocab, ffn = int(hf_config["vocab_size"]), (int(hf_config["hidden_size"]), int(hf_config["intermediate_size"]))
  batches = token_batches(vocab, args.batch, args.seq)
  tokens = args.batch * args.seq
  res: dict[str, Any] = {
      "bench": "finetune_vs_peft", "hf": args.hf, "batch": args.batch, "seq": args.seq, "tokens_per_step": tokens,
      "steps": args.steps, "warmup": args.warmup, "precision": args.precision, "torch": torch.__version__,
      "transformers": transformers.__version__, "jax": jax.__version__, "torch_threads": args.threads,
      "cpu_count": os.cpu_count(), "allocator": backends.loaded_allocator(),
      "machine": cpu_kernel.build.cpu_field("model name") or platform.processor(),
      # each library's best matmul rate at this precision, on an n^3 product (--matmul-probe) and the model's FFN
      # products
      "matmul_probe": args.matmul_probe,
      "matmul_gflops": matmul_rates([(args.matmul_probe,) * 3, (tokens, ffn[0], ffn[1]), (tokens, ffn[1], ffn[0])],
                                    precision=args.precision)}
  def contender(run: Any, mode: str, cfg: Any, *a: Any, remat: str | None = None) -> dict[str, Any]:
    """run(mode, cfg, *a) with its own peak RSS (the process's high-water mark reset before it; the previous
    contender's memory handed back first, so each peak is its own plus the process's baseline) and the MFLOP
    a token its step executes at cfg's remat or `remat`."""
    gc.collect()
    backends.release_free_memory()
    reset_peak_rss()
    out = run(mode, cfg, *a)
    out["peak_rss_gib"] = peak_rss_gib()
    out["tokens_per_s"] = rate(out, tokens)
    out["mflop_per_token"] = mflop_per_token(cfg, args, out["trained_params"] if mode == "lora" else 0, remat)
    return out

  for mode in args.modes:
    ours = contender(run_ours, mode, configs[mode][0], args, batches)
    # their step keeps every activation: the same architecture's count at no recompute
    theirs = contender(run_torch, mode, configs[mode][0], args, batches, remat="none")
    res[mode] = {"ours": ours, "theirs": theirs, "ratio": round(ours["tokens_per_s"] / theirs["tokens_per_s"], 3)}
    res[mode].update(bound(res[mode], res["matmul_gflops"]))
    print(f"{mode}: ours {ours['tokens_per_s']:.1f} tokens/s (first step {ours['first_step_s']:.1f} s, peak RSS "
          f"{ours['peak_rss_gib']} GiB), theirs {theirs['tokens_per_s']:.1f} tokens/s ({theirs['peak_rss_gib']} GiB): "
          f"{res[mode]['ratio']:.2f}x", flush=True)
    print(f"{mode}: theirs executes {theirs['mflop_per_token']} MFLOP a token (ours {ours['mflop_per_token']}), "
          f"{res[mode]['theirs_gflops']} GFLOP/s: {100 * res[mode]['theirs_share_of_torch_matmul']:.0f}% of torch's "
          f"matmul rate; ours at our best matmul rate with no other cost: {res[mode]['ceiling_ratio']:.2f}x",
          flush=True)
    for text, v, cfg in zip(args.variant, variants, configs[mode][1:]):
      alt = contender(run_ours, mode, cfg, args, batches, v)
      alt["ratio"] = round(alt["tokens_per_s"] / theirs["tokens_per_s"], 3)
      res[mode].setdefault("ours_variants", {})[text] = alt
      print(f"{mode}, ours with {text}: {alt['tokens_per_s']:.1f} tokens/s (peak RSS {alt['peak_rss_gib']} GiB): "
            f"{alt['ratio']:.2f}x", flush=True)
    if args.json:
      pathlib.Path(args.json).write_text(json.dumps(res, indent=2))
  return emit(res, None)


if __name__ == "__main__":
  sys.exit(cli_common.run_main(main))
