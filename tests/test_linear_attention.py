"""Linear attention: the O(L) forms equal the explicit quadratic formula (float32, atol = rtol = 1e-5)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tformer_jax.ops.linear_attention import feature_map, linear_attention, linear_attention_quadratic

TOL = dict(atol=1e-5, rtol=1e-5)


def _qkv(b, l, s, h, kh, d, e, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 3)
  return (jax.random.normal(ks[0], (b, l, h, d)), jax.random.normal(ks[1], (b, s, kh, d)),
          jax.random.normal(ks[2], (b, s, kh, e)))


def test_feature_map_is_elu_plus_one():
  x = jnp.linspace(-5.0, 5.0, 101)
  want = np.where(np.asarray(x) > 0, np.asarray(x) + 1.0, np.exp(np.asarray(x)))
  np.testing.assert_allclose(np.asarray(feature_map(x)), want, rtol=1e-6, atol=1e-7)
  assert float(feature_map(x).min()) > 0.0


def test_quadratic_matches_numpy_formula():
  q, k, v = _qkv(1, 9, 9, 2, 1, 4, 3)
  phi = lambda x: np.where(x > 0, x + 1.0, np.exp(x))  # noqa: E731
  pq, pk, vv = phi(np.asarray(q, np.float64)), phi(np.asarray(k, np.float64)), np.asarray(v, np.float64)
  for causal in (False, True):
    got = np.asarray(jax.jit(functools.partial(linear_attention_quadratic, causal=causal))(q, k, v))
    for hh in range(2):
      a = pq[0, :, hh] @ pk[0, :, 0].T
      if causal:
        a = np.tril(a)
      want = (a @ vv[0, :, 0]) / a.sum(-1, keepdims=True)
      np.testing.assert_allclose(got[0, :, hh], want, **TOL)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("l,chunk,h,kh", [(50, 16, 4, 4), (64, 16, 8, 2), (37, 64, 4, 1), (23, 5, 6, 3)])
def test_matches_quadratic(causal, l, chunk, h, kh):
  q, k, v = _qkv(2, l, l, h, kh, 8, 12)
  got = jax.jit(lambda q, k, v: linear_attention(q, k, v, causal=causal, chunk_size=chunk))(q, k, v)
  want = jax.jit(functools.partial(linear_attention_quadratic, causal=causal))(q, k, v)
  assert got.shape == (2, l, h, 12)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL)


def test_noncausal_cross_lengths_and_causality():
  q, k, v = _qkv(1, 7, 19, 4, 2, 8, 8)
  np.testing.assert_allclose(np.asarray(jax.jit(functools.partial(linear_attention, causal=False))(q, k, v)),
                             np.asarray(jax.jit(functools.partial(linear_attention_quadratic, causal=False))(q, k, v)),
                             **TOL)
  # causal: changing a later token never changes earlier outputs
  q, k, v = _qkv(1, 30, 30, 2, 2, 8, 8)
  causal = jax.jit(functools.partial(linear_attention, causal=True, chunk_size=8))
  out = causal(q, k, v)
  out2 = causal(q, k.at[:, 20:].add(3.0), v.at[:, 20:].add(3.0))
  np.testing.assert_array_equal(np.asarray(out[:, :20]), np.asarray(out2[:, :20]))
  assert not np.allclose(np.asarray(out[:, 20:]), np.asarray(out2[:, 20:]))


def test_gradients_match_quadratic():
  q, k, v = _qkv(1, 21, 21, 4, 2, 8, 8)
  f = lambda fn: jax.jit(jax.grad(lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v))), argnums=(0, 1, 2)))(q, k, v)  # noqa
  got = f(lambda q, k, v: linear_attention(q, k, v, causal=True, chunk_size=8))
  want = f(lambda q, k, v: linear_attention_quadratic(q, k, v, causal=True))
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), **TOL)


def test_masked_quadratic_form():
  """A visibility mask (padding + causal) zeroes A outside it; weights rows sum to 1; a query that sees
  no key gets 0; with only the causal mask it equals the causal O(L) form."""
  from tformer_jax.ops import masks
  q, k, v = _qkv(2, 11, 11, 4, 2, 8, 6)
  valid = jnp.arange(11)[None, :] >= jnp.asarray([[0], [3]])    # row 1: three left-padding keys
  mask = masks.combine_masks(masks.causal_mask(11), masks.padding_mask(valid))
  out, w = jax.jit(functools.partial(linear_attention_quadratic, causal=False, return_weights=True))(q, k, v, mask=mask)
  phi = lambda x: np.where(x > 0, x + 1.0, np.exp(x))  # noqa: E731
  pq, pk, vv = (np.asarray(x, np.float64) for x in (phi(np.asarray(q)), phi(np.asarray(k)), v))
  m = np.asarray(mask)
  for b in range(2):
    for hh in range(4):
      a = (pq[b, :, hh] @ pk[b, :, hh // 2].T) * m[b, 0]
      den = a.sum(-1, keepdims=True)
      want = np.where(den > 0, (a @ vv[b, :, hh // 2]) / np.where(den > 0, den, 1.0), 0.0)
      np.testing.assert_allclose(np.asarray(out)[b, :, hh], want, **TOL)
  np.testing.assert_array_equal(np.asarray(out)[1, :3], 0.0)    # padding queries see nothing
  np.testing.assert_allclose(np.asarray(w).sum(-1)[0], 1.0, rtol=1e-6)
  assert np.all(np.asarray(w)[np.broadcast_to(~m, w.shape)] == 0.0)
  masked = jax.jit(lambda q, k, v: linear_attention_quadratic(q, k, v, causal=False, mask=masks.causal_mask(11)))
  chunked = jax.jit(lambda q, k, v: linear_attention(q, k, v, causal=True, chunk_size=4))
  np.testing.assert_allclose(np.asarray(masked(q, k, v)), np.asarray(chunked(q, k, v)), **TOL)


# --- model.attention='linear' -------------------------------------------------------------------------

def _linear_cfg(**kw):
  from tformer_jax.config import ModelConfig
  base = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, max_len=32, position="rope",
              attention="linear")
  return ModelConfig(**{**base, **kw})


def _init(model, l=4):
  import flax.linen as nn
  return nn.unbox(jax.jit(model.init)(jax.random.PRNGKey(0), jnp.zeros((1, l), jnp.int32))["params"])


@pytest.mark.parametrize("causal", [True, False])
def test_model_attention_equals_the_op(causal):
  """nn.Attention with attention='linear' = its q/k/v projections -> ops.linear_attention -> wo."""
  import flax.linen as nn

  from tformer_jax.nn.attention import Attention
  cfg = _linear_cfg(position="learned", causal=causal)     # learned positions: added to x, not inside Attention
  attn = Attention(cfg)
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 20, 32))
  pos = jnp.broadcast_to(jnp.arange(20), (2, 20))
  p = nn.unbox(jax.jit(attn.init)(jax.random.PRNGKey(0), x, pos, None)["params"])
  got = jax.jit(lambda p, x: attn.apply({"params": p}, x, pos, None))(p, x)
  @jax.jit
  def by_hand(p, x):
    q, k, v = (jnp.einsum("bld,dhk->blhk", x, p[n]) for n in ("wq", "wk", "wv"))
    return jnp.einsum("blhk,hkd->bld", linear_attention(q, k, v, causal=causal), p["wo"])

  want = by_hand(p, x)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL)


def test_linear_model_is_causal_by_gradient_and_decodes_with_a_cache():
  """d logits[i] / d embeddings[j] is exactly 0 for every j > i and not for j <= i; decoding into a KV
  cache (the masked form) gives the full forward's logits (the O(L) form) at every step."""
  from tformer_jax import decode
  from tformer_jax.nn import Transformer
  model = Transformer(_linear_cfg())
  params = _init(model)
  l = 12
  emb = jax.random.normal(jax.random.PRNGKey(2), (1, l, 32))
  tok = jnp.zeros((1, l), jnp.int32)
  jac = jax.jit(jax.jacrev(lambda e: model.apply({"params": params}, tok, inputs_embeds_BxLxD=e)[0].sum(-1)))(emb)
  dep = np.abs(np.asarray(jac)[:, 0]).sum(-1)               # (L queries, L inputs)
  future = np.triu(np.ones((l, l), bool), 1)
  assert np.all(dep[future] == 0.0) and np.all(dep[~future] > 0.0)

  tokens = jax.random.randint(jax.random.PRNGKey(3), (2, 9), 0, 64)
  full = np.asarray(jax.jit(model.apply)({"params": params}, tokens))
  step = jax.jit(lambda v, t: model.apply(v, t, decode=True, mutable=["cache"]))
  logits, upd = step({"params": params, "cache": decode.init_cache(model, params, 2, 16)}, tokens[:, :5])
  np.testing.assert_allclose(np.asarray(logits), full[:, :5], **TOL)
  for t in range(5, 9):
    logits, upd = step({"params": params, "cache": upd["cache"]}, tokens[:, t:t + 1])
    np.testing.assert_allclose(np.asarray(logits[:, 0]), full[:, t], **TOL, err_msg=f"t={t}")


