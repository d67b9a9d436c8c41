"""Long context at the model level: blockwise/chunked/xla attention inside a whole Transformer (run
under a backend, tformer_jax/backends) equal the reference backend (logits and parameter gradients,
float32, 1e-5), 'cudnn' without a GPU fails clearly, runtime 'auto' picks an exact attention for the
config (backends.resolve_runtime), every RoPE scaling runs end to end past max_len, and the
extrapolation experiment's pieces work."""
import dataclasses
import functools
import json
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tformer_jax import backends
from tformer_jax.backends.cpu import kernels as cpu_kernel
from tformer_jax.config import ConfigError, ModelConfig, RopeScaling, default_config, validate_model
from tformer_jax.nn import Transformer

TOL = 1e-5
B, L = 2, 23  # 23 is not a multiple of the 8 x 4 blocks: the ragged last tiles are exercised


def _cfg(**kw) -> ModelConfig:
  base = dict(vocab_size=61, d_model=32, num_layers=1, num_heads=4, num_kv_heads=2, max_len=64,
              position="rope", norm="rmsnorm", activation="swiglu")
  base.update(kw)
  m = ModelConfig(**base)
  validate_model(m)
  return m


BLOCKS = dict(block_q=8, block_k=4)
# Attention implementations under test, each as the backend that runs it. 'chunked_cpu': the xla_cpu
# backend with its C++ kernels (chunked attention as the C++ kernel, C++ weight-gradient matmul).
BACKENDS = {
    "blockwise": lambda: backends.Backend(attention_impl="blockwise", **BLOCKS),
    "chunked": lambda: backends.Backend(attention_impl="chunked", **BLOCKS),
    "chunked_cpu": lambda: backends.XlaCpuBackend(attention_impl="chunked", cpu_kernels=True, **BLOCKS),
}


def _runtime_cfg(m: ModelConfig, precision: str = "float32", **runtime):
  """A full config whose runtime-relevant model fields are m's (what resolve_runtime reads)."""
  c = default_config()
  for name in ("attn_dropout", "position", "window", "num_global_tokens", "dtype", "param_dtype"):
    c.model[name] = getattr(m, name)
  c.train.precision = precision
  c.runtime.update(runtime)
  return c


def _tokens(seed: int = 0, length: int = L) -> jax.Array:
  return jax.random.randint(jax.random.PRNGKey(seed), (B, length), 0, 61)


def _init(m: ModelConfig, length: int = L):
  init = jax.jit(Transformer(m).init)                  # one compile, not op-by-op eager init
  return nn.unbox(init(jax.random.PRNGKey(0), jnp.zeros((1, length), jnp.int32))["params"])


def _logits_and_grads(m: ModelConfig, params, tokens, mask=None, backend=None):
  """Logits and d(sum(logits * w))/dparams for a fixed random w (so every logit's gradient counts),
  traced under `backend` (default: the reference backend)."""
  model = Transformer(m)
  w = jax.random.normal(jax.random.PRNGKey(7), tokens.shape + (m.vocab_size,))

  def f(p):
    logits = model.apply({"params": p}, tokens, attention_mask_BxL=mask)
    return jnp.sum(logits * w), logits

  with backends.use(backend or backends.Backend()):   # a fresh f: traced here, under this backend
    (_, logits), grads = jax.jit(jax.value_and_grad(f, has_aux=True))(params)
  return np.asarray(logits), jax.device_get(grads)


def _real_only(m: ModelConfig, params, tokens, mask, backend=None):
  """Like _logits_and_grads, but padding positions get zero logits and no gradient: a padding query
  sees no key, which the reference and blockwise paths answer with zeros and jax.nn's XLA path with a
  uniform average (a don't-care value either way)."""
  model = Transformer(m)
  w = jax.random.normal(jax.random.PRNGKey(7), tokens.shape + (m.vocab_size,)) * mask[..., None]

  def f(p):
    logits = model.apply({"params": p}, tokens, attention_mask_BxL=mask) * mask[..., None]
    return jnp.sum(logits * w), logits

  with backends.use(backend or backends.Backend()):
    (_, logits), grads = jax.jit(jax.value_and_grad(f, has_aux=True))(params)
  return np.asarray(logits), jax.device_get(grads)


