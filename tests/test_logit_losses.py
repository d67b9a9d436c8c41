"""The loss's logit options (ops/losses.py): PaLM's z-loss (z * logsumexp^2 per token) and Gemma's
final-logit soft-cap (cap * tanh(logits / cap)), against the direct formula on a hand example and the
full logits, in every path (full logits, chunked per-token, fused chunked sum), gradients included."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tformer_jax.ops import losses
from tformer_jax.train import optim, precision, state as state_lib, step as step_lib


def _case(seed=0, b=2, l=7, d=8, v=13):
  k = jax.random.split(jax.random.PRNGKey(seed), 4)
  h = jax.random.normal(k[0], (b, l, d))
  w = 2.0 * jax.random.normal(k[1], (d, v))        # large logits: the cap bites
  t = jax.random.randint(k[2], (b, l), 0, v)
  m = (jax.random.uniform(k[3], (b, l)) > 0.3).astype(jnp.float32)
  return h, w, t, m


def _formula(h, w, t, m, softcap, z):
  """The textbook loss in float64 numpy: capped logits, NLL, z * lse^2, all weighted by m."""
  x = np.einsum("bld,dv->blv", np.float64(h), np.float64(w))
  if softcap:
    x = softcap * np.tanh(x / softcap)
  mx = x.max(-1, keepdims=True)
  lse = (mx + np.log(np.exp(x - mx).sum(-1, keepdims=True)))[..., 0]
  nll = lse - np.take_along_axis(x, np.asarray(t)[..., None], -1)[..., 0]
  m = np.float64(m)
  return (nll * m).sum() + z * (lse ** 2 * m).sum(), (nll * m).sum(), (lse ** 2 * m).sum()


def test_z_loss_on_a_hand_example():
  """One token, logits (0, ln 3) (D=2 identity unembedding), target 0: lse = ln 4, nll = ln 4,
  z-loss 0.1 * (ln 4)^2, exactly (float32 rounding)."""
  h = jnp.asarray([[[0.0, np.log(3.0)]]], jnp.float32)
  w = jnp.eye(2, dtype=jnp.float32)
  t = jnp.zeros((1, 1), jnp.int32)
  for chunk in (0, 1):
    total, nll, lse_sq = losses.loss_sums(h, w, t, chunk=chunk, z_loss=0.1)
    np.testing.assert_allclose(nll, np.log(4.0), rtol=1e-6)
    np.testing.assert_allclose(lse_sq, np.log(4.0) ** 2, rtol=1e-6)
    np.testing.assert_allclose(total, np.log(4.0) + 0.1 * np.log(4.0) ** 2, rtol=1e-6)
    # the gradient of z * lse^2 w.r.t. the logits is 2 z lse softmax: (1/4, 3/4) here
    g = jax.grad(lambda h, c=chunk: losses.loss_sums(h, w, t, chunk=c, z_loss=0.1)[0])(h)
    p = np.array([0.25, 0.75])
    np.testing.assert_allclose(g[0, 0], p - np.array([1.0, 0.0]) + 0.2 * np.log(4.0) * p, rtol=1e-5)


@pytest.mark.parametrize("softcap,z", [(0.0, 0.0), (3.0, 0.0), (0.0, 1e-2), (3.0, 1e-2)])
def test_chunked_equals_unchunked_equals_formula_with_grads(softcap, z):
  """loss_sums (full logits, fused chunks of 1, 3 and more than the tokens) equals the float64 formula
  (1e-5), and its gradients w.r.t. h, w and the weights equal the full-logits path's autodiff (1e-5);
  the per-token chunked cross_entropy (its own custom VJP) agrees with the soft-cap too."""
  h, w, t, m = _case()
  want_total, want_nll, want_lse_sq = _formula(h, w, t, m, softcap, z)

  def total(h, w, m, chunk):
    return losses.loss_sums(h, w, t, m, chunk=chunk, softcap=softcap, z_loss=z)

  def with_aux(h, w, m, chunk):
    tot, nll, lse_sq = total(h, w, m, chunk)
    return tot, (nll, lse_sq)

  ref_val, ref_grads = jax.value_and_grad(lambda *a: total(*a, 0)[0], (0, 1, 2))(h, w, m)
  for chunk in (0, 2, 5, 1000):
    (tot, (nll, lse_sq)), grads = jax.value_and_grad(with_aux, (0, 1, 2), has_aux=True)(h, w, m, chunk)
    np.testing.assert_allclose([tot, nll, lse_sq], [want_total, want_nll, want_lse_sq], rtol=1e-5)
    for g, r in zip(grads, ref_grads):
      np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
  # the same gradients from the formula by autodiff in float32 (the soft-cap through tanh)
  def direct(h, w, m):
    x = jnp.einsum("bld,dv->blv", h, w)
    x = softcap * jnp.tanh(x / softcap) if softcap else x
    lse = jax.nn.logsumexp(x, -1)
    nll = lse - jnp.take_along_axis(x, t[..., None], -1)[..., 0]
    return jnp.sum((nll + z * lse ** 2) * m)
  for g, r in zip(jax.grad(direct, (0, 1, 2))(h, w, m), ref_grads):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
  # per-token NLL paths with the cap: chunked custom VJP == full logits, values and gradients
  per_token = lambda h, w, chunk: jnp.sum(losses.cross_entropy(h, w, t, chunk=chunk, softcap=softcap) * m)  # noqa: E731
  v0, g0 = jax.value_and_grad(per_token, (0, 1))(h, w, 0)
  v2, g2 = jax.value_and_grad(per_token, (0, 1))(h, w, 2)
  np.testing.assert_allclose([v0, v2], [want_nll, want_nll], rtol=1e-5)
  for a, b in zip(g2, g0):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  nll_e, _ = losses.nll_and_correct(h, w, t, chunk=3, softcap=softcap)
  np.testing.assert_allclose(jnp.sum(nll_e * m), want_nll, rtol=1e-5)


def test_softcap_bounds_the_logits_and_rejects_negative():
  h, w, t, _ = _case()
  x = losses.logits(h, w, 3.0)
  assert float(jnp.max(jnp.abs(x))) < 3.0 and float(jnp.max(jnp.abs(losses.logits(h, w)))) > 3.0
  with pytest.raises(ValueError, match="softcap must be >= 0"):
    losses.loss_sums(h, w, t, softcap=-1.0)
  with pytest.raises(ValueError, match="z_loss must be >= 0"):
    losses.loss_sums(h, w, t, z_loss=-1.0)


def test_train_step_adds_the_z_loss_and_logs_it_apart():
  """The float32 train step of a tiny llama with a loss mask and 2 micro-batches: with train.logit_z_loss,
  loss = nll + z_loss (no MoE aux here), z_loss = coefficient * logit_lse_sq, the same with the full logits
  and the chunked loss (1e-5), and the gradient changes; logit_lse_sq is logged without the z-loss too."""
  from test_losses import float32_state_and_batch  # noqa: PLC0415
  cfg, model, data, tx, schedule, state = float32_state_and_batch("configs/llama_tiny.py")

  def runs(state, data):
    return [step_lib.make_train_step(model, tx, schedule, cfg.optim, loss_chunk=chunk, z_loss=z)(state, data)[1]
            for chunk, z in ((0, 0.0), (0, 0.1), (12, 0.1))]

  off, full, chunked = jax.jit(runs)(state, data)
  assert float(off["z_loss"]) == 0.0 and float(off["logit_lse_sq"]) > 1.0
  np.testing.assert_allclose(full["logit_lse_sq"], off["logit_lse_sq"], rtol=1e-6)
  np.testing.assert_allclose(full["z_loss"], 0.1 * full["logit_lse_sq"], rtol=1e-6)
  np.testing.assert_allclose(full["loss"], full["nll"] + full["z_loss"], rtol=1e-5)
  for key in ("loss", "nll", "z_loss", "logit_lse_sq", "grad_norm"):
    np.testing.assert_allclose(chunked[key], full[key], rtol=1e-5)
  assert abs(float(full["grad_norm"]) - float(off["grad_norm"])) > 1e-4


def test_train_and_eval_steps_soft_cap_the_chunked_loss_as_the_model_caps_its_logits():
  """model.final_logit_softcap: the model caps its logits (full-logits path), the chunked loss caps the
  logits it forms from (h, unembedding): the same loss, gradient norm and eval sums (1e-5), and the cap
  changes them."""
  import dataclasses  # noqa: PLC0415

  from test_losses import model_and_batch  # noqa: PLC0415

  from tformer_jax.nn import Transformer  # noqa: PLC0415
  cfg, model, data = model_and_batch("configs/llama_tiny.py", "float32", batch=4, seq=16)
  capped = Transformer(dataclasses.replace(model.cfg, final_logit_softcap=0.05))   # bites at init's small logits
  tx, schedule = optim.make_optimizer(cfg.optim, 10)
  init = state_lib.init_fn(capped, tx, precision.get_policy("float32").initial_loss_scale(), 16)
  state = jax.jit(lambda r: state_lib.unbox_plain(init(r)))(jax.random.PRNGKey(0))

  def runs(state, data):
    return [(step_lib.make_train_step(m, tx, schedule, cfg.optim, loss_chunk=chunk)(state, data)[1],
             step_lib.eval_step(state.params, data, model=m, loss_chunk=chunk))
            for m, chunk in ((capped, 0), (capped, 12), (model, 12))]

  (full, e_full), (chunked, e_chunked), (uncapped, _) = jax.jit(runs)(state, data)
  for key in ("loss", "nll", "logit_lse_sq", "grad_norm"):
    np.testing.assert_allclose(chunked[key], full[key], rtol=1e-5)
  np.testing.assert_allclose(e_chunked["nll_sum"], e_full["nll_sum"], rtol=1e-5)
  assert abs(float(uncapped["loss"]) - float(full["loss"])) > 1e-3
