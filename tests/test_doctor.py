"""The doctor: a healthy config passes every check; each planted fault of the articles is caught."""
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tformer_jax.cli.doctor import main as doctor_main
from tformer_jax.cli_common import load_config
from tformer_jax.config import validate
from tformer_jax.doctor import checks, faults
from tformer_jax.nn import Transformer

ROOT = pathlib.Path(__file__).resolve().parents[1]
GPT2 = str(ROOT / "configs" / "gpt2_tiny.py")
SMALL = {"model.d_model": "64", "model.num_heads": "2", "model.num_layers": "2", "model.max_len": "64",
         "data.seq_len": "32", "train.steps": "2000"}


def ctx_for(**overrides):
  return checks.make_context(load_config(GPT2, {**SMALL, **{k: str(v) for k, v in overrides.items()}}))


def static_ctx(**overrides):
  """A context without parameters, for the checks that only read the config."""
  cfg = load_config(GPT2, {**SMALL, **{k: str(v) for k, v in overrides.items()}})
  return checks.Context(cfg, Transformer(validate(cfg)), None, None)


@pytest.fixture(scope="module")
def ctx():
  return ctx_for()


def test_healthy_gpt2_tiny_passes_every_check(tmp_path):
  out = tmp_path / "doctor.json"
  rc = doctor_main([f"--config={GPT2}", "--config.train.steps=2000", f"--json={out}"])
  results = {r["name"]: r for r in json.loads(out.read_text())}
  assert rc == 0
  assert set(results) == set(checks.CHECKS)
  assert all(r["status"] == "PASS" for r in results.values()), results
  assert results["scale"]["detail"].startswith("measured scale 0.125 ")


def test_unknown_override_is_one_line_error_rc_2(capsys):
  with pytest.raises(SystemExit) as e:
    doctor_main([f"--config={GPT2}", "--config.model.num_layer=2"])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert err == "error: model.num_layer: unknown field; did you mean model.num_layers?\n"


def test_scale_1_over_d_fails_and_exits_nonzero(tmp_path):
  out = tmp_path / "doctor.json"
  rc = doctor_main([f"--config={GPT2}", *[f"--config.{k}={v}" for k, v in SMALL.items()],
                    "--plant=scale_1_over_d", "--only=scale,head_dim", f"--json={out}"])
  assert rc == 1
  scale, head_dim = json.loads(out.read_text())
  assert scale["status"] == "FAIL" and "1/d_k" in scale["detail"] and "1/32 " in scale["detail"]
  assert "sqrt(d_k)" in scale["action"] and head_dim["status"] == "PASS"


def test_inverted_mask_is_caught(ctx):
  assert checks.check_padding(ctx).status == "PASS" and checks.check_causal(ctx).status == "PASS"
  assert checks.check_padding(ctx, attention_fn=faults.inverted_mask).status == "FAIL"
  r = checks.check_causal(ctx, attention_fn=faults.inverted_mask)
  assert r.status == "FAIL" and "mask" in r.action


def test_mask_filled_with_zero_gives_padding_weight(ctx):
  r = checks.check_padding(ctx, attention_fn=faults.zero_mask_value)
  assert r.status == "FAIL" and "-1e9" in r.action
  weight = float(r.detail.split(": ")[1].split(" ")[0])
  assert weight > 1e-3                               # exp(0) / sum: a real share of the weight


def test_softmax_over_the_wrong_axis_breaks_row_sums(ctx):
  assert checks.check_rows(ctx, attention_fn=faults.softmax_over_queries).status == "FAIL"


def test_positions_not_used_are_caught(ctx):
  zeroed = checks.check_order(ctx, params=faults.zero_pos_embed(ctx.params))
  assert zeroed.status == "FAIL" and "blind to token order" in zeroed.detail
  not_added = checks.check_order(ctx, apply_fn=faults.positions_not_added)
  assert not_added.status == "FAIL" and "not added" in not_added.detail
  assert checks.check_order(ctx_for(**{"model.position": "none"})).status == "WARN"


def test_init_std_one_blows_up_activations():
  r = checks.check_activations(ctx_for(**{"model.init_std": 1.0}))
  assert r.status == "FAIL" and "0.02" in r.action


