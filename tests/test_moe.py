"""Mixture-of-experts: dispatch equivalences, exact token dropping, aux losses, Mixtral parity,
expert sharding. Float32 comparisons use atol/rtol 1e-5 unless stated."""
from __future__ import annotations

import dataclasses
from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tformer_jax.config import ModelConfig, MoEConfig
from tformer_jax.interop.hf import mixtral_to_params
from tformer_jax.nn.moe import MoEFFN, collect_aux_loss, collect_moe_metrics
from tformer_jax.ops import moe

TOL = dict(atol=1e-5, rtol=1e-5)


def _expert_params(key, activation: str, e: int, d: int, f: int, std: float = 0.3) -> dict:
  names = moe.expert_param_names(activation)
  keys = jax.random.split(key, len(names))
  return {n: std * jax.random.normal(k, (e, f, d) if n in ("w_down", "w_out") else (e, d, f))
          for n, k in zip(names, keys)}


def _cfg(dispatch="dropless", activation="swiglu", e=4, k=2, d=16, f=24, **kw) -> ModelConfig:
  """A tiny MoE ModelConfig; keyword arguments go to MoEConfig or ModelConfig by field name."""
  moe_fields = {fl.name for fl in dataclasses.fields(MoEConfig)}
  moe_kw = {n: v for n, v in kw.items() if n in moe_fields}
  model_kw = {n: v for n, v in kw.items() if n not in moe_fields}
  return ModelConfig(d_model=d, d_ff=f, activation=activation, num_layers=2, **model_kw,
                     moe=MoEConfig(num_experts=e, top_k=k, dispatch=dispatch, **moe_kw))


# ----------------------------------------------------------------------------------------------
# Pure ops

@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_capacity_dropless_naive_agree_with_grads(activation):
  t, d, f, e, k = 24, 8, 12, 4, 2
  kx, kp, kr = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (t, d))
  params = _expert_params(kp, activation, e, d, f)
  w_router = 0.5 * jax.random.normal(kr, (d, e))
  cot = jax.random.normal(jax.random.key(1), (t, d))
  cap = moe.capacity(t, e, k, capacity_factor=float(e))   # ample: = t, nothing can drop

  def run(kind):
    def loss(x, params, w_router):
      weights, experts, _ = moe.route(x @ w_router, top_k=k)
      dropped = jnp.zeros(())
      if kind == "naive":
        y = moe.moe_ffn_naive(x, params, weights, experts, activation=activation)
      elif kind == "dropless":
        y = moe.moe_ffn_dropless(x, params, weights, experts, activation=activation)
      else:
        y, dropped = moe.moe_ffn_capacity(x, params, weights, experts, activation=activation,
                                          capacity=cap, impl=kind.split("_")[1])
      return jnp.sum(y * cot), (y, dropped)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(x, params, w_router)

  (_, (y_ref, _)), g_ref = run("naive")
  for kind in ("dropless", "capacity_einsum", "capacity_scatter"):
    (_, (y, dropped)), g = run(kind)
    assert float(dropped) == 0.0
    np.testing.assert_allclose(y, y_ref, **TOL, err_msg=kind)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
      np.testing.assert_allclose(a, b, **TOL, err_msg=kind)
  assert float(jnp.abs(g_ref[2]).max()) > 0   # the router gets a gradient through the weights


def test_route_renormalize_and_order():
  logits = jnp.array([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 3.5]])
  w, ex, p = moe.route(logits, top_k=2)
  np.testing.assert_array_equal(ex, [[1, 2], [3, 0]])
  assert ex.dtype == jnp.int32 and w.dtype == jnp.float32
  np.testing.assert_allclose(w.sum(-1), 1.0, **TOL)
  ref_p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  np.testing.assert_allclose(p, ref_p, **TOL)
  w_raw, _, _ = moe.route(logits, top_k=2, renormalize=False)
  np.testing.assert_allclose(w_raw, np.take_along_axis(ref_p, np.asarray(ex), -1), **TOL)


