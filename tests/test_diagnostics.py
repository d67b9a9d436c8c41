"""Diagnostics: attention maps and flags, training-time statistics, the memory/FLOPs estimator against
XLA's compiled analysis, the heatmap/ablation commands on tiny configs, and the one command-line
syntax (tformer_jax/cli_common/: --config=FILE --config.a.b=v)."""
import contextlib
import importlib.util
import json
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tformer_jax import backends, cli_common
from tformer_jax.analysis import estimate
from tformer_jax.config import ModelConfig, default_config
from tformer_jax.diagnostics import ablate, attention_maps
from tformer_jax.nn import Transformer
from tformer_jax.train import optim, precision, state as state_lib, stats, step as step_lib
from tformer_jax.train.loop import train
from tformer_jax.train.metrics import read_metrics

from train_utils import tiny_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=4, max_len=32)


def _script(name):
  spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def _init(m: ModelConfig, length: int = 12):
  model = Transformer(m)
  tok = jax.random.randint(jax.random.PRNGKey(1), (2, length), 0, m.vocab_size)
  return model, nn.unbox(jax.jit(model.init)(jax.random.PRNGKey(0), tok)["params"]), tok


# ----------------------------------------------------------------------------------- attention maps


@pytest.mark.parametrize("extra,run_attention", [({}, None), ({"scan_layers": True}, None),
                                                  ({}, "blockwise")])
def test_attention_weights_per_layer_rows_and_causality(extra, run_attention):
  model, params, tok = _init(ModelConfig(**TINY, **extra))
  # the weights come out whatever backend the run traces under (attention_maps uses the reference one)
  run = backends.use(backends.Backend(attention_impl=run_attention)) if run_attention else contextlib.nullcontext()
  with run:
    ws = jax.jit(lambda p, t: attention_maps.attention_weights(model, p, t))(params, tok)
  assert len(ws) == 2 and all(w.shape == (2, 4, 12, 12) for w in ws)
  for w in ws:
    np.testing.assert_allclose(np.sum(w, -1), 1.0, atol=1e-5)
    assert float(jnp.max(jnp.triu(w, k=1))) == 0.0          # no weight on future keys


def test_attention_weights_equal_the_reference_computation():
  m = ModelConfig(**{**TINY, "num_layers": 1}, position="none", norm="rmsnorm")
  model, params, tok = _init(m)
  (w,) = jax.jit(lambda p, t: attention_maps.attention_weights(model, p, t))(params, tok)

  @jax.jit                                              # the reference: one program, not op by op
  def reference(params, tok):
    x = jnp.take(params["embed"], tok, axis=0)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + m.norm_eps) * params["layers_0"]["ln1"]["scale"]
    p = params["layers_0"]["attn"]
    q, k = jnp.einsum("bld,dhk->blhk", x, p["wq"]), jnp.einsum("bld,dhk->blhk", x, p["wk"])
    logits = jnp.einsum("blhk,bshk->bhls", q, k) / np.sqrt(m.hd)
    logits = jnp.where(jnp.tril(jnp.ones((12, 12), bool)), logits, -jnp.inf)
    return jax.nn.softmax(logits, -1)

  np.testing.assert_allclose(w, reference(params, tok), atol=1e-5)


def test_entropy_collapse_and_blur_flags():
  l = 6
  vis = jnp.tril(jnp.ones((1, l, l), bool))
  onehot = jnp.broadcast_to(jnp.eye(l)[None, None], (1, 1, l, l))           # all weight on itself
  uniform = (vis / jnp.sum(vis, -1, keepdims=True))[:, None]
  rows = attention_maps.summarize([jnp.concatenate([onehot, uniform], axis=1)], vis)
  collapsed, blurred = rows
  assert collapsed["collapse"] and not collapsed["blur"] and collapsed["entropy"] == pytest.approx(0.0, abs=1e-6)
  assert blurred["blur"] and not blurred["collapse"]
  expected = np.mean([np.log(n) for n in range(2, l + 1)])                 # queries seeing >= 2 keys
  assert blurred["entropy"] == pytest.approx(expected, rel=1e-5)
  assert blurred["entropy_ratio"] == pytest.approx(1.0, rel=1e-5)