def test_linear_model_trains_generates_and_refuses_hf_export(tmp_path):
  from tformer_jax.config import ConfigError, validate, validate_model
  from tformer_jax.interop import hf
  from tformer_jax.train import loop
  from tformer_jax.train.metrics import read_metrics

  from train_utils import tiny_config
  c = tiny_config(steps=12)
  c.model.attention = "linear"
  c.train.log_every, c.train.sample_tokens = 4, 16
  final = loop.train(c, tmp_path)
  losses = [r["loss"] for r in read_metrics(tmp_path) if "loss" in r]
  assert losses[-1] < losses[0] - 0.5, losses
  assert len(final["sample"]) > len(c.train.sample_prompt)     # generation through the KV cache
  with pytest.raises(hf.HFConfigError, match="model.attention='linear'"):
    hf.infer_family(_linear_cfg(norm="rmsnorm", activation="swiglu", tie_embeddings=False))
  for kw, match in [(dict(window=4), "model.attention: 'linear' sums over all .* no window=4"),
                    (dict(position="alibi"), "model.attention: 'linear' has no attention logits to bias"),
                    (dict(attn_dropout=0.1), "model.attn_dropout: 'linear' attention has no softmax weights"),
                    (dict(attention="performer"), "model.attention: unknown value 'performer'")]:
    with pytest.raises(ConfigError, match=match):
      validate_model(_linear_cfg(**kw))
  c.model.attention = "Linear"
  with pytest.raises(ConfigError, match="did you mean 'linear'"):
    validate(c)
