"""Multi-token prediction (DeepSeek-V3 section 2.2; nn/mtp.py, ops/mtp.py, train/step.py).

The shifted targets on a concrete row (packed documents too); the train step's loss decomposed by hand:
main + lambda x the mean of the D depths' losses, each depth run from its module's parameters with the
token indices written out (a shift off by one fails it); the MTP modules never run outside the loss
(logits and greedy generation equal the same weights without them); a short training run logs mtp_loss;
refusals."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tformer_jax import decode
from tformer_jax.config import ConfigError, ModelConfig
from tformer_jax.config.model_rules import validate_model
from tformer_jax.nn import Transformer
from tformer_jax.nn.block import Block
from tformer_jax.nn.transformer import sown_per_layer
from tformer_jax.ops import mtp as mtp_ops
from tformer_jax.train import step as step_lib
from tformer_jax.train.loop import train
from tformer_jax.train.metrics import read_metrics

from train_utils import tiny_config

BASE = dict(vocab_size=37, d_model=32, num_layers=2, num_heads=4, position="rope", norm="rmsnorm", max_len=64,
            activation="swiglu", tie_embeddings=False)


def _model(**kw):
  cfg = ModelConfig(**{**BASE, **kw})
  validate_model(cfg)
  return Transformer(cfg)


def _perturbed(params, seed=5):
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  return jax.tree.unflatten(tree, [x + 0.2 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


def test_depth_targets_shift_by_k_and_mask_the_tail_and_other_documents():
  targets = jnp.array([[11, 12, 13, 14, 15, 16]])
  mask = jnp.array([[1, 1, 1, 0, 1, 1]], jnp.float32)
  t1, m1 = mtp_ops.depth_targets(targets, mask, 1)
  assert t1.tolist() == [[12, 13, 14, 15, 16, 0]] and m1.tolist() == [[1, 1, 0, 1, 1, 0]]
  t2, m2 = mtp_ops.depth_targets(targets, mask, 2)
  assert t2.tolist() == [[13, 14, 15, 16, 0, 0]] and m2.tolist() == [[1, 0, 1, 1, 0, 0]]
  assert mtp_ops.depth_inputs(targets, 1).tolist() == targets.tolist()
  assert mtp_ops.depth_inputs(targets, 2).tolist() == [[12, 13, 14, 15, 16, 0]]
  seg = jnp.array([[1, 1, 1, 2, 2, 2]])
  _, ms = mtp_ops.depth_targets(targets, jnp.ones_like(mask), 1, seg)
  assert ms.tolist() == [[1, 1, 0, 1, 1, 0]]   # position 2's target t_4 is in document 2


def _by_hand(model, params, inputs, targets, depth):
  """Depth k's mean cross-entropy over positions i < L - k, written out: h^0 the last block's output, the
  input token at i is inputs[i + k], the target targets[i + k] (= token i + k + 1)."""
  cfg = model.cfg
  _, mut = model.apply({"params": params}, inputs, mutable=["intermediates"])
  h = sown_per_layer(mut["intermediates"], "block_out")[-1]
  b, l = inputs.shape
  rms = lambda x, w: x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + cfg.norm_eps) * w   # noqa: E731
  pos = jnp.broadcast_to(jnp.arange(l), (b, l))
  out = []
  for k in range(1, depth + 1):
    p = params[f"mtp_{k - 1}"]
    nxt = jnp.concatenate([inputs[:, k:], jnp.zeros((b, k), inputs.dtype)], axis=1)   # token i + k (0 past the end)
    e = params["embed"][nxt]
    x = jnp.concatenate([rms(e, p["enorm"]["scale"]), rms(h, p["hnorm"]["scale"])], -1) @ p["eh_proj"]
    h, _ = Block(cfg).apply({"params": p["block"]}, x, pos, None, jnp.zeros((), jnp.int32), None)
    logits = rms(h, p["final_norm"]["scale"]) @ params["head"]
    logp = jax.nn.log_softmax(logits[:, :l - k], -1)
    nll = -jnp.take_along_axis(logp, targets[:, k:, None], -1)[..., 0]                  # token i + k + 1
    out.append(float(jnp.mean(nll)))
  return out


@pytest.mark.parametrize("loss_chunk", [0, 16])
def test_loss_is_main_plus_lambda_times_the_mean_of_the_depths_by_hand(loss_chunk):
  """D = 2, lambda = 0.3: the train loss (full logits and the chunked loss) is the main cross-entropy plus 0.3
  x the mean of the two depths' losses computed by hand; the logged mtp_loss is that mean."""
  model = _model(mtp_depth=2)
  seq = jax.random.randint(jax.random.PRNGKey(1), (3, 21), 0, 37)
  inputs, targets = seq[:, :-1], seq[:, 1:]
  params = _perturbed(nn.unbox(model.init(jax.random.PRNGKey(0), inputs)["params"]))
  assert {"mtp_0", "mtp_1"} <= set(params) and set(params["mtp_0"]) == {"enorm", "hnorm", "eh_proj", "block",
                                                                         "final_norm"}
  batch = {"inputs": inputs, "targets": targets}
  total, (count, metrics) = jax.jit(lambda p: step_lib.loss_sum_fn(model, p, batch, None, train=False,
                                                                   loss_chunk=loss_chunk, mtp_weight=0.3))(params)
  main = float(jnp.mean(step_lib.cross_entropy(model.apply({"params": params}, inputs), targets)))
  depths = _by_hand(model, params, inputs, targets, 2)
  assert float(metrics["nll_sum"]) / float(count) == pytest.approx(main, rel=1e-5)
  assert float(metrics["mtp_loss"]) == pytest.approx(np.mean(depths), rel=1e-5)
  assert float(total) / float(count) == pytest.approx(main + 0.3 * np.mean(depths), rel=1e-5)
  assert abs(depths[0] - depths[1]) > 1e-3   # the depths differ: each has its own targets and module
  # the gradient reaches every MTP parameter
  grads = jax.grad(lambda p: step_lib.loss_sum_fn(model, p, batch, None, train=False, mtp_weight=0.3)[0])(params)
  assert all(float(jnp.max(jnp.abs(g))) > 0 for g in jax.tree.leaves(grads["mtp_1"]))


