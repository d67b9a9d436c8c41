"""T5 relative position buckets: exact equality with a pure-Python rule and with transformers' T5Attention."""
import math

import jax
import numpy as np
import pytest

from tformer_jax.ops.relative_bias import t5_bias, t5_relative_bucket

CONFIGS = [(32, 128), (16, 64), (64, 256), (32, 32), (8, 20), (10, 50)]
REL = np.arange(-1500, 1501)


def _py_bucket(rel: int, bidirectional: bool, num_buckets: int, max_distance: int) -> int:
  """The T5 rule, written out for a single Python int."""
  bucket = 0
  if bidirectional:
    num_buckets //= 2
    bucket += num_buckets if rel > 0 else 0
    n = abs(rel)
  else:
    n = max(-rel, 0)
  max_exact = num_buckets // 2
  if n < max_exact:
    return bucket + n
  large = max_exact + int(math.log(n / max_exact) / math.log(max_distance / max_exact)
                          * (num_buckets - max_exact))
  return bucket + min(large, num_buckets - 1)


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets,max_distance", CONFIGS)
def test_bucket_matches_python_rule(bidirectional, num_buckets, max_distance):
  got = np.asarray(t5_relative_bucket(REL, bidirectional=bidirectional, num_buckets=num_buckets,
                                      max_distance=max_distance))
  want = np.array([_py_bucket(int(r), bidirectional, num_buckets, max_distance) for r in REL])
  np.testing.assert_array_equal(got, want)
  assert got.min() >= 0 and got.max() < num_buckets


def test_bucket_structure():
  b = np.asarray(t5_relative_bucket(REL, bidirectional=False))
  assert np.all(b[REL >= 0] == 0)  # causal: future keys share bucket 0 (they are masked anyway)
  np.testing.assert_array_equal(b[(REL <= 0) & (REL > -16)], -REL[(REL <= 0) & (REL > -16)])
  assert np.all(b[REL <= -128] == 31)
  assert np.all(np.diff(b[REL <= 0]) <= 0)  # monotone in distance
  bi = np.asarray(t5_relative_bucket(REL, bidirectional=True))
  assert np.all(bi[REL > 0] >= 16) and np.all(bi[REL <= 0] < 16)


def test_bias_gathers_table():
  nb, h = 32, 3
  table = jax.random.normal(jax.random.PRNGKey(0), (nb, h))
  q_pos = np.array([[0, 1, 2, 3, 4], [10, 11, 12, 13, 14]])
  k_pos = np.array([[0, 1, 2, 3, 4, 5, 6], [0, 50, 100, 150, 200, 250, 300]])
  bias = np.asarray(t5_bias(table, q_pos, k_pos, bidirectional=True, num_buckets=nb, max_distance=128))
  assert bias.shape == (2, h, 5, 7)
  t = np.asarray(table)
  for bb in range(2):
    for i in range(5):
      for j in range(7):
        bucket = _py_bucket(int(k_pos[bb, j] - q_pos[bb, i]), True, nb, 128)
        np.testing.assert_array_equal(bias[bb, :, i, j], t[bucket])
  with pytest.raises(ValueError, match="num_buckets"):
    t5_bias(table, q_pos, k_pos, bidirectional=True, num_buckets=16)


@pytest.mark.reference
@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets,max_distance", CONFIGS)
def test_bucket_matches_transformers(bidirectional, num_buckets, max_distance):
  torch = pytest.importorskip("torch")
  pytest.importorskip("transformers")
  from transformers.models.t5.modeling_t5 import T5Attention

  want = T5Attention._relative_position_bucket(torch.tensor(REL), bidirectional=bidirectional,
                                               num_buckets=num_buckets, max_distance=max_distance)
  got = t5_relative_bucket(REL, bidirectional=bidirectional, num_buckets=num_buckets,
                           max_distance=max_distance)
  np.testing.assert_array_equal(np.asarray(got), want.numpy())
