"""Benchmarks: CLIs print a valid final JSON line, the FLOP formula, the torch twin, perf edits' equivalence.

No timing is asserted anywhere: speed lives in the benchmarks' JSON, not in tests.
"""
import dataclasses
import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tformer_jax import cli_common
from tformer_jax.analysis import flops
from tformer_jax.bench import train as train_bench
from tformer_jax.config import ModelConfig
from tformer_jax.config.schema import MLAConfig
from tformer_jax.train import setup as setup_lib

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = ["model.num_layers=1", "model.d_model=32", "model.num_heads=2", "model.max_len=32",
        "data.seq_len=32", "data.batch_size=2"]


def _sets(items):
  return [f"--config.{s}" for s in items]


def _last_json(out: str) -> dict:
  line = out.strip().splitlines()[-1]
  return json.loads(line)


def test_train_cli_prints_documented_json(capsys):
  from tformer_jax.cli.bench import main
  res = main(["train", "--steps", "2", "--warmup", "1", "--peak-n", "128", "--peak-reps", "2", *_sets(TINY)])
  out = _last_json(capsys.readouterr().out)
  assert out == json.loads(json.dumps(res))
  for key in train_bench.JSON_KEYS:
    assert key in out, key
  for key in ("tokens_per_s", "step_ms_median", "compile_s", "achieved_gflops", "peak_gflops", "mfu"):
    assert out[key] > 0 and math.isfinite(out[key]), key
  assert out["loss_finite"] and out["tokens_per_step"] == 2 * 32
  m = ModelConfig(vocab_size=256, d_model=32, num_layers=1, num_heads=2, max_len=32, position="learned",
                  activation="gelu_tanh", qkv_bias=True, out_bias=True, mlp_bias=True)
  assert out["flops_per_step"] == flops.flops_per_step(m, 2, 32)["flops_per_step"]
  assert out["flops_formula"] == flops.FORMULA["full"]


def test_config_overrides_anywhere_on_the_line():
  args = train_bench.parse_args(["--config.model.num_layers=3", "--steps", "2",
                                 "--config=configs/bench/gpt2_cpu.py", "--config.optim.peak_lr", "1e-3",
                                 "--no-donate", "--xla-option=a=1", "--xla-option", "b=true"])
  assert args.config.model.num_layers == 3 and args.config.optim.peak_lr == 1e-3
  assert args.steps == 2 and args.no_donate and args.xla_option == ["a=1", "b=true"]
  assert args.config_file == "configs/bench/gpt2_cpu.py"
  assert train_bench.overrides_list(args) == ["model.num_layers=3", "optim.peak_lr=0.001"]
  default = train_bench.parse_args([])                     # the default file, no overrides
  assert default.config.model.num_layers == 6 and default.overrides == {}


@pytest.mark.parametrize("argv,needle", [
    (["--config.model.num_layer=2"], "model.num_layer: unknown field; did you mean model.num_layers?"),
    (["--config.model.num_layers=two"], "--config.model.num_layers=two"),
    (["--stepz=2"], "stepz"),
    (["--config=configs/nope.py"], "configs/nope.py"),
])
def test_bad_command_line_is_one_line_error_rc_2(argv, needle, capsys):
  with pytest.raises(SystemExit) as e:
    train_bench.main(argv)
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert err.startswith("error: ") and needle in err and len(err.strip().splitlines()) == 1


def test_unknown_override_exits_2_without_traceback():
  p = subprocess.run([sys.executable, "-m", "tformer_jax.bench", "train", "--steps", "1",
                      "--config.model.num_layer=2"], cwd=REPO, capture_output=True, text=True, timeout=120,
                     env=dict(os.environ, JAX_PLATFORMS="cpu", TFORMER_JAX_ALLOCATOR="system"))
  assert p.returncode == 2, p.stderr[-2000:]
  assert p.stderr.strip().splitlines()[-1] == "error: model.num_layer: unknown field; did you mean model.num_layers?"
  assert "Traceback" not in p.stderr


