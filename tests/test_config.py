"""Config validation: every shipped preset runs; each invalid case names its field."""
import dataclasses
import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import pytest

from tformer_jax import backends
from tformer_jax.config import ConfigError, ModelConfig, default_config, validate
from tformer_jax.nn import Transformer

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[1] / "configs"
SHIPPED = sorted(p for p in CONFIG_DIR.rglob("*.py") if p.name != "__init__.py")


def load(path: pathlib.Path):
  spec = importlib.util.spec_from_file_location(path.stem, path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config()


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(CONFIG_DIR)))
def test_shipped_config_validates_inits_and_runs(path):
  cfg = load(path)
  assert path.read_text().lstrip().lstrip('r').startswith('"""'), \
      "each config needs a docstring (launch command, result)"
  m = validate(cfg, check_paths=False)   # configs naming data that is prepared by hand (chinese_poetry)
  # Shrink depth so the smoke test stays cheap; every other field is as shipped.
  small = m
  small = dataclasses.replace(small, num_layers=min(small.num_layers, 2), dtype="float32")
  if small.moe.num_experts:
    small = dataclasses.replace(small, moe=dataclasses.replace(small.moe, every=1))
  # The shipped runtime section, as this run resolves it (every 'auto' decided here).
  if cfg.runtime.attention == "cudnn" and jax.default_backend() != "gpu":
    cfg.runtime.attention = "xla"  # same semantics; cuDNN needs a GPU
  backend = backends.resolve_runtime(cfg, quiet=True).backend
  model = Transformer(small)
  tok = jnp.zeros((1, 16), jnp.int32)
  # pod-scale presets, and any preset whose two layers alone are wide enough to take tens of seconds here
  # (bench/llama_1b_gpu: ~200M parameters at d_model 2048 and a 32k vocabulary): shapes only (tformer-aot
  # and the GPU check compile and run them at full size)
  if "scale" in path.relative_to(CONFIG_DIR).parts or small.d_model * small.vocab_size > 20_000_000:
    shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0), tok)
    assert jax.eval_shape(model.apply, shapes, tok).shape == (1, 16, m.vocab_size)
    return
  with backends.use(backend):
    out, variables = model.init_with_output(jax.random.PRNGKey(0), tok)
    out = model.apply(variables, tok + 1)
  assert bool(jnp.isfinite(out).all())
  expected_last = m.vocab_size if m.lm_head else m.d_model
  assert out.shape == (1, 16, expected_last)


def with_model(**kw):
  c = default_config()
  for k, v in kw.items():
    node = c
    parts = k.split(".")
    for p in parts[:-1]:
      node = node[p]
    node[parts[-1]] = v
  return c