def test_capacity_formula():
  assert moe.capacity(4096, 8, 2, 1.25) == 1280
  assert moe.capacity(6, 3, 2, 0.5) == 2
  assert moe.capacity(10, 2, 2, 10.0) == 10     # never more than one slot per token
  assert moe.capacity(3, 64, 1, 0.1) == 1


def test_dropped_tokens_exact():
  # T=6, E=3, K=2, C=2. Priority: all top-1 choices in token order, then all top-2 choices.
  experts = jnp.array([[0, 1], [0, 2], [0, 1], [1, 0], [2, 1], [0, 2]], jnp.int32)
  weights = jnp.array([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5], [0.9, 0.1], [0.8, 0.2], [0.55, 0.45]])
  # top-1 pass: t0->e0 s0, t1->e0 s1, t2->e0 DROP, t3->e1 s0, t4->e2 s0, t5->e0 DROP
  # top-2 pass: t0->e1 s1, t1->e2 s1, t2->e1 DROP, t3->e0 DROP, t4->e1 DROP, t5->e2 DROP
  keep_expected = np.array([[1, 1], [1, 1], [0, 0], [1, 0], [1, 0], [0, 0]], bool)
  slots = {(0, 0, 0), (1, 0, 1), (3, 1, 0), (4, 2, 0), (0, 1, 1), (1, 2, 1)}  # (token, expert, slot)
  dispatch_expected = np.zeros((6, 3, 2), np.float32)
  for ijk in slots:
    dispatch_expected[ijk] = 1.0
  cap = moe.capacity(6, 3, 2, 0.5)
  dispatch, combine, dropped = jax.jit(moe.capacity_dispatch, static_argnums=(2, 3))(
      weights, experts, 3, cap)
  np.testing.assert_array_equal(dispatch, dispatch_expected)
  w_of = {(t, int(experts[t, j])): float(weights[t, j]) for t in range(6) for j in range(2)}
  combine_expected = dispatch_expected * np.array(
      [[[w_of.get((t, ei), 0.0)] for ei in range(3)] for t in range(6)], np.float32)
  np.testing.assert_allclose(combine, combine_expected, **TOL)
  assert float(dropped) == pytest.approx(6 / 12)
  np.testing.assert_array_equal(moe.kept_assignments(experts, 3, cap), keep_expected)

  # The capacity FFN equals the naive loop with the dropped assignments removed.
  params = _expert_params(jax.random.key(2), "swiglu", 3, 8, 12)
  x = jax.random.normal(jax.random.key(3), (6, 8))
  y_ref = jax.jit(partial(moe.moe_ffn_naive, activation="swiglu"))(
      x, params, weights, experts, keep_TxK=jnp.asarray(keep_expected))
  for impl in ("einsum", "scatter"):
    y, dropped = jax.jit(partial(moe.moe_ffn_capacity, activation="swiglu", capacity=cap,
                                 impl=impl))(x, params, weights, experts)
    np.testing.assert_allclose(y, y_ref, **TOL, err_msg=impl)
    assert float(dropped) == pytest.approx(6 / 12)
  np.testing.assert_allclose(y[2], 0.0)   # token 2 lost both choices; token 5 too
  np.testing.assert_allclose(y[5], 0.0)


def test_load_balancing_loss_uniform_is_one():
  t, e = 8, 4
  for k in (1, 2):
    experts = (jnp.arange(t)[:, None] + jnp.arange(k)[None]) % e     # every expert equally used
    np.testing.assert_allclose(moe.expert_load(experts, e), np.full(e, 1 / e), **TOL)
    probs = jax.nn.softmax(jax.random.normal(jax.random.key(k), (t, e)))
    # f uniform => E * sum_i (1/E) P_i = sum_i P_i = 1 whatever the probabilities.
    assert float(moe.load_balancing_loss(probs, experts, e)) == pytest.approx(1.0, abs=1e-6)
    uniform = jnp.full((t, e), 1 / e)
    assert float(moe.load_balancing_loss(uniform, experts, e)) == pytest.approx(1.0, abs=1e-6)


