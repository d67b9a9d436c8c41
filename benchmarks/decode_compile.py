"""First-call compile of decoding at a config's shape, bf16, abstract weights (nothing allocated): what
`decode.Request.compile` does (lower + compile of the prefill and the step loop, on threads), with the
prefill of an unrolled stack one layer at a time (`layer_prefill`, the default) vs as one program,
alternating, in one process.

  python benchmarks/decode_compile.py configs/bench/llama_1b_gpu.py unrolled 3 [OUT.json]   # CONFIG LAYOUT ROUNDS

Prompt 64, 8 new tokens, greedy, runtime.attention xla. Per round and prefill: the wall seconds of
`Request.compile` (lowering included), the process CPU seconds (all threads) and each function's own
lower + compile seconds (`decode.COMPILE_LOG`); then the median wall per prefill and their ratio.
"""
import dataclasses
import json
import pathlib
import resource
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from tformer_jax import backends, decode, model_loading  # noqa: E402
from tformer_jax.config import load_config_file  # noqa: E402
from tformer_jax.decode import compiled  # noqa: E402

cfg = load_config_file(sys.argv[1])
layout, rounds = sys.argv[2], int(sys.argv[3])
cfg.model.dtype = cfg.model.param_dtype = "bfloat16"
cfg.runtime.attention = "xla"
rt = backends.resolve_runtime(cfg, quiet=True)


def cpu() -> float:
  r = resource.getrusage(resource.RUSAGE_SELF)
  return r.ru_utime + r.ru_stime


with backends.use(rt.backend):
  model = model_loading.model_from_config(cfg)
  model = model.clone(cfg=dataclasses.replace(model.cfg, scan_layers=layout == "scanned", remat="none"))
  tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
  shapes = nn.unbox(jax.eval_shape(model.init, jax.random.PRNGKey(0), tokens)["params"])
  res = {"layers": [], "whole": []}
  for _ in range(rounds):
    for mode in res:
      req = decode.make_request(model, np.ones((1, 64), np.int32), max_new_tokens=8, temperature=0.0)
      req.prefill_layers = mode == "layers"
      compiled._COMPILED.clear()
      logged = len(decode.COMPILE_LOG)
      c0, t0 = cpu(), time.perf_counter()
      req.compile(shapes, 8, False)
      row = dict(wall_s=round(time.perf_counter() - t0, 2), process_cpu_s=round(cpu() - c0, 2),
                 parts={name: round(s, 2) for name, s in decode.COMPILE_LOG[logged:]})
      res[mode].append(row)
      print(layout, mode, json.dumps(row), flush=True)
  med = {m: statistics.median(x["wall_s"] for x in rows) for m, rows in res.items()}
  summary = dict(config=sys.argv[1], layout=layout, rounds=rounds, median_wall_s=med,
                 layers_over_whole=round(med["layers"] / med["whole"], 3), runs=res)
  print(layout, "median Request.compile wall:", med, "layers/whole", summary["layers_over_whole"], flush=True)
  if len(sys.argv) > 4:
    pathlib.Path(sys.argv[4]).write_text(json.dumps(summary, indent=1))