def test_attention_map_script_writes_pngs_and_summary(tmp_path, capsys):
  rc = _script("attention_map").main([
      f"--config={ROOT / 'configs' / 'gpt2_tiny.py'}", "--random_init", "--text", "To be, or not",
      "--out", str(tmp_path), "--config.model.num_layers=2", "--config.model.d_model=64"])
  assert rc == 0
  assert sorted(p.name for p in tmp_path.glob("*.png")) == ["layer_0.png", "layer_1.png"]
  assert (tmp_path / "layer_0.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["num_layers"] == 2 and len(summary["heads"]) == 2 * 4 and len(summary["tokens"]) == 13
  assert summary["blurred_heads"] == 8            # random init: near-uniform attention everywhere
  assert "entropy" in capsys.readouterr().out


# ------------------------------------------------------------------------------- training statistics


def test_stats_update_ratio_matches_the_real_step():
  m = ModelConfig(**TINY)
  model = Transformer(m)
  c = default_config()
  c.optim.warmup_steps = 0
  tx, schedule = optim.make_optimizer(c.optim, 10)
  init = state_lib.init_fn(model, tx, precision.get_policy("float32").initial_loss_scale(), 16)
  state = jax.jit(lambda r: state_lib.unbox_plain(init(r)))(jax.random.PRNGKey(0))
  tok = jax.random.randint(jax.random.PRNGKey(2), (4, 17), 0, 64)
  batch = {"inputs": tok[:, :-1], "targets": tok[:, 1:]}
  fn = jax.jit(stats.make_stats_fn(model, tx))
  predicted = fn(state, batch)
  before = state.params
  new_state, metrics = jax.jit(step_lib.make_train_step(model, tx, schedule, c.optim))(state, batch)
  delta = jax.tree.map(jnp.subtract, new_state.params, before)
  d2, p2 = stats.group_sq_norms(delta), stats.group_sq_norms(before)
  measured = {f"update_ratio/{k}": np.sqrt(float(d2[k]) / float(p2[k])) for k in d2}
  measured["update_ratio"] = np.sqrt(sum(map(float, d2.values())) / sum(map(float, p2.values())))
  assert float(predicted["loss"]) == pytest.approx(float(metrics["loss"]), rel=1e-5)
  assert float(predicted["grad_norm"]) == pytest.approx(float(metrics["grad_norm"]), rel=1e-4)
  for key in ("update_ratio", "update_ratio/layers_0/attn", "update_ratio/embed", "update_ratio/pos_embed"):
    assert float(predicted[key]) == pytest.approx(float(measured[key]), rel=1e-3), key
  assert float(predicted["pos_embed_grad_norm"]) > 0
  for i in range(2):
    assert float(predicted[f"act_std/layer_{i}"]) > 0
    assert 0 < float(predicted[f"attn_entropy_ratio/layer_{i}"]) <= 1.0 + 1e-6
  # per-module norms add up to the global one
  g2 = sum(float(v) ** 2 for k, v in predicted.items() if k.startswith("grad_norm/"))
  assert np.sqrt(g2) == pytest.approx(float(predicted["grad_norm"]), rel=1e-4)


def test_stats_scanned_layers_are_split_per_layer():
  model, params, tok = _init(ModelConfig(**TINY, scan_layers=True, position="rope"))
  out = jax.jit(stats.make_stats_fn(model))(params, {"inputs": tok, "targets": tok}, prev_params=params)
  assert {"grad_norm/layers_0/attn", "grad_norm/layers_1/mlp", "act_rms/layer_1", "attn_entropy/layer_1"} <= set(out)
  assert "pos_embed_grad_norm" not in out and float(out["update_ratio/layers_1/attn"]) == 0.0


def test_stats_written_to_metrics_jsonl_every_n_steps(tmp_path):
  train(tiny_config(steps=4, **{"train.stats_every": 2, "train.log_every": 2}), tmp_path)
  rows = [r for r in read_metrics(tmp_path) if any(k.startswith("stats/") for k in r)]
  assert [r["step"] for r in rows] == [2, 4]
  keys = set(rows[0])
  for k in ("stats/act_std/layer_0", "stats/attn_entropy/layer_1", "stats/grad_norm/layers_1/mlp",
            "stats/update_ratio/layers_0/attn", "stats/loss"):
    assert k in keys, k
  assert all(np.isfinite(v) for v in rows[-1].values())
  assert list((tmp_path / "tb").iterdir())


# ------------------------------------------------------------------------------------------ estimator


def test_kv_cache_example_from_the_article():
  # 32 heads x 4096 tokens x 128 head_dim x 2 (K, V) x 2 bytes = 64 MiB per layer (batch 1, fp16)
  assert estimate.kv_cache_bytes(1, 1, 4096, 32, 128, 2) == 64 * 2 ** 20
  assert estimate.kv_cache_bytes(32, 1, 4096, 8, 128, 2) == 32 * 16 * 2 ** 20     # GQA 8 KV heads: 1/4


@pytest.mark.parametrize("kw", [TINY, dict(TINY, activation="swiglu", norm="rmsnorm", num_kv_heads=2,
                                           tie_embeddings=False, qkv_bias=True),
                                dict(TINY, scan_layers=True, position="t5", type_vocab_size=2, mlp_bias=True)])
def test_parameter_count_is_exact(kw):
  m = ModelConfig(**kw)
  # the shapes the model's init makes (traced, not run: a count needs no values)
  params = jax.eval_shape(Transformer(m).init, jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))["params"]
  assert estimate.param_count(m) == sum(x.size for x in jax.tree.leaves(nn.unbox(params)))


# The estimate against XLA's compiled analysis (dense, MoE dropless and capacity), the runtime it models
# and the command: tests/test_estimate.py.


# ------------------------------------------------------------------------------------------- ablation


