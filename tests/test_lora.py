"""LoRA fine-tuning (train.lora, ops/lora.py): adapters on a frozen HF base. The loss falls; the optimizer
state and the checkpoint hold the adapters only (a small fraction of a full fine-tune's); the merged
export reloads in transformers with our logits; a resumed run is exact; bad targets are one line (the
validator's list is ops.lora's); on a (data=2, fsdp=4) mesh of 8 fake devices the adapters and the base
are sharded by their logical axes and the losses and adapter gradients equal one device's (1e-5);
train.stats_every's statistics are the merged model's."""
import ast
import json
import re

import flax.linen as nn
import hf_utils
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tformer_jax import backends, config as config_lib
from tformer_jax.checkpoint import restore_params
from tformer_jax.cli import convert
from tformer_jax.cli_common import load_named_config
from tformer_jax.config import ConfigError, ModelConfig
from tformer_jax.data import pipeline
from tformer_jax.interop.hf import load_hf
from tformer_jax.nn import Transformer
from tformer_jax.ops import lora as lora_ops
from tformer_jax.parallel import mesh as mesh_lib
from tformer_jax.train import init_from, loop, setup as setup_lib, state as state_lib, step as step_lib
from tformer_jax.train.metrics import read_metrics
from tformer_jax.train.stats import make_stats_fn

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  """A small random Llama (GQA 4/2, tied embeddings) with a byte-level BPE, saved as transformers would."""
  d = tmp_path_factory.mktemp("hf_llama")
  tok = hf_utils.byte_level_bpe(100_000, 300, ["<s>", "</s>"])
  hf_utils.save_tokenizer_files(tok, d, "<s>", "</s>")
  hf_utils.save_llama(d, tok.get_vocab_size(), hidden=64, ffn=128, max_positions=128, tied=True)
  return d


def _cfg(hf_dir, steps: int, rank: int, **over):
  c = load_named_config("finetune_hf")
  c.train.init_from = f"hf:{hf_dir}"
  c.data.seq_len, c.data.batch_size = 32, 8
  c.optim.peak_lr, c.optim.warmup_steps, c.optim.schedule = 3e-2 if rank else 1e-2, 1, "constant"
  # eval at every step: step 1's update has lr 0 (the warmup), so its val_loss is the base model's
  c.train.steps, c.train.log_every, c.train.eval_every, c.train.ckpt_every = steps, 1, 1, 4
  c.train.eval_batches, c.train.sample_tokens = 1, 0
  c.train.lora.rank, c.train.lora.alpha, c.train.lora.targets = rank, 16.0, "q,k,v,o,up,gate,down"
  c.mesh.num_devices = 1
  for k, v in over.items():
    a, b = k.split(".")
    c[a][b] = v
  return c


def _state_bytes(work) -> dict[str, int]:
  """Bytes of the arrays in the latest checkpoint's state, by top-level field (params, opt_state, ...)."""
  steps = sorted(int(p.name) for p in (work / "checkpoints").iterdir() if p.name.isdigit())
  manifest = json.loads((work / "checkpoints" / str(steps[-1]) / "manifest" / "metadata").read_text())
  out: dict[str, int] = {}
  for path, a in manifest["arrays"].items():
    field = path.split("/")[0]
    out[field] = out.get(field, 0) + int(np.prod(a["shape"])) * np.dtype(a["dtype"]).itemsize
  return out


@pytest.fixture(scope="module")
def runs(hf_dir, tmp_path_factory):
  root = tmp_path_factory.mktemp("lora_runs")
  full = loop.train(_cfg(hf_dir, 8, 0), root / "full")
  lora = loop.train(_cfg(hf_dir, 8, 8), root / "lora")
  return root, full, lora