def test_load_balancing_loss_grows_as_routing_collapses():
  t, e, c = 8, 4, 2.0
  losses = []
  for m in range(2, t + 1):   # first m tokens -> expert 0, the rest round-robin over experts 1..3
    assign = np.array([0] * m + [1 + i % (e - 1) for i in range(t - m)])
    logits = c * jax.nn.one_hot(assign, e)
    w, ex, p = moe.route(logits, top_k=1)
    np.testing.assert_array_equal(ex[:, 0], assign)
    losses.append(float(moe.load_balancing_loss(p, ex, e)))
  assert losses[0] == pytest.approx(1.0, abs=1e-6)            # m = 2: balanced
  assert all(b > a + 1e-4 for a, b in zip(losses, losses[1:])), losses
  # Full collapse with confident probabilities approaches E / top_k.
  for k in (1, 2):
    logits = jnp.tile(jnp.array([[40.0, 20.0, 0.0, 0.0]]), (t, 1))
    _, ex, p = moe.route(logits, top_k=k)
    assert float(moe.load_balancing_loss(p, ex, e)) == pytest.approx(e / k, rel=1e-5)


def test_router_z_loss_and_entropy_formulas():
  logits = np.random.RandomState(0).randn(10, 5).astype(np.float32) * 3
  lse = np.log(np.exp(logits.astype(np.float64)).sum(-1))
  assert float(moe.router_z_loss(jnp.asarray(logits))) == pytest.approx(np.mean(lse ** 2), rel=1e-5)
  p = np.exp(logits - lse[:, None])
  ent = -(p * np.log(p)).sum(-1).mean()
  assert float(moe.router_entropy(jnp.asarray(p))) == pytest.approx(ent, rel=1e-5)
  assert float(moe.router_entropy(jnp.full((3, 5), 0.2))) == pytest.approx(np.log(5), rel=1e-6)
  assert float(moe.router_entropy(jax.nn.one_hot(jnp.arange(3), 5))) == 0.0


def test_jitter_range_and_identity():
  x = jnp.ones((64, 16))
  y = moe.jitter(x, jax.random.key(0), 0.1)
  assert float(y.min()) >= 0.9 and float(y.max()) <= 1.1 and float(jnp.std(y)) > 0.01
  assert moe.jitter(x, jax.random.key(0), 0.0) is x


# ----------------------------------------------------------------------------------------------
# The linen layer

def _apply(cfg, params, x, *, deterministic=True, rngs=None):
  """Jitted MoEFFN(cfg).apply returning (y, mutables); jit keeps the many small ops fast on CPU."""
  def fn(p, x, r):
    return MoEFFN(cfg).apply({"params": p}, x, deterministic=deterministic, rngs=r,
                             mutable=["aux_loss", "moe_metrics"])
  return jax.jit(fn)(params, x, rngs)


def _random_params(cfg, seed=0, std=0.3) -> dict:
  """MoEFFN-shaped params without compiling an init (init itself is tested separately)."""
  e, d, f = cfg.moe.num_experts, cfg.d_model, cfg.moe.d_ff or cfg.ff
  kr, ke = jax.random.split(jax.random.key(seed))
  return {"router": std * jax.random.normal(kr, (d, e)),
          **_expert_params(ke, cfg.activation, e, d, f, std)}


def _init_apply(cfg, x):
  mod = MoEFFN(cfg)
  params = nn.unbox(jax.jit(mod.init)(jax.random.key(0), x)["params"])
  y, mut = _apply(cfg, params, x)
  return mod, params, y, mut