def test_sweeps_parse_and_expand():
  assert ablate.parse_sweep("model.num_heads=1,4,8") == ("model.num_heads", ["1", "4", "8"])
  assert ablate.parse_sweep("model.position=none,rope") == ("model.position", ["none", "rope"])
  combos = ablate.grid([("a.x", [1, 2]), ("b.y", ["p", "q"])])
  assert combos == [{"a.x": 1, "b.y": "p"}, {"a.x": 1, "b.y": "q"}, {"a.x": 2, "b.y": "p"}, {"a.x": 2, "b.y": "q"}]
  with pytest.raises(ValueError):
    ablate.parse_sweep("model.num_heads")


def test_override_parses_text_by_the_field_type():
  base = default_config()
  cfg = cli_common.override(base, {"model.d_model": "64", "optim.peak_lr": "1e-2", "model.scan_layers": "true",
                                   "mesh.shape": "(2, 2, 1)", "model.position": "rope", "train.steps": 7})
  assert (cfg.model.d_model, cfg.optim.peak_lr, cfg.model.scan_layers) == (64, 0.01, True)
  assert cfg.mesh.shape == (2, 2, 1) and cfg.model.position == "rope" and cfg.train.steps == 7
  assert base.model.d_model != 64                               # a copy: the base is unchanged
  for bad in ({"model.d_modl": "64"}, {"model.d_model": "sixty"}, {"model.nope": 1}):
    with pytest.raises(cli_common.UsageError):
      cli_common.override(base, bad)


def test_cli_applies_overrides_and_rejects_unknown_fields(capsys):
  def define(fv):
    from absl import flags
    flags.DEFINE_integer("steps", 3, "steps", flag_values=fv)
  cfg_file = str(ROOT / "configs" / "gpt2_tiny.py")
  args = cli_common.parse(["--config.model.d_model=64", "--steps=5", f"--config={cfg_file}",
                           "--config.model.remat", "full"], define, config="required")
  assert (args.config.model.d_model, args.config.model.remat, args.steps) == (64, "full", 5)
  assert args.overrides == {"model.d_model": 64, "model.remat": "full"} and args.config_file == cfg_file
  again = cli_common.parse([f"--config={cfg_file}"], define, config="required")   # a fresh parse each call
  assert again.config.model.d_model != 64 and again.steps == 3
  for argv, needle in [([f"--config={cfg_file}", "--config.model.num_layer=2"], "did you mean model.num_layers?"),
                       ([f"--config={cfg_file}", "--config.model.num_layers=x"], "num_layers=x"),
                       ([f"--config={cfg_file}", "stray"], "unexpected arguments: stray"),
                       (["--config.model.num_layers=2"], "pass --config=")]:
    with pytest.raises(SystemExit) as e:
      cli_common.parse(argv, define, config="required")
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err and len(err.strip().splitlines()) == 1, err


def test_workdir_config_json_then_overrides(tmp_path):
  saved = default_config()
  saved.model.d_model, saved.mesh.shape = 48, (1, 1, 1)
  saved_dict = saved.to_dict()
  saved_dict["model"]["attention_impl"] = "chunked"          # a field older versions kept: skipped
  (tmp_path / "config.json").write_text(json.dumps(saved_dict))

  def define(fv):
    from absl import flags
    flags.DEFINE_string("workdir", None, "run", flag_values=fv)
  args = cli_common.parse([f"--workdir={tmp_path}", "--config.model.num_layers=3"], define, config=True,
                          from_workdir=True)
  assert (args.config.model.d_model, args.config.model.num_layers, args.config.mesh.shape) == (48, 3, (1, 1, 1))
  assert args.config_file == str(tmp_path / "config.json")


def test_ablate_script_writes_table_json_and_curves(tmp_path, capsys):
  rc = _script("ablate").main([
      "--config.model.vocab_size=18", f"--config={ROOT / 'configs' / 'shakespeare_char.py'}",
      "--sweep", "model.position=none,rope",
      "--steps", "4", "--out", str(tmp_path),
      "--config.data.corpus=synthetic:reverse", "--config.data.seq_len=16",
      "--config.data.batch_size=8", "--config.model.d_model=32", "--config.model.num_layers=1",
      "--config.model.max_len=16", "--config.train.eval_batches=1", "--config.optim.warmup_steps=1"])
  assert rc == 0
  rows = json.loads((tmp_path / "results.json").read_text())
  assert [r["name"] for r in rows] == ["position=none", "position=rope"]
  assert [r["overrides"] for r in rows] == [{"model.position": "none"}, {"model.position": "rope"}]
  for r in rows:
    assert r["steps"] == 4 and np.isfinite(r["val_loss"]) and 0.0 <= r["exact_match"] <= 1.0
    assert len(r["curves"]["loss"]) == 4 and r["wall_s"] > 0
  md = (tmp_path / "results.md").read_text()
  assert "| position=rope |" in md and "exact match" in md
  assert (tmp_path / "loss_curves.png").read_bytes()[:4] == b"\x89PNG"
  assert "position=none" in capsys.readouterr().out
