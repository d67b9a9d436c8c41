"""Sparse attention masks (sliding window, local band, global tokens, BigBird random blocks) against
brute-force Python constructions, and their effect through dot_product_attention (exact zero weights)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tformer_jax.ops import masks
from tformer_jax.ops.attention import attention_weights, dot_product_attention


def _brute(l, s, rule):
  return np.array([[bool(rule(i, j)) for j in range(s)] for i in range(l)])[None, None]


@pytest.mark.parametrize("l,s,window,offset", [(10, 10, 3, 0), (7, 19, 4, 12), (12, 12, 1, 0),
                                               (9, 9, 20, 0), (5, 30, 8, 25)])
def test_sliding_window(l, s, window, offset):
  got = np.asarray(masks.sliding_window_mask(l, s, window=window, offset=offset))
  want = _brute(l, s, lambda i, j: offset + i - window < j <= offset + i)
  np.testing.assert_array_equal(got, want)
  assert got.shape == (1, 1, l, s)
  if offset == 0 and window >= l:  # a window covering everything is plain causal
    np.testing.assert_array_equal(got, np.asarray(masks.causal_mask(l, s)))


@pytest.mark.parametrize("l,s,window", [(10, 10, 3), (6, 11, 2), (8, 8, 1), (5, 5, 9)])
def test_local_window(l, s, window):
  got = np.asarray(masks.local_window_mask(l, s, window=window))
  np.testing.assert_array_equal(got, _brute(l, s, lambda i, j: abs(i - j) < window))


@pytest.mark.parametrize("l,s,g", [(10, 10, 2), (6, 9, 0), (5, 5, 7)])
def test_global_tokens(l, s, g):
  got = np.asarray(masks.global_token_mask(l, s, num_global=g))
  np.testing.assert_array_equal(got, _brute(l, s, lambda i, j: i < g or j < g))
  # Longformer pattern: (local | global) & causal
  combo = np.asarray(masks.combine_masks(masks.local_window_mask(l, s, window=2) | got,
                                         masks.causal_mask(l, s)))
  want = _brute(l, s, lambda i, j: (abs(i - j) < 2 or i < g or j < g) and j <= i)
  np.testing.assert_array_equal(combo, want)


def _brute_random(l, s, block, r, seed):
  rng = np.random.default_rng(seed)
  nq, nk = -(-l // block), -(-s // block)
  out = np.zeros((l, s), bool)
  for qb in range(nq):
    for kb in rng.choice(nk, size=min(r, nk), replace=False):
      for i in range(qb * block, min((qb + 1) * block, l)):
        for j in range(kb * block, min((kb + 1) * block, s)):
          out[i, j] = True
  return out[None, None]


@pytest.mark.parametrize("l,s,block,r,seed", [(16, 16, 4, 2, 0), (13, 22, 4, 3, 7), (10, 10, 5, 9, 1),
                                              (8, 8, 3, 0, 0)])
def test_random_blocks_brute_force(l, s, block, r, seed):
  got = np.asarray(masks.random_block_mask(l, s, block_size=block, num_random_blocks=r, seed=seed))
  np.testing.assert_array_equal(got, _brute_random(l, s, block, r, seed))
  # block structure: every (query block, key block) tile is all-True or all-False, and each query
  # block sees exactly min(r, #key blocks) key blocks
  nq, nk = -(-l // block), -(-s // block)
  for qb in range(nq):
    seen = 0
    for kb in range(nk):
      tile = got[0, 0, qb * block:(qb + 1) * block, kb * block:(kb + 1) * block]
      assert tile.all() or not tile.any()
      seen += int(tile.all())
    assert seen == min(r, nk)


def test_random_blocks_are_seeded_and_deterministic():
  kw = dict(block_size=4, num_random_blocks=3)
  a = np.asarray(masks.random_block_mask(64, 64, seed=3, **kw))
  b = np.asarray(masks.random_block_mask(64, 64, seed=3, **kw))
  c = np.asarray(masks.random_block_mask(64, 64, seed=4, **kw))
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)
  # a compile-time constant: identical inside jit
  np.testing.assert_array_equal(np.asarray(jax.jit(lambda: masks.random_block_mask(64, 64, seed=3, **kw))()),
                                a)


def test_outside_window_gets_exactly_zero_weight():
  b, l, h, kh, d, window = 2, 12, 4, 2, 8, 3
  ks = jax.random.split(jax.random.PRNGKey(0), 3)
  q = jax.random.normal(ks[0], (b, l, h, d)) * 4.0
  k = jax.random.normal(ks[1], (b, l, kh, d)) * 4.0
  v = jax.random.normal(ks[2], (b, l, kh, d))
  mask = masks.sliding_window_mask(l, window=window)
  w = np.asarray(attention_weights(q, k, mask=mask))
  outside = ~np.asarray(mask)[0, 0]
  assert np.all(w[:, :, outside] == 0.0)  # exactly zero, not merely small
  np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-6)
  # the output equals softmax attention over the in-window keys only
  out = np.asarray(dot_product_attention(q, k, v, mask=mask))
  qn, kn, vn = (np.asarray(x, np.float64) for x in (q, k, v))
  for bb in range(b):
    for hh in range(h):
      for i in range(l):
        js = [j for j in range(l) if i - window < j <= i]
        logits = kn[bb, js, hh // (h // kh)] @ qn[bb, i, hh] / np.sqrt(d)
        p = np.exp(logits - logits.max())
        p /= p.sum()
        np.testing.assert_allclose(out[bb, i, hh], p @ vn[bb, js, hh // (h // kh)], atol=1e-5, rtol=1e-5)
  # moving a key outside every query's window leaves the outputs unchanged
  k2 = k.at[:, 0].set(100.0)
  out2 = np.asarray(dot_product_attention(q, k2, v, mask=mask))
  np.testing.assert_array_equal(out2[:, window:], out[:, window:])


def test_random_and_global_masks_through_attention():
  l, d = 16, 8
  mask = masks.random_block_mask(l, block_size=4, num_random_blocks=1, seed=0) | \
      masks.global_token_mask(l, num_global=1)
  q = jax.random.normal(jax.random.PRNGKey(1), (1, l, 2, d))
  k = jax.random.normal(jax.random.PRNGKey(2), (1, l, 2, d))
  w = np.asarray(attention_weights(q, k, mask=mask))
  m = np.broadcast_to(np.asarray(mask), w.shape)
  assert np.all(w[~m] == 0.0) and np.all(w[m] > 0.0)
  np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-6)
  assert jnp.all(jnp.isfinite(w))


@pytest.mark.parametrize("causal,num_global", [(False, 0), (False, 2), (True, 1)])
def test_visibility_random_blocks_equal_the_op(causal, num_global):
  """Visibility(random=RandomBlocks) = window | global | random_block_mask of the whole context (& causal),
  for a full window and for single decoding queries at traced cache slots."""
  n, block, r, seed, window = 24, 4, 2, 5, 3
  rb = masks.RandomBlocks(num=r, size=block, seed=seed, length=n)
  vis = masks.Visibility(causal=causal, window=window, num_global=num_global, random=rb)
  want = (np.asarray(masks.random_block_mask(n, n, block_size=block, num_random_blocks=r, seed=seed))
          | np.asarray(masks.local_window_mask(n, window=window)))
  if num_global:
    want = want | np.asarray(masks.global_token_mask(n, num_global=num_global))
  if causal:
    want = want & np.asarray(masks.causal_mask(n))
  np.testing.assert_array_equal(np.asarray(vis.mask(n, n)), want)
  row = jax.jit(lambda p: masks.Visibility(causal=causal, window=window, num_global=num_global, random=rb,
                                           q_offset=p).mask(1, n))
  for p in (0, 7, n - 1):
    np.testing.assert_array_equal(np.asarray(row(jnp.int32(p)))[0, 0, 0], want[0, 0, p])


# --- BigBird random blocks as a model option -------------------------------------------------------------

def _bigbird(**kw):
  from tformer_jax.config import ModelConfig
  base = dict(vocab_size=64, d_model=32, num_layers=1, num_heads=2, max_len=32, position="rope", window=3,
              num_global_tokens=1, random_blocks=2, random_block_size=4, random_block_seed=11)
  return ModelConfig(**{**base, **kw})


@pytest.mark.parametrize("causal", [False, True])
def test_model_random_blocks_weights_are_zero_exactly_outside_the_pattern(causal):
  """The model's attention weights are > 0 exactly on window | global | random_block_mask of max_len
  (& causal), a training window of L < max_len its top-left corner; the chunked runtime falls back to
  the dense path (same logits); a causal model decodes into a KV cache with the same pattern."""
  import flax.linen as nn

  from tformer_jax import backends, decode
  from tformer_jax.diagnostics.attention_maps import attention_weights
  from tformer_jax.nn import Transformer
  cfg = _bigbird(causal=causal)
  model = Transformer(cfg)
  params = nn.unbox(jax.jit(model.init)(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))["params"])
  n = cfg.max_len
  want = (np.asarray(masks.random_block_mask(n, n, block_size=4, num_random_blocks=2, seed=11))
          | np.asarray(masks.local_window_mask(n, window=3)) | np.asarray(masks.global_token_mask(n, num_global=1)))
  if causal:
    want = want & np.asarray(masks.causal_mask(n))
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, n), 0, 64)
  for l in (n, 20):
    (w,) = jax.jit(lambda p, t: attention_weights(model, p, t))(params, tokens[:, :l])
    m = np.broadcast_to(want[:, :, :l, :l], w.shape)
    assert np.all(np.asarray(w)[~m] == 0.0) and np.all(np.asarray(w)[m] > 0.0)
  ref = np.asarray(jax.jit(model.apply)({"params": params}, tokens))
  with backends.use(backends.Backend(attention_impl="chunked")):
    chunked = np.asarray(jax.jit(model.apply)({"params": params}, tokens))
  np.testing.assert_array_equal(chunked, ref)
  if causal:
    step = jax.jit(lambda v, t: model.apply(v, t, decode=True, mutable=["cache"]))
    logits, upd = step({"params": params, "cache": decode.init_cache(model, params, 2, n)}, tokens[:, :20])
    np.testing.assert_allclose(np.asarray(logits), ref[:, :20], atol=1e-5, rtol=0)
    for t in range(20, 24):      # one token per call at cache slot t: the full forward's pattern
      logits, upd = step({"params": params, "cache": upd["cache"]}, tokens[:, t:t + 1])
      np.testing.assert_allclose(np.asarray(logits[:, 0]), ref[:, t], atol=1e-5, rtol=0, err_msg=f"t={t}")


def test_bigbird_trains_and_its_rules(tmp_path):
  from tformer_jax.config import ConfigError, validate, validate_model
  from tformer_jax.train import loop
  from tformer_jax.train.metrics import read_metrics

  from train_utils import tiny_config
  c = tiny_config(steps=12)
  m = c.model
  m.window, m.num_global_tokens, m.random_blocks, m.random_block_size = 8, 1, 2, 8
  c.train.log_every = 4
  loop.train(c, tmp_path)
  losses = [r["loss"] for r in read_metrics(tmp_path) if "loss" in r]
  assert losses[-1] < losses[0] - 0.5, losses
  for kw, match in [(dict(window=0, num_global_tokens=0), "model.random_blocks: random blocks widen a sliding "
                     "window"), (dict(random_blocks=8), "model.random_blocks: 8 random blocks of 4 cover all 8")]:
    with pytest.raises(ConfigError, match=match):
      validate_model(_bigbird(**kw))
  c.runtime.attention, m.num_global_tokens = "blockwise", 0
  with pytest.raises(ConfigError, match="runtime.attention: 'blockwise' has no random blocks"):
    validate(c)
