"""The linen Transformer: causality by gradient, permutation behaviour, GQA/MQA, scan and remat."""
import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tformer_jax.config import ModelConfig
from tformer_jax.nn import Transformer

POSITIONS = ["none", "sinusoidal", "learned", "rope", "alibi", "t5"]


def tiny(**kw) -> ModelConfig:
  base = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=4, max_len=16)
  base.update(kw)
  return ModelConfig(**base)


def init(cfg, b=2, l=8, seed=0):
  model = Transformer(cfg)
  tok = jax.random.randint(jax.random.PRNGKey(seed + 1), (b, l), 0, cfg.vocab_size)
  params = nn.unbox(jax.jit(model.init)(jax.random.PRNGKey(seed), tok)["params"])   # one compile, not eager
  return model, params, tok


def apply(model, params, tok, **kw):
  """model.apply as one jitted program (eager linen would dispatch, and compile, op by op)."""
  return jax.jit(functools.partial(model.apply, **kw))({"params": params}, tok)


@pytest.mark.parametrize("position", POSITIONS)
def test_causality_by_gradient(position):
  cfg = tiny(position=position)
  model, params, tok = init(cfg, b=1, l=8)
  emb = jnp.take(params["embed"], tok, axis=0)

  def logits_per_position(e):                       # (L,): logits[t].sum() for every t
    return model.apply({"params": params}, tok, inputs_embeds_BxLxD=e)[0].sum(-1)

  jac = np.asarray(jax.jit(jax.jacrev(logits_per_position))(emb))   # (L, 1, L, D): row t = d logits[t]/d emb
  for t in range(8):
    g = jac[t, 0]  # (L, D)
    assert np.all(g[t + 1:] == 0.0), f"{position}: logits[{t}] depend on future embeddings"
    assert np.abs(g[: t + 1]).sum() > 0


@pytest.mark.parametrize("position", POSITIONS)
def test_permutation_equivariance_only_without_positions(position):
  cfg = tiny(position=position, causal=False)
  model, params, tok = init(cfg, b=1, l=8)
  perm = np.array([3, 0, 7, 1, 6, 2, 5, 4])
  fwd = jax.jit(model.apply)
  out = fwd({"params": params}, tok)
  out_perm = fwd({"params": params}, tok[:, perm])
  same = np.allclose(np.asarray(out[:, perm]), np.asarray(out_perm), atol=1e-5)
  # "cat chases mouse" == "mouse chases cat" without positions; any position scheme breaks the symmetry.
  assert same == (position == "none")


def test_gqa_with_all_heads_is_mha_and_mqa_equals_repeated_kv():
  mha = tiny(position="rope", num_heads=4, num_kv_heads=0)
  gqa_full = dataclasses.replace(mha, num_kv_heads=4)
  model, params, tok = init(mha)
  out_mha = apply(model, params, tok)
  np.testing.assert_array_equal(np.asarray(apply(Transformer(gqa_full), params, tok)), np.asarray(out_mha))
  mqa = dataclasses.replace(mha, num_kv_heads=1)
  m_mqa, p_mqa, _ = init(mqa)
  out_mqa = apply(m_mqa, p_mqa, tok)
  p_rep = jax.tree_util.tree_map(lambda x: x, p_mqa)
  for i in range(mha.num_layers):
    for w in ("wk", "wv"):
      p_rep[f"layers_{i}"]["attn"][w] = jnp.repeat(p_mqa[f"layers_{i}"]["attn"][w], 4, axis=1)
  np.testing.assert_allclose(np.asarray(apply(model, p_rep, tok)), np.asarray(out_mqa), atol=1e-5)


def stack_layers(params, n):
  out = {k: v for k, v in params.items() if not k.startswith("layers_")}
  out["layers"] = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *[params[f"layers_{i}"] for i in range(n)])
  return out


@pytest.mark.parametrize("position", ["rope", "learned"])
def test_scan_equals_unrolled_and_remat_equals_plain(position):
  cfg = tiny(position=position, num_layers=3, activation="swiglu", norm="rmsnorm")
  model, params, tok = init(cfg)
  scan_cfg = dataclasses.replace(cfg, scan_layers=True)
  sparams = stack_layers(params, cfg.num_layers)

  def loss(m, p):
    return jnp.mean(jax.nn.log_softmax(m.apply({"params": p}, tok))[..., 0])

  ref, g_ref = jax.jit(jax.value_and_grad(functools.partial(loss, model)))(params)
  for remat in ("none", "full", "dots"):
    scan_model = Transformer(dataclasses.replace(scan_cfg, remat=remat))
    val, g = jax.jit(jax.value_and_grad(functools.partial(loss, scan_model)))(sparams)
    np.testing.assert_allclose(float(val), float(ref), rtol=1e-6)
    g_unstacked = stack_layers(g_ref, cfg.num_layers)
    for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(g_unstacked)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
    if remat == cfg.remat:                           # the unrolled plain model is the reference itself
      continue
    unrolled_model = Transformer(dataclasses.replace(cfg, remat=remat))
    val_u, g_u = jax.jit(jax.value_and_grad(functools.partial(loss, unrolled_model)))(params)
    np.testing.assert_allclose(float(val_u), float(ref), rtol=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(g_u), jax.tree_util.tree_leaves(g_ref)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_logical_axis_names_on_params():
  cfg = tiny(position="learned", tie_embeddings=False, scan_layers=True)
  model = Transformer(cfg)
  boxed = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))["params"]
  names = nn.get_partition_spec(boxed)
  assert tuple(names["embed"]) == ("vocab", "embed")
  assert tuple(names["head"]) == ("embed", "vocab")
  assert tuple(names["layers"]["attn"]["wq"]) == ("layers", "embed", "heads", "kv")
  assert tuple(names["layers"]["mlp"]["wo"]) == ("layers", "mlp", "embed")


def test_init_rules():
  cfg = tiny(num_layers=8, d_model=256, qkv_bias=True, mlp_bias=True, vocab_size=512)
  _, params, _ = init(cfg)
  att = params["layers_0"]["attn"]
  assert float(jnp.std(att["wq"])) == pytest.approx(0.02, rel=0.05)
  assert float(jnp.std(att["wo"])) == pytest.approx(0.02 / 4.0, rel=0.05)  # 1/sqrt(2*8)
  assert float(jnp.abs(att["bq"]).max()) == 0.0
  assert float(jnp.std(params["layers_0"]["mlp"]["wo"])) == pytest.approx(0.005, rel=0.05)


def test_learned_positions_refuse_longer_sequences():
  cfg = tiny(position="learned", max_len=8)
  model = Transformer(cfg)
  with pytest.raises(ValueError, match="max_len"):
    jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((1, 9), jnp.int32))


def test_padding_mask_isolates_pad_tokens():
  cfg = tiny(position="rope", causal=False)
  model, params, tok = init(cfg, b=1, l=8)
  mask = jnp.array([[1, 1, 1, 1, 1, 0, 0, 0]])
  a = apply(model, params, tok, attention_mask_BxL=mask)
  b = apply(model, params, tok.at[:, 5:].set(7), attention_mask_BxL=mask)
  np.testing.assert_allclose(np.asarray(a[:, :5]), np.asarray(b[:, :5]), atol=1e-6)


def test_bf16_compute_with_f32_params():
  cfg = tiny(dtype="bfloat16", position="rope")
  model, params, tok = init(cfg)
  assert params["embed"].dtype == jnp.float32
  out = apply(model, params, tok)
  ref = apply(Transformer(dataclasses.replace(cfg, dtype="float32")), params, tok)
  assert out.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=0.05)
