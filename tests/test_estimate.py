"""The memory/FLOPs estimator (tformer_jax/analysis/estimate/) against XLA's compiled analysis of the
very train step a run compiles (train/setup.py, one device, cfg.runtime resolved on this CPU): a dense
model and both MoE dispatchers within 15% of XLA's arguments + temporaries, the exact terms exact, the
estimate following the runtime it models, and the command's report with its ratio."""
import re

import pytest

from tformer_jax import cli_common
from tformer_jax.analysis import estimate as est_lib
from tformer_jax.cli import estimate_memory as cli
from tformer_jax.train import setup as setup_lib

TOLERANCE = 0.15     # the bar: estimate within 15% of XLA's compiled memory analysis
SMALL = {"model.num_layers": 2, "data.batch_size": 8, "data.seq_len": 128}
CASES = {            # shipped presets at a size that compiles in seconds
    "dense": ("llama_tiny", dict(SMALL, **{"model.d_model": 128, "model.num_heads": 4})),
    # bf16 compute: on an Intel CPU with the mkl extra, the C++ kernels in bf16 (projections, attention, SwiGLU)
    "dense_bf16": ("llama_tiny", dict(SMALL, **{"model.d_model": 128, "model.num_heads": 4,
                                                "train.precision": "bf16"})),
    "moe_dropless": ("mixtral_tiny", dict(SMALL, **{"model.moe.dispatch": "dropless"})),
    "moe_capacity": ("mixtral_tiny", dict(SMALL, **{"model.moe.dispatch": "capacity"})),
}


def _config(name: str, **extra):
  path, overrides = CASES[name]
  return cli_common.load_config(path, dict(overrides, **extra))


@pytest.mark.parametrize("name", ["dense", "dense_bf16", "moe_dropless"])
def test_estimate_within_15_percent_of_xla_compiled_memory(name):
  cfg = _config(name)
  est = est_lib.estimate_config(cfg)
  xla = est_lib.compiled_analysis_config(cfg, flops=name == "dense")
  assert "xla_cpu" in xla["runtime"] and "xla_cpu" in est.execution      # both sides: the run's runtime
  assert est.total == pytest.approx(xla["total"], rel=TOLERANCE), (est.bytes, xla)
  # the arguments are exactly the donated state (params + optimizer state + a few scalars) and the batch
  exact = est.bytes["params"] + est.bytes["optimizer"] + est.bytes["batch"]
  assert xla["argument"] == pytest.approx(exact, rel=0.01)
  if name == "dense":   # counted on the reference backend (XLA counts no custom call) with unrolled layers
    assert est.flops_per_token == pytest.approx(xla["flops_per_token"], rel=TOLERANCE)


def test_cli_prints_the_ratio_and_moe_capacity_is_within_15_percent(capsys):
  path, overrides = CASES["moe_capacity"]
  argv = [f"--config={path}", "--no-flops"] + [f"--config.{k}={v}" for k, v in overrides.items()]
  assert cli.main(argv) == 0
  out = capsys.readouterr().out
  assert "estimated for: xla_cpu" in out and "runtime: xla_cpu" in out      # the runtime it compared
  ratio = float(re.search(r"estimate/XLA = ([\d.]+)", out).group(1))
  assert ratio == pytest.approx(1.0, abs=TOLERANCE), out


def test_cli_rejects_bad_input_in_one_line(capsys):
  assert cli_common.run_main(cli.main, ["--config=llama_tiny", "--batch_size=0", "--no-compile"]) == 2
  err = capsys.readouterr().err.strip()
  assert err == "error: --batch_size: must be > 0, got 0"
  assert cli_common.run_main(cli.main, ["--config=bench/llama_1b_gpu", "--no-compile"]) == 2   # cuDNN on a CPU
  err = capsys.readouterr().err.strip()
  assert err.startswith("error: runtime.attention: 'cudnn' needs a GPU") and "--platform" in err
  assert err.count("\n") == 0


