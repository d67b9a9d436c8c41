"""HF export of every shipped causal preset and of the default experiment, as a user runs it:
a training workdir -> `scripts/convert.py --from WORKDIR --to-hf OUT` without --family -> transformers'
from_pretrained gives our logits. Presets are shrunk (d_model = 8 x heads, 2 layers, short context,
small experts) with every architectural choice kept; parameters are random (norm scales and biases
too). An architecture no family holds is refused in one line naming the architectural field.

Tolerance: rtol = atol = 1e-4 on float32 logits (as tests/test_hf_interop.py)."""
from __future__ import annotations

import importlib.util
import json
import pathlib

import numpy as np
import pytest

pytestmark = pytest.mark.reference
transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from tformer_jax.checkpoint import Checkpointer  # noqa: E402
from tformer_jax.config import load_config_file, resolved, validate  # noqa: E402
from tformer_jax.interop import hf as hfi  # noqa: E402
from tformer_jax.interop.hf import HFConfigError  # noqa: E402
from tformer_jax.nn import Transformer  # noqa: E402

TOL = dict(rtol=1e-4, atol=1e-4)
ROOT = pathlib.Path(__file__).resolve().parents[1]
# Every shipped causal preset (shakespeare_char is the default experiment) and the family it gets.
CAUSAL_PRESETS = {"gpt2_tiny": "gpt2", "llama_tiny": "llama", "mixtral_tiny": "mixtral",
                  "bloom_alibi": "bloom", "shakespeare_char": "llama"}
# Fields that do not change the function or the parameter layout; never named in an export error.
NOT_ARCHITECTURE = ("dtype", "param_dtype", "scan_layers", "remat", "mlp_ratio", "init_std", "dropout",
                    "scale_residual_init", "runtime")


def _convert_module():
  spec = importlib.util.spec_from_file_location("tformer_convert", ROOT / "scripts" / "convert.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


convert = _convert_module()


def shrunk(name: str, **model_overrides):
  """The preset's config with its sizes cut down (architecture kept) and `model_overrides` set."""
  cfg = resolved(load_config_file(ROOT / "configs" / f"{name}.py"))   # vocab_size 0: the tokenizer's
  m = cfg.model
  m.d_model, m.num_layers, m.max_len = 8 * m.num_heads, 2, min(m.max_len, 64)
  if m.moe.num_experts:
    m.moe.d_ff = 24
  for k, v in model_overrides.items():
    m[k] = v
  cfg.data.seq_len = min(cfg.data.seq_len, 32)
  return cfg


def random_params(model: Transformer, seed: int = 0) -> dict:
  """Initialised params plus noise on every leaf, so norm scales and biases are not 1s and 0s (one jitted
  program: one compile, not one per eager op)."""
  @jax.jit
  def make():
    params = nn.unbox(model.init(jax.random.PRNGKey(seed), jnp.zeros((1, 8), jnp.int32))["params"])
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(seed + 1), len(leaves))
    return jax.tree.unflatten(tree, [x + 0.05 * jax.random.normal(k, x.shape, x.dtype)
                                     for x, k in zip(leaves, keys)])
  return make()


def make_workdir(cfg, params, work: pathlib.Path) -> pathlib.Path:
  """A training workdir as scripts/train.py leaves it: config.json + a checkpoint with the params."""
  work.mkdir(parents=True)
  (work / "config.json").write_text(cfg.to_json_best_effort(indent=2) + "\n")
  ckpt = Checkpointer(work / "checkpoints")
  try:
    ckpt.save(1, {"params": params}, None, {}, force=True)
    ckpt.wait()
  finally:
    ckpt.close()
  return work


def tokens(vocab: int, length: int = 12, b: int = 2) -> np.ndarray:
  return np.random.RandomState(1).randint(0, vocab, (b, length)).astype(np.int32)