@pytest.mark.parametrize("activation", ["swiglu", "gelu_tanh"])
def test_layer_dispatch_modes_agree(activation):
  x = jax.random.normal(jax.random.key(4), (2, 6, 16))
  cfg = _cfg("dropless", activation, init_std=0.2, scale_residual_init=False)
  mod, params, y_dl, mut = _init_apply(cfg, x)
  assert y_dl.shape == x.shape
  names = moe.expert_param_names(activation)
  assert set(params) == {"router", *names}
  assert params["router"].shape == (16, 4) and params[names[0]].shape == (4, 16, 24)
  cap_cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, dispatch="capacity",
                                                             capacity_factor=2.0))
  y_cap, mut_cap = _apply(cap_cfg, params, x)
  np.testing.assert_allclose(y_cap, y_dl, **TOL)
  # Independent reference from the pure naive loop with the layer's own weights.
  @jax.jit
  def naive(x_TxD, params):
    w, ex, _ = moe.route(x_TxD @ params["router"], top_k=2)
    return moe.moe_ffn_naive(x_TxD, params, w, ex, activation=activation)
  y_ref = naive(x.reshape(-1, 16), params)
  np.testing.assert_allclose(y_dl.reshape(-1, 16), y_ref, **TOL)
  m = collect_moe_metrics(mut_cap)
  assert float(m["moe_dropped_fraction"]) == 0.0
  np.testing.assert_allclose(m["moe_load"].sum(), 1.0, **TOL)


def test_layer_aux_losses_sown_with_coefficients():
  x = jax.random.normal(jax.random.key(5), (2, 6, 16))
  cfg = _cfg(aux_loss_coef=0.3, z_loss_coef=0.07)
  params = _random_params(cfg)
  _, mut = _apply(cfg, params, x)
  @jax.jit
  def reference(x_TxD, w_router):
    logits = x_TxD @ w_router
    _, ex, p = moe.route(logits, top_k=2)
    return moe.load_balancing_loss(p, ex, 4), moe.router_z_loss(logits), ex
  lb, z, ex = reference(x.reshape(-1, 16), params["router"])
  assert float(mut["aux_loss"]["moe_load_balance"][0]) == pytest.approx(0.3 * float(lb), rel=1e-5)
  assert float(mut["aux_loss"]["moe_z_loss"][0]) == pytest.approx(0.07 * float(z), rel=1e-5)
  assert float(collect_aux_loss(mut)) == pytest.approx(0.3 * float(lb) + 0.07 * float(z), rel=1e-5)
  assert float(collect_aux_loss({})) == 0.0
  m = collect_moe_metrics(mut)
  assert set(m) == {"moe_load", "moe_load_max", "moe_load_min", "moe_load_ratio",
                    "moe_dropped_fraction", "moe_router_entropy", "moe_load_balance", "moe_z_loss"}
  np.testing.assert_allclose(m["moe_load"], moe.expert_load(ex, 4), **TOL)


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_router_gradients_nonzero(dispatch):
  x = jax.random.normal(jax.random.key(6), (2, 8, 16))
  cfg = _cfg(dispatch)
  mod, params = MoEFFN(cfg), _random_params(cfg)

  def loss(params, aux_only=False):
    y, mut = mod.apply({"params": params}, x, mutable=["aux_loss", "moe_metrics"])
    aux = collect_aux_loss(mut)
    return aux if aux_only else jnp.mean(y ** 2) + aux

  g, g_aux = jax.jit(lambda p: (jax.grad(loss)(p), jax.grad(partial(loss, aux_only=True))(p)))(
      params)
  for n, v in g.items():
    assert float(jnp.abs(v).max()) > 0, n
  assert float(jnp.abs(g_aux["router"]).max()) > 0


def test_shared_expert_adds_dense_ffn():
  x = jax.random.normal(jax.random.key(7), (1, 5, 16))
  cfg = _cfg(shared_expert=True)
  _, params, y, _ = _init_apply(cfg, x)
  assert params["shared_w_gate"].shape == (16, 24) and params["shared_w_down"].shape == (24, 16)
  routed = {k: v for k, v in params.items() if not k.startswith("shared_")}
  y_routed = _apply(_cfg(), routed, x)[0]
  shared = {k[len("shared_"):]: v for k, v in params.items() if k.startswith("shared_")}
  dense = jax.jit(lambda x, p: moe.dense_ffn(x, p, activation="swiglu"))
  y_shared = dense(x.reshape(-1, 16), shared).reshape(x.shape)
  np.testing.assert_allclose(y, y_routed + y_shared, **TOL)


