"""First-call compile of decoding at a config's shape, bf16, abstract weights (nothing allocated): the
prefill and the step loop compiled one after the other vs together on two threads (what
`decode.Request.compile` does), alternating, in one process.

  python benchmarks/decode_compile.py configs/bench/llama_1b_gpu.py unrolled 3   # CONFIG LAYOUT ROUNDS

Prompt 64, 8 new tokens, runtime.attention xla. Per round and mode: lower_s, compile_wall_s,
process_cpu_s (all threads); then the median lower + compile wall per mode and their ratio.
"""
import concurrent.futures as cf
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

from tformer_jax import backends, decode, decode_io  # noqa: E402
from tformer_jax.config import load_config_file  # noqa: E402
from tformer_jax.decode import generation  # noqa: E402

cfg = load_config_file(sys.argv[1])
layout, rounds = sys.argv[2], int(sys.argv[3])
cfg.model.dtype = cfg.model.param_dtype = "bfloat16"
cfg.runtime.attention = "xla"
rt = backends.resolve_runtime(cfg, quiet=True)


def cpu() -> float:
  r = resource.getrusage(resource.RUSAGE_SELF)
  return r.ru_utime + r.ru_stime


with backends.use(rt.backend):
  model = decode_io.model_from_config(cfg)
  model = model.clone(cfg=dataclasses.replace(model.cfg, scan_layers=layout == "scanned", remat="none"))
  tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
  shapes = nn.unbox(jax.eval_shape(model.init, jax.random.PRNGKey(0), tokens)["params"])
  req = decode.make_request(model, np.ones((1, 64), np.int32), max_new_tokens=8, temperature=0.0)

  def lowered():
    t0 = time.perf_counter()
    args = (shapes, req.tokens_BxP, req.mask_BxP, req.lengths_B, req.rng)
    pre = jax.jit(generation._prefill_fn(model, req.slots)).lower(*args)
    st = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), pre.out_info)
    largs = (shapes, st, np.int32(8), req.stop_S, np.int32(0), *req.knobs)
    loop = jax.jit(generation._loop_fn(model, req.spec, 8, False)).lower(*largs)
    return pre, loop, time.perf_counter() - t0

  def one(low):
    t0 = time.perf_counter()
    low.compile()
    return time.perf_counter() - t0

  res = {"serial": [], "together": []}
  for _ in range(rounds):
    for mode in ("serial", "together"):
      pre, loop, lower_s = lowered()
      c0, t0 = cpu(), time.perf_counter()
      if mode == "serial":
        parts = [one(pre), one(loop)]
      else:
        with cf.ThreadPoolExecutor(2) as ex:
          parts = list(ex.map(one, [pre, loop]))
      wall = time.perf_counter() - t0
      row = dict(lower_s=round(lower_s, 2), compile_wall_s=round(wall, 2), process_cpu_s=round(cpu() - c0, 2),
                 prefill_s=round(parts[0], 2), loop_s=round(parts[1], 2))
      res[mode].append(row)
      print(layout, mode, json.dumps(row), flush=True)
  med = {m: statistics.median(x["lower_s"] + x["compile_wall_s"] for x in rows) for m, rows in res.items()}
  print(layout, "median lower+compile wall:", {m: round(v, 2) for m, v in med.items()},
        "together/serial", round(med["together"] / med["serial"], 3), flush=True)