def test_every_bench_help_lists_its_flags(capsys):
  from tformer_jax.cli.bench import main
  for name, flag in [("train", "--peak-n"), ("compile", "--layers"), ("attention", "--kv-heads"),
                     ("decode", "--new-tokens"), ("moe", "--capacity-factor")]:
    with pytest.raises(SystemExit) as e:
      main([name, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert f"  {flag}: " in out, (name, out)
    assert ("--config: " in out) == (name in ("train", "compile", "decode")), name


def test_compile_cli_prints_json(capsys):
  from tformer_jax.cli.bench import main
  main(["compile", "--layers", "1,2", *_sets(TINY)])
  out = _last_json(capsys.readouterr().out)
  assert out["bench"] == "compile" and out["layers"] == [1, 2]
  modes = {(r["mode"], r["layers"]) for r in out["results"]}
  assert modes == {("scan", 1), ("scan", 2), ("unrolled", 1), ("unrolled", 2)}
  assert all(r["compile_s"] > 0 and r["trace_lower_s"] > 0 for r in out["results"])
  assert out["scan_growth"] > 0 and out["unrolled_growth"] > 0


def test_dispatcher_help_lists_subcommands(capsys):
  from tformer_jax.cli.bench import main
  main(["--help"])
  text = capsys.readouterr().out
  for name in ("train", "attention", "compile", "decode", "moe", "compare"):
    assert name in text


def _hand_flops(v, d, layers, heads, f, b, s, *, tied, biases, attn_full=True):
  per_layer = 4 * d * d + 2 * d * f + 2 * 2 * d                  # q k v o, mlp in/out, two LayerNorms
  if biases:
    per_layer += 3 * d + d + f + d                               # q k v biases, out bias, mlp biases
  n_matmul = layers * per_layer + 2 * d + v * d                   # + final norm + LM head
  t = b * s
  attn = (12 if attn_full else 6) * layers * d * s * t
  return 6 * n_matmul * t + attn, n_matmul


def test_flops_formula_counts_mlas_query_key_and_value_widths():
  """MLA: QK^T runs (qk_nope + qk_rope) wide and PV v_head_dim wide, whatever d_model / num_heads is: the
  attention term is 12 n_layers n_heads S T (qk + v) / 2 (DeepSeek-V3: (192 + 128) / 2 = 160, where
  d_model / heads is 56)."""
  m = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, max_len=16, position="rope",
                  norm="rmsnorm", mla=MLAConfig(kv_lora_rank=8, qk_nope_head_dim=6, qk_rope_head_dim=4,
                                                v_head_dim=5))
  got = flops.flops_per_step(m, 3, 16)
  assert got["attention_flops"] == 12 * 2 * 4 * 16 * (3 * 16) * (6 + 4 + 5) / 2
  assert flops.attention_head_dim(m) == 7.5 != m.hd

@pytest.mark.parametrize("tied,biases", [(True, True), (False, False)])
def test_flops_formula_matches_hand_count(tied, biases):
  m = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, max_len=16, position="learned",
                  tie_embeddings=tied, qkv_bias=biases, out_bias=biases, mlp_bias=biases)
  want, n_matmul = _hand_flops(64, 32, 2, 4, 128, 3, 16, tied=tied, biases=biases)
  got = flops.flops_per_step(m, 3, 16)
  assert got["n_matmul"] == n_matmul
  assert got["flops_per_step"] == want
  causal, _ = _hand_flops(64, 32, 2, 4, 128, 3, 16, tied=tied, biases=biases, attn_full=False)
  assert flops.flops_per_step(m, 3, 16, attn="causal")["flops_per_step"] == causal
  counts = flops.param_counts(m)
  assert counts["embedding"] == 64 * 32 + 16 * 32                # token + position tables
  assert counts["total"] == counts["nonembed"] + counts["embedding"]


def test_matmul_rates_keys():
  r = train_bench.matmul_rates(64, 2)
  assert set(r) == {"best", "median", "mean"} and r["best"] >= r["median"] > 0


def _benchmark(name: str):
  """benchmarks/NAME.py as a module (the folder is not a package)."""
  spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
  mod = importlib.util.module_from_spec(spec)
  sys.modules[name] = mod   # dataclasses look their module up there
  spec.loader.exec_module(mod)
  return mod


def _torch_gpt2():
  return _benchmark("torch_gpt2")


@pytest.mark.reference
def test_torch_reference_matches_param_count_and_flops():
  pytest.importorskip("torch")
  tg = _torch_gpt2()
  from tformer_jax.train.loop import resolve_model_config
  m = resolve_model_config(cli_common.load_config("configs/bench/gpt2_cpu.py"))
  c = tg.GPTConfig()
  assert (c.vocab_size, c.d_model, c.num_layers, c.num_heads, c.seq, c.batch) == (
      m.vocab_size, m.d_model, m.num_layers, m.num_heads, 256, 8)
  assert tg.param_count(tg.GPT(c)) == flops.param_counts(m)["total"]
  assert tg.flops_per_step(c)["flops_per_step"] == flops.flops_per_step(m, 8, 256)["flops_per_step"]