def _forward(m: ModelConfig, params, tokens, backend=None):
  """Logits of m under `backend` (default: the reference), from a fresh jitted function."""
  with backends.use(backend or backends.Backend()):
    return np.asarray(jax.jit(lambda p, t: Transformer(m).apply({"params": p}, t))(params, tokens))


def _assert_same(a, b):
  la, ga = a
  lb, gb = b
  np.testing.assert_allclose(la, lb, rtol=TOL, atol=TOL)
  flat_a = jax.tree_util.tree_flatten_with_path(ga)[0]
  flat_b = jax.tree.leaves(gb)
  assert len(flat_a) == len(flat_b)
  for (path, x), y in zip(flat_a, flat_b):
    scale = max(1.0, float(np.max(np.abs(x))))
    np.testing.assert_allclose(x, y, rtol=TOL, atol=TOL * scale, err_msg=jax.tree_util.keystr(path))


PAD = 6
# Row 0 is unpadded, row 1 left-padded by PAD tokens: every case covers plain causal and padded rows.
MASK = jnp.asarray(np.arange(L)[None, :] >= np.array([[0], [PAD]]), jnp.int32)
CASES = {
    "rope_gqa": dict(position="rope"),
    "alibi": dict(position="alibi", num_kv_heads=0),
    "window5": dict(position="rope", window=5),
}


_REFERENCE: dict = {}


def _case_reference(name: str):
  """CASES[name]'s config, params, tokens and reference logits/gradients: computed once, shared by the
  three implementations compared against them."""
  if name not in _REFERENCE:
    ref = _cfg(**CASES[name])
    params, tokens = _init(ref), _tokens()
    _REFERENCE[name] = (ref, params, tokens, _logits_and_grads(ref, params, tokens, MASK))
  return _REFERENCE[name]


@pytest.mark.parametrize("impl", list(BACKENDS))
@pytest.mark.parametrize("name", list(CASES))
def test_blockwise_model_matches_reference(name, impl):
  ref, params, tokens, want = _case_reference(name)
  blk = BACKENDS[impl]()
  got = _logits_and_grads(ref, params, tokens, MASK, backend=blk)
  assert np.all(np.isfinite(got[0]))
  _assert_same(got, want)
  if name == "rope_gqa":  # padding is invisible: row 1's real tokens equal the unpadded sequence
    alone = _forward(ref, params, tokens[1:, PAD:], blk)
    np.testing.assert_allclose(got[0][1:, PAD:], alone, rtol=TOL, atol=TOL)
  if name == "window5":  # the window really changes the model (so the comparison is not vacuous)
    full = _forward(dataclasses.replace(ref, window=0), params, tokens[:1])
    assert np.max(np.abs(full[0, 5:] - want[0][0, 5:])) > 1e-4
    np.testing.assert_allclose(full[0, :5], want[0][0, :5], rtol=TOL, atol=TOL)


@pytest.mark.parametrize("position", ["rope", "t5"])
def test_xla_model_matches_reference(position):
  ref = _cfg(position=position, window=5 if position == "rope" else 0)
  params = _init(ref)
  tokens = _tokens(1)
  got = _real_only(ref, params, tokens, MASK, backend=backends.Backend(attention_impl="xla"))
  _assert_same(got, _real_only(ref, params, tokens, MASK))