def test_no_warmup_with_large_lr_fails_lr_check(ctx):
  assert checks.check_lr(ctx).status == "PASS"   # warmup 100 of 2000 steps (5%), peak 1e-3
  bad = static_ctx(**{"optim.warmup_steps": 0, "optim.peak_lr": 1e-2})
  r = checks.check_lr(bad)
  assert r.status == "FAIL" and "warmup" in r.detail


def test_label_misalignment_caught_by_the_data_check():
  cfg = load_config(GPT2, {**SMALL, "data.corpus": "synthetic:reverse", "model.vocab_size": "18"})
  ctx = checks.make_context(cfg)
  good = checks.check_data(ctx)
  assert good.status == "PASS" and "|" in good.detail          # decoded text of the synthetic batch
  bad = checks.check_data(ctx, batch_fn=faults.labels_not_shifted(checks.default_batch_fn(cfg)))
  assert bad.status == "FAIL" and "not shifted" in bad.detail and "labels" in bad.action


def test_head_dim_below_32_warns():
  assert checks.check_head_dim(static_ctx(**{"model.num_heads": 4})).status == "WARN"   # 64 / 4 = 16


def test_overfit_fails_when_nothing_is_learned(ctx):   # the healthy PASS is in the gpt2_tiny run above
  r = checks.check_overfit(ctx, steps=3, lr=1e-7)
  assert r.status == "FAIL" and "overfit" in r.action


def test_kv_cache_mismatch_is_caught(ctx):
  def off_by_one(model, params, tokens, prefill):        # a position offset bug in "decoding"
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]) + 1, tokens.shape)
    return model.apply({"params": params}, tokens, positions_BxL=pos)
  assert checks.check_kv_cache(ctx, decode_fn=off_by_one).status == "FAIL"


def test_encoder_skips_causal_checks():
  cfg = load_config(str(ROOT / "configs" / "bert_postln.py"),
                    {"model.d_model": "64", "model.num_heads": "2", "model.num_layers": "2", "model.max_len": "64",
                     "data.seq_len": "32", "model.position": "learned"})   # (learned: order PASS at init)
  res = {r.name: r for r in checks.run_checks(checks.make_context(cfg), ["causal", "kv_cache", "order"])}
  assert res["causal"].status == "SKIP" and res["kv_cache"].status == "SKIP"
  assert res["order"].status == "PASS"


def test_crashing_check_is_a_failure_not_an_exception(ctx):
  def broken():
    raise RuntimeError("pipeline exploded")
  r = checks.run_checks(ctx, ["data"], {"data": {"batch_fn": broken}})[0]
  assert r.status == "FAIL" and "pipeline exploded" in r.detail
  assert np.isfinite(r.seconds)


def test_kernels_report_the_platform_devices_and_each_choice(capsys):
  """--kernels_only prints what resolve_runtime chooses for the run's config: here (CPU: the xla_cpu backend,
  its C++ kernels' line), for a TPU target (splash; an MoE model's ragged exchange), and refuses a choice the
  target cannot run in one line, status 2."""
  assert doctor_main([f"--config={GPT2}", "--kernels_only", "--platform=cpu"]) == 0
  out = capsys.readouterr().out
  assert "platform       cpu" in out and f"devices        {jax.device_count()} x " in out
  assert "backend        xla_cpu\n" in out and "CPU kernels    " in out and "why: backend xla_cpu: platform cpu" in out
  assert "PASS" not in out                                            # no checks ran
  mixtral = str(ROOT / "configs" / "mixtral_tiny.py")
  assert doctor_main([f"--config={mixtral}", "--kernels_only", "--platform=tpu"]) == 0
  out = capsys.readouterr().out
  assert f"platform       tpu (this host: {jax.default_backend()})" in out and "attention      splash\n" in out
  assert "MoE exchange   ragged\n" in out and "CPU kernels    off (not a CPU)" in out
  assert doctor_main([f"--config={GPT2}", "--kernels_only", "--platform=tpu", "--config.runtime.backend=xla_cpu"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err[-1].startswith("error: runtime.backend: 'xla_cpu' runs on the CPU platform")