@pytest.mark.reference
def test_torch_reference_trains_a_step():
  pytest.importorskip("torch")
  tg = _torch_gpt2()
  c = tg.GPTConfig(d_model=32, num_layers=1, num_heads=2, seq=16, batch=2, max_len=16, attn="naive")
  b = tg.TorchBench(c)
  b.compile()
  wall, iv = b.run(2)
  assert wall > 0 and len(iv) == 2 and math.isfinite(b.final_loss())


@pytest.mark.parametrize("spec,xs,ws", [
    ("bld,dhk->blhk", (2, 5, 8), (8, 2, 3)),
    ("blhk,hkd->bld", (2, 5, 2, 3), (2, 3, 8)),
    ("blf,fd->bld", (2, 5, 6), (6, 8)),
    ("lbd,df->lbf", (3, 2, 8), (8, 6)),        # not the 2-D fast path: einsum fallback
])
def test_project_matches_einsum_values_and_gradients(spec, xs, ws):
  from tformer_jax.backends.cpu.xla_cpu import project
  x = jax.random.normal(jax.random.PRNGKey(0), xs)
  w = jax.random.normal(jax.random.PRNGKey(1), ws)
  np.testing.assert_array_equal(np.asarray(project(spec, x, w)), np.asarray(jnp.einsum(spec, x, w)))

  def loss(fn):
    return lambda a, b: jnp.sum(jnp.sin(fn(spec, a, b)))

  got = jax.grad(loss(project), (0, 1))(x, w)
  want = jax.grad(loss(jnp.einsum), (0, 1))(x, w)
  for g, e in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-5, atol=1e-5)


def test_llama_gpu_config_validates():
  from tformer_jax.train.loop import resolve_model_config
  cfg = cli_common.load_config("configs/bench/llama_1b_gpu.py")
  m = resolve_model_config(cfg)
  assert (m.d_model, m.num_layers, m.kv_heads, m.ff, cfg.runtime.attention, m.dtype) == (
      2048, 16, 8, 5632, "cudnn", "bfloat16")
  assert 0.8e9 < flops.param_counts(m)["total"] < 1.2e9


@pytest.mark.reference
def test_finetune_vs_peft_bad_input_is_one_line_before_any_model_loads(tmp_path, capsys):
  """benchmarks/finetune_vs_peft.py: a bad --hf, --variant or config override is one `error:` line and exit
  status 2, found before any model is built or loaded; in-process through cli_common.run_main, and once as the
  command itself (its entry point, which used to let the error out as a traceback)."""
  pytest.importorskip("transformers")
  import hf_utils  # noqa: PLC0415 (imports torch)
  hf_utils.save_llama(tmp_path / "hf", 300, hidden=32, ffn=64, max_positions=64, tied=True)
  bench = _benchmark("finetune_vs_peft")
  capsys.readouterr()                 # the model's save progress bar
  hf = f"--hf={tmp_path / 'hf'}", "--seq=32"
  for argv, want in (
      ([f"--hf={tmp_path}", "--modes=full"], f"error: --hf: '{tmp_path}' is not an HF model directory"),
      ([*hf, "--modes=full", "--variant=model.remat"], "error: --variant: 'model.remat' is not FIELD=V,..."),
      ([*hf, "--modes=full", "--variant=model.remat=bogus"], "error: model.remat: unknown value 'bogus'"),
      ([*hf, "--modes=full", "--variant=model.num_layer=2"], "error: model.num_layer: unknown field")):
    try:
      rc = cli_common.run_main(bench.main, argv)
    except SystemExit as e:           # cli_common.fail exits itself, after its one line
      rc = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith(want), (argv, err)
  p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "finetune_vs_peft.py"), *hf, "--modes=full",
                      "--variant=model.remat=bogus"], capture_output=True, text=True, timeout=120)
  assert p.returncode == 2 and p.stderr.strip().splitlines()[-1].startswith(
      "error: model.remat: unknown value 'bogus'") and "Traceback" not in p.stderr, p.stderr[-2000:]


