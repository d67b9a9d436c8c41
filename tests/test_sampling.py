"""Logits processors and next-token sampling on constructed logits."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tformer_jax.ops import sampling as S

NEG = float(np.finfo(np.float32).min)


def _kept(x):
  return np.asarray(x) > NEG / 2


def test_temperature():
  logits = jnp.array([[1.0, -2.0, 4.0], [0.5, 0.0, -1.0]])
  np.testing.assert_allclose(S.apply_temperature(logits, 0.5), logits * 2.0)
  per_row = S.apply_temperature(logits, jnp.array([1.0, 0.25]))
  np.testing.assert_allclose(per_row, np.stack([logits[0], logits[1] * 4.0]))
  assert np.all(np.isfinite(S.apply_temperature(logits, 0.0)))


def test_top_k_keeps_exactly_k():
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=(4, 50)), jnp.float32)
  logits = logits.at[0, :5].set(3.0)                 # ties at the boundary: still exactly k
  for k in (1, 3, 7):
    out = jax.jit(S.top_k_filter, static_argnums=1)(logits, k)
    keep = _kept(out)
    assert np.all(keep.sum(-1) == k)
    top = np.argsort(-np.asarray(logits), axis=-1, kind="stable")[:, :k]
    for b in range(4):
      assert set(np.nonzero(keep[b])[0]) == set(top[b])
      np.testing.assert_array_equal(np.asarray(out)[b, keep[b]], np.asarray(logits)[b, keep[b]])
  np.testing.assert_array_equal(S.top_k_filter(logits, 0), logits)
  np.testing.assert_array_equal(S.top_k_filter(logits, 50), logits)
  # A traced (per-row) k gives the same rows; <= 0 is off for that row.
  traced = jax.jit(S.top_k_filter)(logits, jnp.array([3, 1, 0, 7]))
  np.testing.assert_array_equal(_kept(traced).sum(-1), [3, 1, 50, 7])
  np.testing.assert_array_equal(traced[0], S.top_k_filter(logits, 3)[0])
  np.testing.assert_array_equal(traced[1], S.top_k_filter(logits, 1)[1])


def test_top_p_minimal_nucleus():
  # Probabilities in a shuffled order: 0.05, 0.5, 0.1, 0.2, 0.15.
  probs = np.array([0.05, 0.5, 0.1, 0.2, 0.15])
  logits = jnp.log(jnp.asarray(probs, jnp.float32))[None]
  # Sorted: 0.5 | 0.2 (0.7) | 0.15 (0.85) | 0.1 (0.95) | 0.05.
  cases = {0.0: {1}, 0.45: {1}, 0.6: {1, 3}, 0.75: {1, 3, 4}, 0.9: {1, 3, 4, 2},
           0.99: {0, 1, 2, 3, 4}, 1.0: {0, 1, 2, 3, 4}}
  f = jax.jit(S.top_p_filter)
  for p, want in cases.items():
    out = f(logits, p)
    assert set(np.nonzero(_kept(out)[0])[0]) == want, p
    np.testing.assert_allclose(np.asarray(out)[0, sorted(want)], np.asarray(logits)[0, sorted(want)])
  # Per-row p, and the filtered distribution renormalises over the nucleus.
  two = jnp.concatenate([logits, logits])
  out = f(two, jnp.array([0.6, 0.9]))
  np.testing.assert_array_equal(_kept(out).sum(-1), [2, 4])
  np.testing.assert_allclose(jax.nn.softmax(out[0])[jnp.array([1, 3])], [0.5 / 0.7, 0.2 / 0.7], rtol=1e-5)


def test_repetition_penalty_rule():
  logits = jnp.array([[2.0, -1.0, 0.5, -3.0, 0.0]])
  seen = jnp.array([[True, True, False, True, True]])
  out = S.repetition_penalty(logits, seen, 2.0)
  np.testing.assert_allclose(out, [[1.0, -2.0, 0.5, -6.0, 0.0]])
  # Token history form; negative ids are padding and ignored; duplicates count once.
  hist = jnp.array([[3, 0, -1, 1, 0, 4]])
  np.testing.assert_array_equal(S.seen_mask(hist, 5), seen)
  np.testing.assert_allclose(S.repetition_penalty(logits, hist, 2.0), out)
  np.testing.assert_array_equal(S.repetition_penalty(logits, seen, 1.0), logits)
  # Per-row penalty.
  two = jnp.concatenate([logits, logits])
  out2 = S.repetition_penalty(two, jnp.concatenate([seen, seen]), jnp.array([2.0, 4.0]))
  np.testing.assert_allclose(out2[1], [0.5, -4.0, 0.5, -12.0, 0.0])


def test_greedy_and_tiny_temperature():
  logits = jax.random.normal(jax.random.key(0), (6, 20))
  greedy = jnp.argmax(logits, -1)
  sample = jax.jit(S.sample_next)
  for t in (0.0, 1e-6, -1.0):
    np.testing.assert_array_equal(sample(jax.random.key(1), logits, temperature=t), greedy)
  # Per-row temperature: rows with t = 0 are greedy whatever the key.
  t_B = jnp.array([0.0, 1.0, 0.0, 1.0, 0.0, 1.0])
  for seed in range(3):
    tok = sample(jax.random.key(seed), logits, temperature=t_B)
    np.testing.assert_array_equal(tok[::2], greedy[::2])
  # Greedy picks the penalised argmax.
  pen = S.sample_next(jax.random.key(0), jnp.array([[3.0, 2.0]]), temperature=0.0, penalty=2.0,
                      seen=jnp.array([[0]]))
  assert int(pen[0]) == 1


def test_sampling_frequencies_match_softmax():
  probs = np.array([0.2, 0.3, 0.5])
  n = 20000
  logits = jnp.broadcast_to(jnp.log(jnp.asarray(probs, jnp.float32)), (n, 3))
  tok = np.asarray(jax.jit(S.sample_next)(jax.random.key(0), logits, temperature=1.0))
  freq = np.bincount(tok, minlength=3) / n
  # Binomial std <= sqrt(0.25 / 20000) = 0.0035; 0.015 is > 4 sigma.
  np.testing.assert_allclose(freq, probs, atol=0.015)
  # Temperature 0.5 squares and renormalises the probabilities; top_k=2 drops token 0.
  tok = np.asarray(S.sample_next(jax.random.key(1), logits, temperature=0.5, top_k=2))
  freq = np.bincount(tok, minlength=3) / n
  want = np.array([0.0, 0.09, 0.25]) / 0.34
  np.testing.assert_allclose(freq, want, atol=0.015)
  # top_p=0.6 keeps {2, 1}: 0.5 alone is < 0.6.
  tok = np.asarray(S.sample_next(jax.random.key(2), logits, top_p=0.6))
  assert set(np.unique(tok)) == {1, 2}


def test_per_request_rng_determinism():
  logits = jax.random.normal(jax.random.key(5), (4, 30))
  keys = jax.random.split(jax.random.key(9), 4)
  sample = jax.jit(S.sample_next)
  batch = sample(keys, logits, temperature=1.0, top_p=0.9)
  # Each row depends only on its own key and logits.
  for b in range(4):
    alone = sample(keys[b:b + 1], logits[b:b + 1], temperature=1.0, top_p=0.9)
    assert int(alone[0]) == int(batch[b])
  swapped = sample(keys[::-1], logits[::-1], temperature=1.0, top_p=0.9)
  np.testing.assert_array_equal(swapped[::-1], batch)
  # Same keys -> same tokens; raw uint32 keys work the same way.
  np.testing.assert_array_equal(sample(keys, logits, temperature=1.0, top_p=0.9), batch)
  raw = jax.random.key_data(keys)
  assert raw.shape == (4, 2)
  np.testing.assert_array_equal(sample(raw, logits, temperature=1.0, top_p=0.9), batch)
  # One shared key is deterministic as well, and different keys differ somewhere.
  one = sample(jax.random.key(0), logits, temperature=1.0)
  np.testing.assert_array_equal(one, sample(jax.random.key(0), logits, temperature=1.0))
  many = [np.asarray(sample(jax.random.key(s), logits, temperature=1.0)) for s in range(5)]
  assert len({m.tobytes() for m in many}) > 1


def test_process_logits_traced_args_and_dtypes():
  logits = jax.random.normal(jax.random.key(3), (2, 16)).astype(jnp.bfloat16)
  f = jax.jit(lambda lg, t, p: S.process_logits(lg, temperature=t, top_k=4, top_p=p))
  out = f(logits, jnp.float32(0.7), jnp.float32(0.8))
  assert out.dtype == jnp.float32 and not np.any(np.isnan(np.asarray(out)))
  kept = _kept(out)
  assert np.all((kept.sum(-1) >= 1) & (kept.sum(-1) <= 4))
  assert float(S.mask_value(jnp.float16)) == float(np.finfo(np.float16).min)
  with pytest.raises(ValueError):   # jnp.broadcast_to: incompatible shapes
    S.top_p_filter(logits, jnp.ones((3,)))   # per-row p must match the batch
