"""LoRA fine-tuning (train.lora, ops/lora.py): adapters on a frozen HF base. The loss falls; the optimizer
state and the checkpoint hold the adapters only (a small fraction of a full fine-tune's); the merged
export reloads in transformers with our logits; a resumed run is exact; bad targets are one line."""
import json

import hf_utils
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tformer_jax import backends, config as config_lib
from tformer_jax.checkpoint import restore_params
from tformer_jax.cli import convert
from tformer_jax.cli_common import load_config_file
from tformer_jax.config import ConfigError, ModelConfig
from tformer_jax.interop.hf import load_hf
from tformer_jax.nn import Transformer
from tformer_jax.ops import lora as lora_ops
from tformer_jax.parallel import mesh as mesh_lib
from tformer_jax.train import init_from, loop, setup as setup_lib
from tformer_jax.train.metrics import read_metrics

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
  c = load_config_file("finetune_hf")
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


def test_targets_are_one_list():
  assert config_lib.LORA_TARGETS == tuple(lora_ops.TARGETS)


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