def test_the_estimate_follows_the_runtime_it_models():
  """No compile: each runtime choice moves the term it should, by the arrays it adds or removes."""
  base = est_lib.estimate_config(_config("dense"))
  t, v = 8 * 128, 8192                                       # tokens; a vocabulary whose logits dominate
  full = est_lib.estimate_config(_config("dense", **{"model.vocab_size": v}))
  chunked = est_lib.estimate_config(_config("dense", **{"model.vocab_size": v, "train.loss_chunk": 256}))
  assert chunked.bytes["activations"] == full.bytes["activations"]
  assert chunked.bytes["working"] < full.bytes["working"] - 2 * t * v * 4   # no full (T, V) float32 logits
  remat = est_lib.estimate_config(_config("dense", **{"model.remat": "full", "model.scan_layers": True}))
  assert remat.bytes["activations"] < base.bytes["activations"] / 4 and remat.flops_per_token > base.flops_per_token
  unrolled = est_lib.estimate_config(_config("dense", **{"model.remat": "full"}))
  assert unrolled.bytes["activations"] == base.bytes["activations"] and "scan_layers" in unrolled.notes[0]
  dense_attention = est_lib.estimate_config(_config("dense", **{"runtime.attention": "reference"}))
  assert dense_attention.activation_per_layer > base.activation_per_layer    # full L x S scores per head
  # MoE: ragged_dot's dense (E, N, .) expansion off TPU, none on TPU; capacity keeps (T, E, C) one-hots
  dropless = est_lib.estimate_config(_config("moe_dropless"))
  m = setup_lib.resolve_model_config(_config("moe_dropless"), check_paths=False)
  (cpu_kept, cpu_bwd), (tpu_kept, tpu_bwd) = (est_lib.moe_kept_bytes(m, est_lib.Execution(platform=p), 8, 128)
                                              for p in ("cpu", "tpu"))
  e, n = m.moe.num_experts, 8 * 128 * m.moe.top_k                           # experts, routed rows
  assert cpu_kept - tpu_kept == e * n * (m.d_model + m.moe.d_ff) * 5        # float32 expansions + masks
  assert tpu_bwd == 0 < cpu_bwd
  assert dropless.executed_flops_per_token > 3 * dropless.flops_per_token   # 8 experts computed per row, 2 used
  capacity = est_lib.estimate_config(_config("moe_capacity"))
  assert capacity.activation_per_layer > dropless.activation_per_layer
  assert capacity.per_device() == capacity.total and capacity.per_device(4, 4) == pytest.approx(capacity.total / 4)


def test_report_without_xla():
  m = setup_lib.resolve_model_config(_config("dense"), check_paths=False)
  text = est_lib.format_report(m, est_lib.estimate_config(_config("dense")), 8, 128, kv=(1, 128))
  assert "parameters:" in text and "KV cache" in text and "estimated for: xla_cpu" in text


def test_layout_gives_the_per_device_state_of_the_run_shardings():
  """layout_of (nothing allocated, no devices) gives exactly the bytes each device holds of the state the
  run builds over a mesh of 8 (CPU) devices, with fsdp x tensor rules splitting the parameters."""
  import math

  import jax

  from tformer_jax import backends
  from tformer_jax.parallel import mesh as mesh_lib
  cfg = _config("dense", **{"mesh.shape": "(1,4,2)", "mesh.rules": "fsdp_tp", "model.num_kv_heads": 2})
  lay = est_lib.layout_of(cfg, 8)
  mesh = mesh_lib.make_mesh(cfg.mesh, devices=jax.devices()[:8])
  program = setup_lib.build(cfg, mesh, backends.resolve_runtime(cfg, quiet=True).backend, check_paths=False)

  def shard_bytes(tree):
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))
  assert lay.params == shard_bytes(program.abstract.params)
  assert lay.optimizer == shard_bytes(program.abstract.opt_state)
  assert (lay.split("batch"), lay.split("embed"), lay.split("heads"), lay.split("vocab")) == (4, 4, 2, 2)
  assert 1 / 8 <= lay.param_share < 1 / 4              # the norm scales are replicated


def test_per_device_estimate_follows_the_mesh():
  """No compile: more devices split the state and the batch; a tensor axis splits the logits and FFN;
  the peak phase is named; the FLOPs are analysis/flops.py's with the remat recompute."""
  from tformer_jax.analysis import flops as flops_lib
  cfg = _config("dense", **{"model.remat": "full", "model.scan_layers": True, "train.precision": "bf16",
                            "mesh.shape": "(1,-1,1)", "mesh.rules": "fsdp"})
  one, four = est_lib.estimate_on_mesh(cfg, 1), est_lib.estimate_on_mesh(cfg, 4, platform="tpu")
  assert four.bytes["params"] == pytest.approx(one.bytes["params"] / 4, rel=0.02)
  assert four.bytes["activations"] == one.bytes["activations"] // 4          # 8 sequences over 4 devices
  assert set(four.phases) == {"loss", "backward"} and four.bytes["working"] == max(four.phases.values())
  two = est_lib.estimate_on_mesh(_config("dense", **{"mesh.shape": "(1,2,1)", "mesh.rules": "fsdp"}), 2)
  tp = est_lib.estimate_on_mesh(_config("dense", **{"mesh.shape": "(1,2,2)", "mesh.rules": "fsdp_tp"}), 4)
  assert tp.phases["loss"] == pytest.approx(two.phases["loss"] / 2)         # the same batch, vocab split 2 ways
  m = setup_lib.resolve_model_config(cfg, check_paths=False)
  assert four.flops_per_token == pytest.approx(flops_lib.with_recompute(m, 8, 128)["with_recompute"] / (8 * 128))


def test_cli_per_device_without_libtpu_noise(tmp_path):
  """--devices estimates per device of the mesh; libtpu installed on a CPU host (the tpu-aot extra) is
  not probed: stderr stays empty."""
  import json
  import os
  import subprocess
  import sys
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  out = tmp_path / "e.json"
  run = subprocess.run([sys.executable, "-m", "tformer_jax.cli.estimate_memory", "--config=llama_tiny",
                        "--platform=tpu", "--devices=4", "--no-compile", f"--json={out}"],
                       env=env, capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr
  assert run.stderr == "" and "per device of 4" in run.stdout
  assert json.loads(out.read_text())["estimate_total"] > 0