INVALID = [
    ({"model.d_model": 100, "model.num_heads": 3}, "model.d_model"),
    ({"model.num_heads": 6, "model.num_kv_heads": 4, "model.d_model": 96}, "model.num_kv_heads"),
    ({"model.position": "rotary"}, "model.position"),
    ({"model.norm": "batchnorm"}, "model.norm"),
    ({"model.activation": "tanh"}, "model.activation"),
    ({"model.num_layers": 0}, "model.num_layers"),
    ({"model.vocab_size": -1}, "model.vocab_size"),
    ({"model.position": "rope", "model.rotary_fraction": 0.3}, "model.rotary_fraction"),
    ({"model.resid_dropout": 1.0}, "model.resid_dropout"),
    ({"model.attn_dropout": -0.1}, "model.attn_dropout"),
    ({"model.norm_position": "middle"}, "model.norm_position"),
    ({"model.remat": "some"}, "model.remat"),
    ({"runtime.attention": "flash"}, "runtime.attention"),
    ({"model.dtype": "int8"}, "model.dtype"),
    ({"runtime.cpu_kernels": "on", "model.dtype": "float16"}, "runtime.cpu_kernels"),
    ({"runtime.cpu_kernels": "on", "train.precision": "fp16"}, "runtime.cpu_kernels"),
    ({"runtime.cpu_kernels": "on", "model.param_dtype": "bfloat16"}, "runtime.cpu_kernels"),
    ({"runtime.cpu_kernels": "on", "runtime.backend": "reference"}, "runtime.cpu_kernels"),
    ({"runtime.cpu_kernels": "yes"}, "runtime.cpu_kernels"),
    ({"runtime.backend": "tpu"}, "runtime.backend"),
    ({"runtime.attention_block_q": 0}, "runtime.attention_block_q"),
    ({"runtime.attention_block_k": -4}, "runtime.attention_block_k"),
    ({"model.attn_dropout": 0.1, "runtime.attention": "chunked"}, "runtime.attention"),
    ({"model.position": "t5", "runtime.attention": "blockwise"}, "runtime.attention"),
    ({"model.window": 8, "model.num_global_tokens": 2, "runtime.attention": "chunked"},
     "runtime.attention"),
    ({"model.rope_scaling.type": "yarn", "model.position": "learned"}, "model.rope_scaling.type"),
    ({"model.position": "rope", "model.rope_scaling.type": "magic"}, "model.rope_scaling.type"),
    ({"model.moe.num_experts": 4, "model.moe.top_k": 5}, "model.moe.top_k"),
    ({"model.init_std": 0.0}, "model.init_std"),
    ({"data.seq_len": 1024, "model.max_len": 256}, "data.seq_len"),
    ({"data.batch_size": 0}, "data.batch_size"),
    ({"optim.peak_lr": -1.0}, "optim.peak_lr"),
    ({"optim.schedule": "linear"}, "optim.schedule"),
    ({"optim.grad_accum": 3}, "optim.grad_accum"),
    ({"train.precision": "fp8"}, "train.precision"),
    ({"mesh.shape": (2, -1, -1)}, "mesh.shape"),
    ({"model.norm_position": "post", "model.parallel_residual": True}, "model.parallel_residual"),
]


@pytest.mark.parametrize("overrides,field", INVALID, ids=[f for _, f in INVALID])
def test_invalid_config_names_the_field(overrides, field):
  with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
    validate(with_model(**overrides))


def test_unknown_model_field():
  c = default_config()
  c.model.unlock() if hasattr(c.model, "unlock") else None
  c.model.n_layers = 3
  with pytest.raises(ConfigError, match=r"^model\.n_layers: unknown field; did you mean model\.num_layers"):
    validate(c)


def test_defaults_validate_and_derived_sizes():
  m = validate(default_config())
  assert m.hd == m.d_model // m.num_heads and m.kv_heads == m.num_heads
  assert ModelConfig(activation="swiglu", d_model=256).ff == 688  # 2/3 * 4 * 256 rounded up to 8


def test_vocab_size_follows_the_tokenizer_unless_set_by_hand(tmp_path):
  from tokenizers import Tokenizer, models

  from tformer_jax.config import resolved
  from tformer_jax.train.setup import resolve_model_config
  cfg = default_config()
  assert cfg.model.vocab_size == 0 and resolved(cfg).model.vocab_size == 256          # byte
  cfg.data.tokenizer, cfg.data.bpe_vocab_size = "bpe", 1000
  assert validate(cfg).vocab_size == 1000                                               # the BPE it trains
  tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
  tok.add_special_tokens(["<eos>"])
  tok.save(str(tmp_path / "tokenizer.json"))
  cfg.data.tokenizer = f"hf:{tmp_path}"
  assert resolved(cfg).model.vocab_size == tok.get_vocab_size(with_added_tokens=True) == 4
  cfg.model.vocab_size = 512                                                             # by hand: kept
  assert resolved(cfg).model.vocab_size == 512
  cfg.model.vocab_size = 3                                                               # too small: an error
  with pytest.raises(ConfigError, match=r"^model.vocab_size: 3 is smaller than the tokenizer's vocabulary \(4\)"):
    resolve_model_config(cfg, vocab_size=4)
  with pytest.raises(ConfigError, match="^model.vocab_size: is 0"):
    from tformer_jax.config import validate_model
    validate_model(ModelConfig(vocab_size=0))