def test_jitter_only_when_training():
  x = jax.random.normal(jax.random.key(8), (2, 16, 16))
  cfg = _cfg(jitter=0.5)
  params = _random_params(cfg, std=0.5)
  rngs = {"dropout": jax.random.key(9)}
  y_det = _apply(cfg, params, x, deterministic=True, rngs=rngs)[0]
  y_plain = _apply(_cfg(), params, x)[0]    # jitter=0 config: the same deterministic function
  np.testing.assert_array_equal(y_det, y_plain)
  y_train = _apply(cfg, params, x, deterministic=False, rngs=rngs)[0]
  assert float(jnp.abs(y_train - y_det).max()) > 1e-4


def test_bfloat16_compute():
  x = jax.random.normal(jax.random.key(10), (2, 4, 16))
  params = _random_params(_cfg())
  for dispatch in ("dropless", "capacity"):
    cfg = dataclasses.replace(_cfg(dispatch), dtype="bfloat16")
    y, mut = _apply(cfg, params, x)
    assert y.dtype == jnp.bfloat16
    assert bool(jnp.all(jnp.isfinite(y.astype(jnp.float32))))
    assert mut["aux_loss"]["moe_z_loss"][0].dtype == jnp.float32


@pytest.mark.reference
@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_mixtral_parity(dispatch):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
  hc = transformers.MixtralConfig(hidden_size=16, intermediate_size=24, num_local_experts=4,
                                  num_experts_per_tok=2, router_jitter_noise=0.0)
  torch.manual_seed(0)
  block = MixtralSparseMoeBlock(hc).eval()
  for p in block.parameters():
    torch.nn.init.normal_(p, std=0.2)
  sd = {k: v.detach().numpy() for k, v in block.state_dict().items()}
  x = np.random.RandomState(0).randn(2, 7, 16).astype(np.float32)
  with torch.no_grad():
    ref = block(torch.from_numpy(x.copy())).numpy()
  cfg = _cfg(dispatch, capacity_factor=2.0)    # capacity = T: nothing can drop
  y, mut = _apply(cfg, mixtral_to_params(sd), jnp.asarray(x))
  np.testing.assert_allclose(np.asarray(y), ref, **TOL)
  assert float(collect_moe_metrics(mut)["moe_dropped_fraction"]) == 0.0


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_expert_sharded_matches_unsharded(dispatch):
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices")
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
  cfg = _cfg(dispatch, e=8, capacity_factor=1.0)
  mod = MoEFFN(cfg)
  x = jax.random.normal(jax.random.key(11), (4, 8, 16))
  variables = mod.init(jax.random.key(0), x)
  params = nn.unbox(variables["params"])

  def loss(params, x):
    y, mut = mod.apply({"params": params}, x, mutable=["aux_loss", "moe_metrics"])
    return jnp.mean(y ** 2) + collect_aux_loss(mut), y

  f = jax.value_and_grad(loss, has_aux=True)
  (l_ref, y_ref), g_ref = jax.jit(f)(params, x)

  mesh = jax.make_mesh((8,), ("expert",), axis_types=(AxisType.Auto,))
  with jax.set_mesh(mesh):
    specs = nn.get_partition_spec(variables)["params"]
    shardings = nn.logical_to_mesh_sharding(specs, mesh, [("expert", "expert")])
    assert shardings["w_gate"].spec == P("expert", None, None)
    assert shardings["router"].spec == P(None, "expert")
    sharded = jax.device_put(params, shardings)
    assert len(sharded["w_down"].addressable_shards) == 8
    assert sharded["w_down"].addressable_shards[0].data.shape == (1, 24, 16)
    (l, y), g = jax.jit(f, in_shardings=(shardings, NamedSharding(mesh, P())))(sharded, x)
  np.testing.assert_allclose(y, y_ref, **TOL)
  np.testing.assert_allclose(l, l_ref, **TOL)
  for n in g_ref:
    np.testing.assert_allclose(g[n], g_ref[n], **TOL, err_msg=n)
