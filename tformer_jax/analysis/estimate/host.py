"""The peak resident memory of a CPU training process (`host_rss`): the train step's estimate plus what
the host adds (runtime, the allocator's heap, the checkpoint copy, init_from's load), and its lines."""
from __future__ import annotations

from typing import Any

from tformer_jax.analysis.estimate.execution import F32, Estimate, MiB

# What a CPU training process holds besides the train step's arrays, measured on the 2-core machine with
# the allocator the CLIs use (tcmalloc; /proc/PID/status VmRSS sampled every 0.25 s, docs/finetune.md):
# python + jax/XLA:CPU + the package's imports + the compiled executables + the data pipeline's buffers
# before the first step (llama_tiny, finetune_hf on a 135M Llama: 0.40-0.55 GiB).
RUNTIME_BASELINE = 480 * MiB
# tcmalloc keeps freed spans mapped, and the train step's temp buffer (malloc'd on every call) is served
# from a second span once (XLA:CPU's allocations between calls fragment the first): the heap holds two
# temp buffers' worth from the first steps on, while one is in use.
TEMP_COPIES = 2


def host_rss(est: Estimate, cfg: Any) -> dict[str, int]:
  """The peak resident memory of cfg's training process on CPU, by term (bytes): on CPU the "device"
  arrays are host memory, so the train step's estimate plus what the host adds:
    runtime     RUNTIME_BASELINE (interpreter, jax/XLA:CPU, imports, executables, data pipeline)
    state       params + optimizer state (+ the batch) live for the whole run
    step_temp   the step's temporaries (est.total - state), TEMP_COPIES of them held by the allocator
    checkpoint  Orbax's host copy of the saved state while it writes (a LoRA run: the adapters only)
    init_from   loading the source's weights: a float32 host copy next to the state being built
  peak = runtime + state + max(step_temp, checkpoint, init_from): the three happen at different
  times; the loop hands free pages back after loading and after each evaluation (backends/cpu/host_alloc.py)."""
  state = est.bytes.get("params", 0) + est.bytes.get("optimizer", 0) + est.bytes.get("batch", 0)
  temp = max(est.total - state, 0)
  lora = cfg.train.get("lora") if "train" in cfg else None
  lora_on = bool(lora) and int(lora.get("rank", 0)) > 0
  trained = est.params if not lora_on else est.bytes.get("optimizer", 0) // (2 * F32)
  saved = trained * F32 + est.bytes.get("optimizer", 0)
  source = str(cfg.train.get("init_from", "") or "") if "train" in cfg else ""
  load = est.params * F32 if source else 0
  terms = {"runtime": RUNTIME_BASELINE, "state": state, "step_temp": TEMP_COPIES * temp,
           "checkpoint": saved, "init_from": load}
  terms["peak"] = terms["runtime"] + state + max(terms["step_temp"], saved, load)
  return terms


def format_host(terms: dict[str, int]) -> str:
  """The host-RSS lines of tformer-estimate (a CPU run)."""
  g = lambda b: f"{b / (1024 * MiB):6.2f} GiB"  # noqa: E731
  return "\n".join([
      "host RSS of this run on CPU (train step + what the host adds; peak = runtime + state + the largest of "
      "the rest):",
      f"  runtime        {g(terms['runtime'])}  (python, jax/XLA:CPU, imports, executables, data pipeline)",
      f"  state          {g(terms['state'])}  (params + optimizer state + batch)",
      f"  step_temp      {g(terms['step_temp'])}  (the step's temporaries x{TEMP_COPIES}: the allocator's heap)",
      f"  checkpoint     {g(terms['checkpoint'])}  (Orbax's host copy of the saved state)",
      f"  init_from      {g(terms['init_from'])}  (the source's weights in float32 while they load)",
      f"  peak           {g(terms['peak'])}"])