@pytest.mark.parametrize("position,window", [("rope", 0), ("alibi", 0), ("rope", 5)])
def test_unpadded_xla_matches_reference(position, window):
  """Without an attention mask the layers get kv_valid=None and 'xla' runs in its causal mode
  (is_causal, no dense mask; with a window it falls back to the mask): same logits and gradients."""
  ref = _cfg(position=position, window=window, num_kv_heads=0 if position == "alibi" else 2)
  params = _init(ref)
  tokens = _tokens(2)
  got = _logits_and_grads(ref, params, tokens, backend=backends.Backend(attention_impl="xla"))
  _assert_same(got, _logits_and_grads(ref, params, tokens))


def test_is_causal_equals_the_causal_mask():
  from tformer_jax.ops import masks
  from tformer_jax.ops.attention import dot_product_attention
  q = jax.random.normal(jax.random.PRNGKey(0), (2, 9, 4, 8))
  kv = jax.random.normal(jax.random.PRNGKey(1), (2, 9, 2, 8))
  want = dot_product_attention(q, kv, kv, mask=masks.causal_mask(9))
  for impl in ("reference", "xla"):
    got = dot_product_attention(q, kv, kv, is_causal=True, impl=impl)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=TOL, atol=TOL, err_msg=impl)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the error without a GPU")
def test_cudnn_without_gpu_is_a_clear_error():
  m = _cfg()
  # the run's choice is refused before anything compiles ...
  with pytest.raises(ConfigError, match="runtime.attention: 'cudnn' needs a GPU"):
    backends.resolve_runtime(_runtime_cfg(m, attention="cudnn"), quiet=True)
  # ... and a backend built by hand fails clearly when the model traces
  with backends.use(backends.Backend(attention_impl="cudnn")), pytest.raises(
      ValueError, match="attention impl 'cudnn' needs a GPU"):
    Transformer(m).init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))


SCALINGS = {
    "linear": RopeScaling(type="linear", factor=2.0),
    "ntk": RopeScaling(type="ntk", factor=2.0),
    "dynamic": RopeScaling(type="dynamic", factor=2.0),
    "yarn": RopeScaling(type="yarn", factor=2.0),
    "llama3": RopeScaling(type="llama3", factor=2.0, original_max_len=16),
}


@functools.lru_cache(maxsize=1)
def _unscaled():
  """The unscaled model (max_len 32), params, 64-token inputs and its logits: shared by every scaling
  (a scaling adds no parameters)."""
  plain = _cfg(max_len=32, num_layers=1, init_std=0.2)
  params, tokens = _init(plain, 64), _tokens(2, 64)
  return plain, params, tokens, _forward(plain, params, tokens)


@pytest.mark.parametrize("kind", list(SCALINGS))
def test_rope_scaling_end_to_end(kind):
  """Each scaling: a model (max_len 32) runs forward and backward at twice its length, finite, and its
  logits differ from unscaled RoPE there; dynamic NTK equals plain RoPE up to max_len."""
  plain, params, tokens, base = _unscaled()
  m = dataclasses.replace(plain, rope_scaling=SCALINGS[kind])
  validate_model(m)
  logits, grads = _logits_and_grads(m, params, tokens)
  assert logits.shape == (B, 64, 61) and np.all(np.isfinite(logits))
  assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
  assert any(float(np.max(np.abs(g))) > 0 for g in jax.tree.leaves(grads))
  assert float(np.max(np.abs(logits - base))) > 1e-3
  if kind == "dynamic":
    short = _forward(m, params, tokens[:, :32])
    np.testing.assert_allclose(short, base[:, :32], rtol=TOL, atol=TOL)