def test_the_validator_takes_exactly_the_targets_of_ops_lora(hf_dir):
  """ops.lora.TARGETS is the one list: the validator names exactly its keys and accepts each of them."""
  c = _cfg(hf_dir, 4, 4)
  c.train.lora.targets = "q,nope"
  with pytest.raises(ConfigError, match=r"^train\.lora\.targets: unknown value 'nope'") as e:
    config_lib.validate(c)
  listed = re.search(r"expected one of (\(.*\))$", str(e.value)).group(1)
  assert ast.literal_eval(listed) == tuple(lora_ops.TARGETS)
  c.train.lora.targets = ",".join(lora_ops.TARGETS)
  config_lib.validate(c)


def test_adapter_axes_follow_their_kernel():
  # a scanned wq (layers, embed, heads, head_dim): A (layers, embed, r), B (layers, r, heads, head_dim)
  assert lora_ops.axes(("layers", "embed", "heads", "head_dim"), 3, 4) == (
      ("layers", "embed", None), ("layers", None, "heads", "head_dim"))
  # an unscanned attention wo (heads, head_dim, embed): A (heads, head_dim, r), B (r, embed)
  assert lora_ops.axes(("heads", "head_dim", "embed"), 3, 2) == (("heads", "head_dim", None), (None, "embed"))


def test_merge_is_base_plus_scaled_product_on_stacked_kernels():
  rng = jax.random.PRNGKey(0)
  params = {"layers": {"attn": {"wq": jnp.ones((3, 8, 2, 4)), "wo": jnp.ones((3, 2, 4, 8))},
                       "mlp": {"wi": jnp.ones((3, 8, 16))}}, "embed": jnp.ones((10, 8))}
  ad = lora_ops.init(rng, params, ("q", "o"), rank=2)
  assert ad["layers"]["attn"]["wq"]["lora_a"].shape == (3, 8, 2)
  assert ad["layers"]["attn"]["wo"]["lora_b"].shape == (3, 2, 8)
  assert "mlp" not in ad["layers"]
  same = lora_ops.merge(params, ad, 4.0)        # B = 0: the base
  np.testing.assert_array_equal(same["layers"]["attn"]["wq"], params["layers"]["attn"]["wq"])
  ad["layers"]["attn"]["wo"]["lora_b"] = jnp.ones((3, 2, 8))
  got = lora_ops.merge(params, ad, 0.5)["layers"]["attn"]["wo"]
  a = ad["layers"]["attn"]["wo"]["lora_a"]
  want = 1.0 + 0.5 * np.einsum("lhdr,lro->lhdo", np.asarray(a), np.ones((3, 2, 8)))
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)