@pytest.mark.parametrize("preset", sorted(CAUSAL_PRESETS))
def test_causal_preset_exports_without_family(preset, tmp_path):
  cfg = shrunk(preset)
  model = Transformer(validate(cfg))
  params = random_params(model)
  work = make_workdir(cfg, params, tmp_path / "work")
  assert convert.main(["--from", str(work), "--to-hf", str(tmp_path / "hf")]) == 0
  assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == CAUSAL_PRESETS[preset]
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").float().eval()
  x = tokens(model.cfg.vocab_size)
  with torch.no_grad():
    ref = hf_model(torch.tensor(x)).logits.numpy()
  got = np.asarray(jax.jit(model.apply)({"params": params}, x))
  np.testing.assert_allclose(got, ref, **TOL)
  print(f"{preset} -> {CAUSAL_PRESETS[preset]}: max|diff| {np.abs(got - ref).max():.1e}")


def test_execution_fields_never_block_export(tmp_path):
  """Scanned layers, remat, dropout and init choices: still llama, with the same logits."""
  cfg = shrunk("llama_tiny", scan_layers=True, remat="full", attn_dropout=0.1, resid_dropout=0.1,
               embed_dropout=0.1, init_std=0.05, scale_residual_init=False)
  m = validate(cfg)
  assert hfi.infer_family(m) == "llama"
  model = Transformer(m)
  params = random_params(model)
  hfi.save_hf(model, params, tmp_path / "hf")
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").float().eval()
  x = tokens(m.vocab_size)
  with torch.no_grad():
    ref = hf_model(torch.tensor(x)).logits.numpy()
  np.testing.assert_allclose(np.asarray(jax.jit(model.apply)({"params": params}, x)), ref, **TOL)


def _assert_one_line_naming(msg: str, field: str) -> None:
  assert "\n" not in msg, msg
  assert f"model.{field}=" in msg, msg
  named = msg.split(":")[0]                       # the fields the error leads with
  assert not any(f in named for f in NOT_ARCHITECTURE), msg


def test_unrepresentable_architecture_names_the_field(tmp_path, capsys):
  """RoPE + RMSNorm + a plain GELU MLP: llama needs a gated MLP, gpt_neox a LayerNorm."""
  cfg = shrunk("shakespeare_char", activation="gelu_tanh", scan_layers=True, remat="full", dtype="bfloat16")
  m = validate(cfg)
  with pytest.raises(HFConfigError) as e:
    hfi.infer_family(m)
  msg = str(e.value)
  _assert_one_line_naming(msg, "activation")
  assert msg.startswith("model.activation='gelu_tanh' with position='rope' and norm='rmsnorm': ")
  assert "llama" in msg and "swiglu" in msg and "gpt_neox" in msg
  with pytest.raises(HFConfigError, match=r"^llama cannot represent model\.activation='gelu_tanh'"):
    hfi.hf_config_from_model(m, "llama")

  work = make_workdir(cfg, random_params(Transformer(m)), tmp_path / "work")
  assert convert.main(["--from", str(work), "--to-hf", str(tmp_path / "hf")]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith("error: model.activation='gelu_tanh'"), err
  assert not (tmp_path / "hf").exists()


def test_mixtral_family_needs_every_layer_moe():
  """A dense layer between MoE layers (moe.every=2) has no Mixtral form: refused naming moe."""
  assert hfi.infer_family(validate(shrunk("mixtral_tiny"))) == "mixtral"
  cfg = shrunk("mixtral_tiny")
  cfg.model.moe.every = 2
  with pytest.raises(HFConfigError) as e:
    hfi.infer_family(validate(cfg))
  _assert_one_line_naming(str(e.value), "moe")


def test_encoder_preset_is_refused_in_one_line(tmp_path, capsys):
  cfg = shrunk("bert_postln")
  m = validate(cfg)
  work = make_workdir(cfg, random_params(Transformer(m)), tmp_path / "work")
  assert convert.main(["--from", str(work), "--to-hf", str(tmp_path / "hf")]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith("error: model.") and "no Hugging Face family" in err, err


def test_convert_errors_are_one_line(tmp_path, capsys):
  assert convert.main(["--from", str(tmp_path / "nowhere"), "--to-hf", str(tmp_path / "hf")]) == 2
  assert convert.main(["--from-hf", str(tmp_path / "nowhere"), "--to", str(tmp_path / "work")]) == 2
  errs = capsys.readouterr().err.splitlines()
  assert len(errs) == 2 and all(e.startswith("error: ") and "nowhere" in e for e in errs), errs