def test_modules_never_run_outside_the_loss_generation_unaffected():
  """Logits and greedy generation of an mtp_depth=2 model equal those of its main weights alone on an
  mtp_depth=0 model; no MTP variable enters the decode cache."""
  model, plain = _model(mtp_depth=2), _model()
  params = _perturbed(nn.unbox(model.init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"]))
  main = {k: v for k, v in params.items() if not k.startswith("mtp_")}
  tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 12), 0, 37)
  np.testing.assert_array_equal(np.asarray(model.apply({"params": params}, tokens)),
                                np.asarray(plain.apply({"params": main}, tokens)))
  assert not any(k.startswith("mtp_") for k in decode.init_cache(model, params, 1, 16))
  prompts = [[5, 9, 2, 33], [3]]
  a = decode.generate(model, params, prompts, max_new_tokens=6, temperature=0.0, max_len=16)
  b = decode.generate(plain, main, prompts, max_new_tokens=6, temperature=0.0, max_len=16)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_training_logs_mtp_loss_and_the_loss_adds_its_weight(tmp_path):
  """tformer's loop with model.mtp_depth=1, train.mtp_loss_weight=0.5: every step logs mtp_loss, and
  loss = nll + 0.5 mtp_loss (a dense model: no other term); the loss falls."""
  cfg = tiny_config(steps=4, **{"model.mtp_depth": 1, "train.mtp_loss_weight": 0.5, "model.num_layers": 1})
  train(cfg, str(tmp_path))
  rows = [r for r in read_metrics(tmp_path) if "mtp_loss" in r]
  assert len(rows) == 4
  for r in rows:
    assert r["loss"] == pytest.approx(r["nll"] + 0.5 * r["mtp_loss"], rel=1e-5)
  assert rows[-1]["loss"] < rows[0]["loss"]


@pytest.mark.parametrize("kw,needle", [(dict(mtp_depth=-1), "must be >= 0"),
                                       (dict(mtp_depth=1, causal=False), "needs causal=True and lm_head=True")])
def test_bad_depths_are_refused_in_one_line(kw, needle):
  with pytest.raises(ConfigError, match=needle) as e:
    validate_model(ModelConfig(**{**BASE, **kw}))
  assert "\n" not in str(e.value) and "model.mtp_depth" in str(e.value)