@pytest.mark.parametrize("scan", [True, False], ids=["scanned", "unrolled"])
def test_unmerged_adapters_equal_the_merged_model(scan):
  """What the train step runs, the adapters applied inside each projection (x W + (x A) scale B, the
  'lora' collection), gives the merged model's logits and the same adapter gradients (float32, 1e-5), on
  every target, GQA and a GLU FFN, scanned and unrolled."""
  cfg = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, max_len=16,
                    position="rope", norm="rmsnorm", activation="swiglu", scan_layers=scan)
  model = Transformer(cfg)
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 16), 0, 64)
  params = nn.unbox(model.init(jax.random.PRNGKey(0), tokens)["params"])
  ad = lora_ops.init(jax.random.PRNGKey(2), params, tuple(lora_ops.TARGETS), rank=4)
  ad = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.PRNGKey(3), x.shape), ad)   # B != 0
  scale = 2.0

  def merged(a):
    return model.apply({"params": lora_ops.merge(params, a, scale)}, tokens)

  def unmerged(a):
    return model.apply({"params": params, "lora": lora_ops.scaled(a, scale)}, tokens)

  want, got = jax.jit(merged)(ad), jax.jit(unmerged)(ad)
  assert float(jnp.abs(want - model.apply({"params": params}, tokens)).max()) > 1e-2   # the adapters matter
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  loss = lambda f: lambda a: jnp.mean(jax.nn.log_softmax(f(a))[..., 0])   # noqa: E731
  g_want, g_got = jax.jit(jax.grad(loss(merged)))(ad), jax.jit(jax.grad(loss(unmerged)))(ad)
  for a, b in zip(jax.tree.leaves(g_got), jax.tree.leaves(g_want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(np.abs(b).max()))


def test_bad_lora_fields_are_one_line_errors(hf_dir):
  c = _cfg(hf_dir, 4, 4)
  c.train.lora.targets = "q,x"
  with pytest.raises(ConfigError, match=r"train\.lora\.targets: unknown value 'x'"):
    config_lib.validate(c)
  c = _cfg(hf_dir, 4, 4)
  c.train.init_from = ""
  with pytest.raises(ConfigError, match=r"train\.lora\.rank: .*init_from"):
    config_lib.validate(c)
  # targets that name no kernel of the model (a GELU FFN has no gate): before anything compiles
  c = _cfg(hf_dir, 4, 4)
  c.model.activation, c.train.lora.targets = "gelu", "gate"
  mesh = mesh_lib.make_mesh(c.mesh)
  with pytest.raises(ConfigError, match=r"^train\.lora\.targets: gate match no parameter of this model \(it has: "
                                        r"q,k,v,o,up,down\)$"):
    setup_lib.build(c, mesh, backends.Backend(), vocab_size=256, check_paths=False)


def test_lora_learns_with_a_small_fraction_of_the_state(runs):
  root, full, lora = runs
  val = [m["val_loss"] for m in read_metrics(root / "lora") if "val_loss" in m]
  assert val[-1] < val[0] - 0.05, val        # a random base: 5.682 -> 5.572 when measured
  full_b, lora_b = _state_bytes(root / "full"), _state_bytes(root / "lora")
  # rank 8 on 7 projections of 2 layers, r (in + out) each: 2 x 8 x (128 + 96 + 96 + 128 + 3 x 192) = 16,384
  # float32 adapter parameters against the model's 93,248 (0.176; the 135M model at rank 8 on q,k,v,o: 0.7%)
  assert lora_b["params"] == 16_384 * 4 and full_b["params"] == 93_248 * 4
  assert lora_b["opt_state"] - 2 * lora_b["params"] == full_b["opt_state"] - 2 * full_b["params"]   # AdamW: mu, nu
  assert sum(lora_b.values()) / sum(full_b.values()) < 0.18, (lora_b, full_b)
  assert lora["params"] == full["params"] + 16_384     # the frozen base + the adapters


def test_merged_export_reloads_in_transformers(runs, hf_dir, tmp_path):
  root, _, _ = runs
  cfg, merged = restore_params(root / "lora")
  _, base = load_hf(hf_dir)
  assert cfg.model.scan_layers and "layers" in merged            # trained scanned (the preset), from layers_i
  for name in ("wq", "wo"):     # the adapters moved the targeted kernels; the rest is the base's
    assert np.abs(merged["layers"]["attn"][name][1] - np.asarray(base["layers_1"]["attn"][name])).max() > 1e-3
  np.testing.assert_array_equal(merged["embed"], np.asarray(base["embed"]))
  np.testing.assert_array_equal(merged["layers"]["ln1"]["scale"][0], np.asarray(base["layers_0"]["ln1"]["scale"]))
  out = tmp_path / "export"
  assert convert.main(["--from", str(root / "lora"), "--to-hf", str(out)]) == 0
  tokens = np.arange(40, dtype=np.int32).reshape(2, 20) % 300
  mine = Transformer(ModelConfig.from_config(cfg.model)).apply({"params": merged}, jnp.asarray(tokens))
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  with torch.no_grad():
    theirs = hf_model(torch.as_tensor(tokens).long()).logits.numpy()
  np.testing.assert_allclose(theirs, np.asarray(mine), rtol=1e-4, atol=1e-4)


def test_lora_resume_is_exact(runs, hf_dir, tmp_path):
  root, _, lora = runs
  work = tmp_path / "resumed"
  loop.train(_cfg(hf_dir, 4, 8), work)
  again = loop.train(_cfg(hf_dir, 8, 8), work)
  _, a = restore_params(root / "lora", merge=False)
  _, b = restore_params(work, merge=False)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)
  assert again["loss"] == lora["loss"]


