"""model.remat's named policies (config.REMAT_POLICIES): the same loss and gradients as no remat, and the
activations they name are the ones kept for the backward (jax.ad_checkpoint.print_saved_residuals)."""
import contextlib
import dataclasses
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tformer_jax.config import REMAT_NAMES, REMAT_POLICIES, ModelConfig
from tformer_jax.decode.layout import unstack_layers
from tformer_jax.nn import Transformer

CFG = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, max_len=16,
                  position="rope", norm="rmsnorm", activation="swiglu", scan_layers=True)
NAMED = [k for k, v in REMAT_POLICIES.items() if isinstance(v, tuple)]


def _kept_names(loss, *args) -> set[str]:
  """The REMAT_NAMES among what the backward of `loss` keeps from its forward."""
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    jax.ad_checkpoint.print_saved_residuals(loss, *args)
  return {n for n in REMAT_NAMES if f"'{n}'" in out.getvalue()}


def _loss_fn(cfg):
  model = Transformer(cfg)

  def loss(params, tokens):
    logits = model.apply({"params": params}, tokens[:, :-1])
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1))
  return model, loss


@pytest.fixture(scope="module")
def setup():
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 17), 0, CFG.vocab_size)
  model, loss = _loss_fn(CFG)
  params = model.init(jax.random.PRNGKey(0), tokens[:, :-1])["params"]
  ref = jax.jit(jax.value_and_grad(loss))(params, tokens)
  return params, tokens, ref


def test_every_name_a_policy_keeps_is_tagged():
  assert {n for k in NAMED for n in REMAT_POLICIES[k]} <= set(REMAT_NAMES)
  assert {"save_qkvo", "save_mlp_in"} <= set(NAMED)


@pytest.mark.parametrize("policy", NAMED)
def test_named_policy_equals_no_remat_and_keeps_its_names(setup, policy):
  params, tokens, (ref_loss, ref_grads) = setup
  _, loss = _loss_fn(dataclasses.replace(CFG, remat=policy))
  got_loss, got_grads = jax.jit(jax.value_and_grad(loss))(params, tokens)
  np.testing.assert_allclose(got_loss, ref_loss, rtol=1e-6)
  for g, r in zip(jax.tree.leaves(got_grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
  # what the backward keeps from the forward: the policy's names, and under 'full' none of them (unrolled
  # layers: under scan the kept values show only as the scan's stacked outputs, nameless)
  unrolled = unstack_layers(params, CFG.num_layers)
  _, named = _loss_fn(dataclasses.replace(CFG, remat=policy, scan_layers=False))
  assert _kept_names(named, unrolled, tokens) == set(REMAT_POLICIES[policy])
  _, full = _loss_fn(dataclasses.replace(CFG, remat="full", scan_layers=False))
  assert _kept_names(full, unrolled, tokens) == set()