def test_finetune_vs_peft_runs_and_bounds_the_ratio(tmp_path):
  """benchmarks/finetune_vs_peft.py end to end on a small Llama (full mode, one timed step, both contenders):
  the JSON's ratio is ours / theirs, each contender's MFLOP a token is analysis.flops.finetune_flops at its
  remat (theirs: none), and the ceiling is our best measured matmul rate (XLA's, or the C++ kernels' on each
  BLAS that loads) over theirs' FLOP rate."""
  pytest.importorskip("transformers")
  import hf_utils  # noqa: PLC0415 (imports torch)
  hf_utils.save_llama(tmp_path / "hf", 300, hidden=32, ffn=64, max_positions=64, tied=True)
  bench = _benchmark("finetune_vs_peft")
  out = tmp_path / "r.json"
  bench.main([f"--hf={tmp_path / 'hf'}", "--modes=full", "--batch=8", "--seq=16", "--steps=1", "--warmup=0",
              "--threads=2", "--matmul-probe=512", f"--json={out}"])
  r = json.loads(out.read_text())
  full, mm = r["full"], r["matmul_gflops"]
  assert mm["xla"] > 0 and mm["torch"] > 0 and mm["openblas"] > 0   # the kernels build wherever the suite runs
  libs = [lib for lib in ("xla", "openblas", "mkl", "onednn") if lib in mm]
  assert mm["ours"] == max(mm[lib] for lib in libs)
  assert all(set(rates) == {"torch", *libs} for rates in mm["by_shape"].values())
  ours, theirs = full["ours"], full["theirs"]
  # (the ratio is rounded to 3 decimals, the rates to 2: a ratio near 0.2 can be 2.5e-3 off relatively)
  assert full["ratio"] == pytest.approx(ours["tokens_per_s"] / theirs["tokens_per_s"], rel=2e-3, abs=6e-4)
  assert ours["trained_params"] == theirs["trained_params"]
  cfg = bench.our_config("full", str(tmp_path / "hf"), 8, 16)
  m = setup_lib.resolve_model_config(cfg)
  fl = flops.finetune_flops(m, 8, 16, attn="causal")["executed"] / 128 / 1e6
  assert ours["mflop_per_token"] == pytest.approx(fl, abs=1e-3) and m.remat == "full"
  none = flops.finetune_flops(dataclasses.replace(m, remat="none"), 8, 16, attn="causal")["executed"] / 128 / 1e6
  assert theirs["mflop_per_token"] == pytest.approx(none, abs=1e-3) and none < fl
  gflops = theirs["mflop_per_token"] * theirs["tokens_per_s"] / 1e3
  assert full["theirs_gflops"] == pytest.approx(gflops, abs=0.01)
  assert full["ceiling_ratio"] == pytest.approx(mm["ours"] / gflops, rel=0.01)
  assert full["theirs_share_of_torch_matmul"] == pytest.approx(gflops / mm["torch"], abs=2e-4)


def test_finetune_vs_peft_in_bf16(tmp_path):
  """--precision=bf16: ours at train.precision=bf16 (on the C++ kernels where MKL or oneDNN gives them a bfloat16 gemm),
  theirs under torch.autocast bfloat16, the matmul probe on bfloat16 operands (no OpenBLAS: it has no bfloat16
  gemm), the JSON saying so; losses near the float32 ones of the same batches."""
  pytest.importorskip("transformers")
  import hf_utils  # noqa: PLC0415 (imports torch)
  hf_utils.save_llama(tmp_path / "hf", 300, hidden=32, ffn=64, max_positions=64, tied=True)
  bench = _benchmark("finetune_vs_peft")
  out = tmp_path / "r.json"
  bench.main([f"--hf={tmp_path / 'hf'}", "--modes=full", "--batch=8", "--seq=16", "--steps=1", "--warmup=0",
              "--threads=2", "--precision=bf16", "--matmul-probe=256", f"--json={out}"])
  r = json.loads(out.read_text())
  full, mm = r["full"], r["matmul_gflops"]
  assert r["precision"] == "bf16" and "openblas" not in mm and mm["xla"] > 0 and mm["torch"] > 0
  ours, theirs = full["ours"], full["theirs"]
  assert ours["config"]["precision"] == "bf16" and theirs["config"]["autocast"] == "bfloat16"
  assert ours["config"]["cpu_kernels"] == (ours["config"]["cpu_blas"] in ("mkl", "onednn"))
  # a random-weight model on random tokens: both losses near ln(300) = 5.70
  assert abs(ours["final_loss"] - theirs["final_loss"]) < 0.05 and abs(theirs["final_loss"] - 5.70) < 0.3