@pytest.mark.slow
def test_extrapolation_experiment_smoke(tmp_path):
  """The experiment library end to end at a toy size: every scheme gets a row, learned positions past
  max_len are 'n/a', losses are finite, and the markdown/JSON/PNG are written."""
  from tformer_jax.experiments import extrapolate
  schemes = ("learned", "rope", "rope_ntk")
  res = extrapolate.run(schemes=schemes, train_len=16, steps=3, d_model=32, layers=1, heads=2,
                        batch_size=4, eval_mults=(1, 2), eval_windows=2, out=tmp_path)
  rows = {r["scheme"]: r for r in res["rows"]}
  assert set(rows) == set(schemes)
  assert rows["learned"]["loss"]["2"] is None
  for name in schemes:
    assert math.isfinite(rows[name]["loss"]["1"])
  # NTK with factor 1 at the training length is plain RoPE: the same trained params, the same loss.
  assert rows["rope_ntk"]["loss"]["1"] == pytest.approx(rows["rope"]["loss"]["1"], rel=1e-6)
  m = extrapolate.model_config("rope_ntk", train_len=16, d_model=32, layers=1, heads=2)
  assert m.position == "rope" and m.rope_scaling.type == "none"
  assert extrapolate.eval_config(m, "rope_ntk", 64, 16).rope_scaling == RopeScaling(type="ntk", factor=4.0)
  assert json.loads((tmp_path / "extrapolation.json").read_text())["rows"]
  md = (tmp_path / "extrapolation.md").read_text()
  assert "n/a (cannot extrapolate)" in md and "rope_ntk" in md
  assert (tmp_path / "extrapolation.png").stat().st_size > 1000


@functools.lru_cache(maxsize=1)
def _scanned_reference():
  """The scanned alibi model, params, tokens and its reference logits/gradients (one for both remats)."""
  ref = _cfg(num_layers=2, scan_layers=True, position="alibi", num_kv_heads=0)
  params, tokens = _init(ref), _tokens(3)
  return ref, params, tokens, _logits_and_grads(ref, params, tokens, MASK)


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_cpu_kernel_under_remat_and_scan(remat):
  """The C++ kernel's custom calls inside scanned, rematerialised layers (recomputed forward in the
  backward): same logits and gradients as the reference."""
  ref, params, tokens, want = _scanned_reference()
  got = _logits_and_grads(dataclasses.replace(ref, remat=remat), params, tokens, MASK,
                          backend=BACKENDS["chunked_cpu"]())
  _assert_same(got, want)


def test_auto_picks_an_exact_impl_for_the_config():
  """runtime 'auto' resolves once per run from the platform and config (backends.resolve_runtime)
  and the backend it picks gives the reference's logits/gradients."""
  auto = _cfg(position="alibi", num_kv_heads=0)

  def resolve(m, **runtime):
    return backends.resolve_runtime(_runtime_cfg(m, **runtime), platform="cpu", quiet=True).backend

  b = resolve(auto, attention_block_q=8, attention_block_k=4)
  assert type(b) is backends.XlaCpuBackend and b.attention_impl == "chunked"
  assert (b.block_q, b.block_k) == (8, 4)
  assert b.cpu_kernels == cpu_kernel.available()[0]       # the C++ kernel where it builds
  bf16 = resolve(dataclasses.replace(auto, dtype="bfloat16"))
  # bfloat16: the kernels (attention included) only on a BLAS with a bfloat16 gemm (MKL, oneDNN)
  assert bf16.attention_impl == "chunked" and bf16.cpu_kernels == (b.cpu_kernels and bf16.cpu_blas in ("mkl", "onednn"))
  assert resolve(dataclasses.replace(auto, attn_dropout=0.1)).attention_impl == "reference"
  assert resolve(dataclasses.replace(auto, position="t5")).attention_impl == "reference"
  assert resolve(dataclasses.replace(auto, window=4, num_global_tokens=2)).attention_impl == "reference"
  assert resolve(auto, attention="blockwise").attention_impl == "blockwise"
  gpu = backends.resolve_runtime(_runtime_cfg(auto), platform="gpu", quiet=True).backend
  assert type(gpu) is backends.Backend and gpu.attention_impl == "xla"
  params = _init(auto)
  tokens = _tokens(4)
  _assert_same(_logits_and_grads(auto, params, tokens, MASK, backend=b),
               _logits_and_grads(auto, params, tokens, MASK))
