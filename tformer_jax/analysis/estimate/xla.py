"""XLA's side: the train step compiled as a run compiles it, its memory_analysis() and cost_analysis()."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from tformer_jax import backends
from tformer_jax.config import ModelConfig, default_config
from tformer_jax.nn import Transformer
from tformer_jax.parallel import mesh as mesh_lib
from tformer_jax.train import optim, precision, setup as setup_lib, state as state_lib, step as step_lib


def _memory(compiled: Any) -> dict[str, Any]:
  ma = compiled.memory_analysis()
  out = {"argument": float(ma.argument_size_in_bytes), "output": float(ma.output_size_in_bytes),
         "alias": float(ma.alias_size_in_bytes), "temp": float(ma.temp_size_in_bytes)}
  out["total"] = out["argument"] + out["temp"] + max(out["output"] - out["alias"], 0.0)
  return out


def _flops(compiled: Any) -> float:
  ca = compiled.cost_analysis()
  ca = ca[0] if isinstance(ca, (list, tuple)) else ca
  return float(ca.get("flops", float("nan"))) if ca else float("nan")


def compiled_analysis(m: ModelConfig, batch: int, seq: int, optim_cfg: Any = None) -> dict[str, float]:
  """memory_analysis() and cost_analysis() of the train step (donated state) for `m`, traced under the
  current backend (backends.use; default the reference one); under scan_layers XLA's FLOPs count one
  layer. For a config, `compiled_analysis_config` (the run's exact step, FLOPs counted unrolled)."""
  optim_cfg = optim_cfg if optim_cfg is not None else default_config().optim
  model = Transformer(m)
  tx, schedule = optim.make_optimizer(optim_cfg, 1000)
  init = state_lib.init_fn(model, tx, precision.get_policy("float32").initial_loss_scale(), seq)
  state = jax.eval_shape(lambda r: state_lib.unbox_plain(init(r)), jax.random.PRNGKey(0))
  tok = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
  fn = step_lib.make_train_step(model, tx, schedule, optim_cfg)
  compiled = jax.jit(fn, donate_argnums=(0,)).lower(state, {"inputs": tok, "targets": tok}).compile()
  out = _memory(compiled)
  out["flops"] = _flops(compiled)
  out["flops_per_token"] = out["flops"] / (batch * seq)
  return out


def _compile_config(cfg: Any) -> tuple[Any, str]:
  """cfg's train step as train/setup.py builds it, on a one-device mesh, compiled: (compiled, runtime)."""
  cfg = cfg.copy_and_resolve_references()
  cfg.mesh.shape, cfg.mesh.parallelism, cfg.mesh.num_devices = (1,) * len(tuple(cfg.mesh.axes)), "jit", 1
  mesh = mesh_lib.make_mesh(cfg.mesh, devices=jax.devices()[:1])
  rt = backends.resolve_runtime(cfg, mesh_devices=1, quiet=True)
  with backends.use(rt.backend):
    program = setup_lib.build(cfg, mesh, rt.backend, check_paths=False)
    batch = setup_lib.abstract_batch(cfg, mesh)
    return program.train_step.lower(program.abstract, batch).compile(), rt.summary()


def compiled_analysis_config(cfg: Any, *, flops: bool = True) -> dict[str, Any]:
  """XLA's figures for cfg's train step compiled as a run compiles it (train/setup.py, one device,
  cfg.runtime resolved here): memory_analysis() bytes, 'total' = arguments + temporaries, and 'runtime'.
  flops: + 'flops' / 'flops_per_token' from a second compile XLA can count (the package docstring)."""
  compiled, runtime = _compile_config(cfg)
  out: dict[str, Any] = _memory(compiled)
  out["runtime"] = runtime
  if flops:
    ref = cfg.copy_and_resolve_references()
    ref.runtime.backend, ref.runtime.attention, ref.runtime.cpu_kernels = "reference", "reference", "off"
    ref.model.scan_layers = False
    out["flops"] = _flops(_compile_config(ref)[0])
    out["flops_per_token"] = out["flops"] / (int(cfg.data.batch_size) * int(cfg.data.seq_len))
    out["flops_runtime"] = "reference backend, dense attention, unrolled layers"
  return out
