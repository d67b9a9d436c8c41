"""RoPE scalings: closed forms, and (reference-marked) equality with transformers' ROPE_INIT_FUNCTIONS.

Tolerance: inv_freq and attention_scaling at 1e-6 relative.
"""
import math

import numpy as np
import pytest

from tformer_jax.config import RopeScaling
from tformer_jax.ops.positions import rope_inv_freq
from tformer_jax.ops.rope_scaling import ntk_theta, rope_parameters

RTOL = 1e-6


def _plain(d, theta):
  return 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)


def test_none_and_linear():
  inv, att = rope_parameters(64, 10000.0, None, max_len=2048)
  np.testing.assert_array_equal(np.asarray(inv), np.asarray(rope_inv_freq(64, 10000.0)))
  assert att == 1.0
  inv, att = rope_parameters(64, 10000.0, RopeScaling(type="linear", factor=4.0), max_len=2048)
  np.testing.assert_allclose(np.asarray(inv), _plain(64, 10000.0) / 4.0, rtol=RTOL)
  assert att == 1.0


@pytest.mark.parametrize("d,factor", [(128, 50.0), (64, 4.0), (96, 8.0)])
def test_ntk_closed_form(d, factor):
  theta = 10000.0
  new_theta = theta * factor ** (d / (d - 2))
  assert ntk_theta(theta, factor, d) == pytest.approx(new_theta, rel=1e-12)
  inv, att = rope_parameters(d, theta, {"type": "ntk", "factor": factor}, max_len=4096)
  np.testing.assert_allclose(np.asarray(inv), _plain(d, new_theta), rtol=RTOL)
  assert att == 1.0
  # the highest frequency is unchanged; the lowest one is divided by exactly `factor`
  assert float(inv[0]) == 1.0
  lowest_plain = theta ** (-(d - 2) / d)
  assert float(inv[-1]) == pytest.approx(lowest_plain / factor, rel=RTOL)
  if d == 128 and factor == 50.0:  # the article's "10000 -> ~500000" base for a 50x extension
    assert 4.5e5 < ntk_theta(theta, factor, d) < 5.5e5


def test_dynamic_is_plain_within_original_length_and_grows_after():
  sc = RopeScaling(type="dynamic", factor=4.0, original_max_len=2048)
  base = np.asarray(rope_parameters(64, 10000.0, None, max_len=2048)[0])
  for seq in (None, 100, 2048):
    np.testing.assert_allclose(np.asarray(rope_parameters(64, 10000.0, sc, max_len=8192, seq_len=seq)[0]),
                               base, rtol=RTOL)
  inv = np.asarray(rope_parameters(64, 10000.0, sc, max_len=8192, seq_len=4096)[0])
  theta = 10000.0 * (4.0 * 4096 / 2048 - 3.0) ** (64 / 62)
  np.testing.assert_allclose(inv, _plain(64, theta), rtol=RTOL)


def test_yarn_and_llama3_shapes_and_invariants():
  d = 128
  inv, att = rope_parameters(d, 10000.0, RopeScaling(type="yarn", factor=8.0, original_max_len=4096),
                             max_len=32768)
  assert inv.shape == (d // 2,) and att == pytest.approx(0.1 * math.log(8.0) + 1.0)
  plain = _plain(d, 10000.0)
  np.testing.assert_allclose(np.asarray(inv)[0], plain[0], rtol=RTOL)  # fastest: extrapolated
  np.testing.assert_allclose(np.asarray(inv)[-1], plain[-1] / 8.0, rtol=RTOL)  # slowest: interpolated
  _, att2 = rope_parameters(d, 10000.0, {"type": "yarn", "factor": 8.0, "attention_factor": 1.3},
                            max_len=4096)
  assert att2 == 1.3
  inv, att = rope_parameters(d, 500000.0, RopeScaling(type="llama3", factor=8.0, original_max_len=8192),
                             max_len=131072)
  assert att == 1.0
  ratio = _plain(d, 500000.0) / np.asarray(inv, np.float64)
  assert np.all((ratio > 1 - 1e-6) & (ratio < 8 + 1e-5))
  assert ratio[0] == pytest.approx(1.0, rel=RTOL) and ratio[-1] == pytest.approx(8.0, rel=RTOL)


def test_rejects_unknown_type():
  with pytest.raises(ValueError, match="unknown rope scaling"):
    rope_parameters(64, 10000.0, {"type": "longrope"}, max_len=128)


def _hf_reference(kind, d, theta, orig, max_len, seq_len=None, **extra):
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  from transformers import LlamaConfig
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

  params = {"rope_type": kind, "rope_theta": theta}
  if kind in ("yarn", "llama3"):
    params["original_max_position_embeddings"] = orig
  params.update(extra)
  # transformers' dynamic NTK measures seq_len against max_position_embeddings (our original length)
  mpe = orig if kind == "dynamic" else max_len
  cfg = LlamaConfig(hidden_size=4 * d, num_attention_heads=4, head_dim=d, max_position_embeddings=mpe,
                    rope_parameters=params)
  inv, att = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu", seq_len=seq_len)
  return inv.numpy(), float(att)


REF_CASES = [
    ("linear", dict(factor=2.0)), ("linear", dict(factor=8.0)),
    ("dynamic", dict(factor=2.0, seq_len=3000)), ("dynamic", dict(factor=4.0, seq_len=10000)),
    ("dynamic", dict(factor=8.0, seq_len=1000)), ("dynamic", dict(factor=16.0, seq_len=None)),
    ("yarn", dict(factor=4.0)), ("yarn", dict(factor=16.0)), ("yarn", dict(factor=40.0)),
    ("yarn", dict(factor=8.0, beta_fast=16.0, beta_slow=2.0, attention_factor=1.25)),
    # gpt-oss: the correction range left fractional (truncate=False), and the same range rounded outwards
    ("yarn", dict(factor=32.0, truncate=False)), ("yarn", dict(factor=32.0, truncate=True)),
    ("llama3", dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)),
    ("llama3", dict(factor=32.0, low_freq_factor=2.0, high_freq_factor=8.0)),
]


@pytest.mark.reference
@pytest.mark.parametrize("kind,kw", REF_CASES)
@pytest.mark.parametrize("d,theta,orig", [(64, 10000.0, 2048), (128, 500000.0, 8192), (96, 1e6, 4096)])
def test_matches_transformers(kind, kw, d, theta, orig):
  kw = dict(kw)
  seq_len = kw.pop("seq_len", None)
  max_len = int(kw["factor"] * orig)  # consistent with the factor (transformers warns otherwise)
  want_inv, want_att = _hf_reference(kind, d, theta, orig, max_len, seq_len, **kw)
  sc = RopeScaling(type=kind, original_max_len=orig, **kw)
  inv, att = rope_parameters(d, theta, sc, max_len=max_len, seq_len=seq_len)
  np.testing.assert_allclose(np.asarray(inv), want_inv, rtol=RTOL, atol=0)
  assert att == pytest.approx(want_att, rel=RTOL)