def test_a_relative_base_is_recorded_as_an_absolute_path(hf_dir, monkeypatch):
  """A LoRA run reads its base from config.json's train.init_from: a relative source is recorded
  absolute, so the run reads the same base from any directory."""
  monkeypatch.chdir(hf_dir.parent)
  resolved = init_from.resolve(_cfg(hf_dir.name, 8, 8))
  assert resolved.train.init_from == f"hf:{hf_dir.resolve()}"


def _program_and_state(c):
  """What the loop builds for a LoRA config: the program on its mesh and the state, the base loaded from
  train.init_from onto the base's shardings."""
  c = init_from.resolve(c)
  mesh, backend = mesh_lib.make_mesh(c.mesh), backends.Backend()
  with backends.use(backend):
    program = setup_lib.build(c, mesh, backend)
  frozen = init_from.load_params(c.train.init_from, program.abstract.frozen, program.model_config.num_layers)
  with jax.set_mesh(mesh), nn.logical_axis_rules(program.rules):
    state = state_lib.create_state(program.init, jax.random.PRNGKey(c.train.seed), program.shardings, frozen=frozen)
  return c, program, state


def _losses_and_grads(c, batches):
  """Train-step losses over `batches`, then the loss and the adapters' gradients at the last state (the
  train step's own loss on the merged params, jitted with the program's shardings)."""
  c, program, state = _program_and_state(c)
  options = setup_lib.step_options(c)

  def loss(adapters, frozen, batch):
    params = lora_ops.merge(frozen, adapters, program.lora_scale)
    total, (count, _) = step_lib.loss_sum_fn(program.model, params, batch, None, train=False, **options)
    return total / count

  sh = program.shardings
  grad_fn = jax.jit(mesh_lib.traced_under(jax.value_and_grad(loss), program.mesh, program.rules),
                    in_shardings=(sh.params, sh.frozen, program.batch_sharding))
  put = [{k: jax.device_put(v, program.batch_sharding) for k, v in b.items()} for b in batches]
  losses = []
  with backends.use(backends.Backend()):
    for b in put[:-1]:
      state, metrics = program.train_step(state, b)
      losses.append(float(metrics["loss"]))
    value, grads = grad_fn(state.params, state.frozen, put[-1])
  return program, state, losses, float(value), jax.device_get(grads)


def _spec(x) -> tuple:
  spec = tuple(x.sharding.spec)
  return spec + (None,) * (x.ndim - len(spec))


def test_lora_on_a_data_fsdp_mesh_equals_one_device(hf_dir):
  """(data=2, fsdp=4) on 8 fake devices: the adapters (and their AdamW moments) sharded after their kernel's
  logical axes ('embed' over fsdp), the base like the params; losses of 3 steps, then the loss and every
  adapter gradient, equal one device's within 1e-5."""
  rng = np.random.default_rng(0)
  batches = [{"inputs": t[:, :-1], "targets": t[:, 1:]} for t in
             (rng.integers(0, 300, (8, 33)).astype(np.int32) for _ in range(4))]
  one = _losses_and_grads(_cfg(hf_dir, 4, 8), batches)
  mesh_over = {"mesh.num_devices": 8, "mesh.shape": (2, 4, 1), "mesh.rules": "fsdp"}
  eight = _losses_and_grads(_cfg(hf_dir, 4, 8, **mesh_over), batches)
  program, state = eight[:2]
  assert dict(program.mesh.shape) == {"data": 2, "fsdp": 4, "tensor": 1}
  wq, mlp_wo = state.params["layers"]["attn"]["wq"], state.params["layers"]["mlp"]["wo"]
  assert _spec(wq["lora_a"]) == (None, "fsdp", None) and _spec(wq["lora_b"]) == (None, None, None, None)
  assert _spec(mlp_wo["lora_a"]) == (None, None, None) and _spec(mlp_wo["lora_b"]) == (None, None, "fsdp")
  assert _spec(state.frozen["layers"]["attn"]["wq"]) == (None, "fsdp", None, None)
  assert _spec(state.opt_state[1][0].mu["layers"]["attn"]["wq"]["lora_a"]) == (None, "fsdp", None)
  np.testing.assert_allclose(eight[2], one[2], rtol=1e-5)
  np.testing.assert_allclose(eight[3], one[3], rtol=1e-5)
  assert all(np.abs(g).max() > 0 for g in jax.tree.leaves(one[4]))   # B != 0 by now: A gets gradients too
  for a, b in zip(jax.tree.leaves(eight[4]), jax.tree.leaves(one[4])):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())


def test_lora_stats_are_the_merged_models(hf_dir, tmp_path):
  """A LoRA run with train.stats_every writes the statistics of the merged model: at step 2 (computed on the
  state after one update, before the second) they equal make_stats_fn on step 1's merged params and the
  second batch; update_ratio is the merged weights' change, 0 where no adapter is."""
  work = tmp_path / "stats"
  c = _cfg(hf_dir, 2, 8, **{"train.stats_every": 2, "train.ckpt_every": 1, "train.max_to_keep": 2,
                             "train.eval_every": 2, "optim.warmup_steps": 0})
  loop.train(c, work)
  got = next(m for m in read_metrics(work) if m["step"] == 2 and "stats/loss" in m)
  got = {k.removeprefix("stats/"): v for k, v in got.items() if k.startswith("stats/")}
  assert all(np.isfinite(v) for v in got.values()), got
  run_cfg, merged = restore_params(work, step=1)
  it = pipeline.train_iterator(pipeline.build_dataset(run_cfg.data), run_cfg.data)
  next(it)
  batch = {k: jnp.asarray(v) for k, v in next(it).items()}
  model = Transformer(ModelConfig.from_config(run_cfg.model))
  want = jax.device_get(jax.jit(make_stats_fn(model))(jax.tree.map(jnp.asarray, merged), batch))
  assert set(want) < set(got) and "attn_entropy/layer_1" in want
  np.testing.assert_allclose([got[k] for k in want], [float(want[k]) for k in want], rtol=1e-5, atol=1e-6)
  assert got["update_ratio/embed"] == 0 and got["update_ratio/layers_0/attn"] > 0 and got["lora/grad_norm"] > 0


@pytest.mark.parametrize("rank,remat", [(8, "none"), (8, "full"), (8, "save_mlp_in"), (0, "full")])
def test_step_flops_formula_matches_the_compiled_step(hf_dir, rank, remat):
  """analysis.flops.finetune_flops, the count the fine-tuning benchmark reports: within 2% of the matmul FLOPs in
  the compiled train step's HLO (aot.hlo_matmul_flops), for LoRA over the frozen base (no weight gradients of
  the base, the adapters' products, the recompute) and for a full fine-tune under remat 'full' (which does not
  rerun the FFN's output projection). The formula counts the norms' scales as matmul weights (~0.3% here)."""
  from tformer_jax import aot  # noqa: PLC0415
  from tformer_jax.analysis import flops  # noqa: PLC0415
  c = _cfg(hf_dir, 2, rank, **{"model.remat": remat})
  c.runtime.attention = "xla"   # the dense kernel: the formula's 'full' attention term
  c = init_from.resolve(c)
  mesh, backend = mesh_lib.make_mesh(c.mesh), backends.Backend()
  with backends.use(backend):
    program = setup_lib.build(c, mesh, backend)
    state = jax.eval_shape(lambda: state_lib.create_state(program.init, jax.random.PRNGKey(0), None))
    batch = {k: jax.ShapeDtypeStruct((8, 32), jnp.int32, sharding=program.batch_sharding)
             for k in ("inputs", "targets")}
    hlo = aot.hlo_matmul_flops(program.train_step.lower(state, batch).compile().as_text())
  adapters = state_lib.param_count(state.params) if rank else 0
  assert (adapters > 0) == bool(rank)
  want = flops.finetune_flops(program.model_config, 8, 32, adapter_params=adapters)
  assert want["frozen_base"] == bool(rank)
  assert hlo == pytest.approx(want["executed"], rel=0.02), (hlo, want)
