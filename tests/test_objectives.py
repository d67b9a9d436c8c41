"""Encoders train on BERT's masked LM (train/objectives.py): masking statistics, loss only on the chosen
positions, a tiny Post-LN encoder trained on Shakespeare through the loop (loss falls, masked-token
accuracy reported, tformer-eval reproduces it), and the one-line errors."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tformer_jax import decode
from tformer_jax.cli import eval as eval_cli
from tformer_jax.config import ConfigError, ModelConfig
from tformer_jax.nn import Transformer
from tformer_jax.train import loop, objectives, step as step_lib
from tformer_jax.train.metrics import read_metrics

from train_utils import tiny_config

VOCAB, MASK = 257, 256   # bytes + [MASK] (the default id: vocab_size - 1)


def _encoder(**kw) -> ModelConfig:
  base = dict(vocab_size=VOCAB, d_model=32, num_layers=2, num_heads=4, max_len=32, causal=False,
              norm_position="post", final_norm=False, embed_norm=True, position="learned")
  return ModelConfig(**{**base, **kw})


def test_bert_masking_statistics():
  """15% of the real tokens chosen (never padding), split 80/10/10 into [MASK] / random / unchanged;
  the rest untouched; random ids are real ids, never [MASK]. Tolerances: > 5 standard deviations."""
  b, l = 64, 512
  tokens = jax.random.randint(jax.random.PRNGKey(1), (b, l), 0, 256)
  seg = np.ones((b, l), np.int32)
  seg[::2, l // 2:] = 0                       # half the rows end in padding (segment 0)
  batch = {"inputs": tokens, "targets": tokens, "segment_ids": jnp.asarray(seg)}
  out = jax.jit(lambda bt, r: objectives.masked_lm_batch(bt, r, _encoder()))(batch, jax.random.PRNGKey(7))
  x, t, chosen = (np.asarray(out[k]) for k in ("inputs", "targets", "loss_mask"))
  chosen = chosen.astype(bool)
  real = seg != 0
  np.testing.assert_array_equal(t, np.asarray(tokens))          # targets: the original tokens
  assert not chosen[~real].any()                                  # never on padding
  rate = chosen[real].mean()
  assert abs(rate - 0.15) < 0.006, rate                           # n ~ 24.6k real tokens: sd 0.0023
  np.testing.assert_array_equal(x[~chosen], t[~chosen])          # unchosen tokens untouched
  xc, tc = x[chosen], t[chosen]
  n = len(xc)
  is_mask, same = xc == MASK, xc == tc
  is_random = ~is_mask & ~same
  # a random id equals the original with probability 1/256: counted as unchanged
  assert abs(is_mask.mean() - 0.8) < 0.03, is_mask.mean()        # sd 0.006
  assert abs(is_random.mean() - 0.1 * 255 / 256) < 0.025, is_random.mean()   # sd 0.0045
  assert abs(same.mean() - (0.1 + 0.1 / 256)) < 0.025, same.mean()
  assert n > 3000 and xc[is_random].max() < MASK and xc[is_random].min() >= 0
  assert len(np.unique(xc[is_random])) > 150    # ~370 draws over 255 ids: ~195 distinct expected
  # a pure function of (tokens, rng): the same key, the same masks; another key, others
  again = objectives.masked_lm_batch(batch, jax.random.PRNGKey(7), _encoder())
  np.testing.assert_array_equal(np.asarray(again["inputs"]), x)
  other = objectives.masked_lm_batch(batch, jax.random.PRNGKey(8), _encoder())
  assert not np.array_equal(np.asarray(other["loss_mask"]), np.asarray(out["loss_mask"]))
  # an explicit mask_token_id in the middle of the vocabulary: random ids skip it
  mid = objectives.masked_lm_batch(batch, jax.random.PRNGKey(7), _encoder(mask_token_id=5))
  xm, cm = np.asarray(mid["inputs"]), np.asarray(mid["loss_mask"]).astype(bool)
  assert (xm[cm] == 5).mean() > 0.75 and xm.max() < VOCAB


def test_loss_only_on_the_masked_positions():
  """The step's loss is the NLL of the original tokens at the chosen positions: its gradient with
  respect to the logits is exactly zero elsewhere, the eval count is the number chosen and its
  accuracy counts those positions only; the eval masks are the same at every call."""
  cfg = _encoder(num_layers=1)
  model = Transformer(cfg)
  params = nn.unbox(jax.jit(model.init)(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))["params"])
  tokens = jax.random.randint(jax.random.PRNGKey(3), (4, 32), 0, 256)
  mb = objectives.masked_lm_batch({"inputs": tokens, "targets": tokens}, jax.random.PRNGKey(5), cfg)
  chosen = np.asarray(mb["loss_mask"]).astype(bool)
  assert 0 < chosen.sum() < chosen.size

  def nll_sum(lg):
    return jnp.sum(step_lib.cross_entropy(lg, mb["targets"]) * mb["loss_mask"])

  @jax.jit
  def check(p):
    loss_sum, (count, _) = step_lib.loss_sum_fn(model, p, mb, None, train=False)
    logits = model.apply({"params": p}, mb["inputs"])
    return loss_sum, count, nll_sum(logits), jax.grad(nll_sum)(logits)

  loss_sum, count, want, g = check(params)
  np.testing.assert_allclose(float(loss_sum), float(want), rtol=1e-6)
  assert int(count) == chosen.sum()
  g = np.asarray(g)
  assert np.all(g[~chosen] == 0.0) and np.all(np.abs(g[chosen]).sum(-1) > 0)
  ev = jax.jit(lambda p, b: step_lib.eval_step(p, b, model=model))
  raw = {"inputs": tokens, "targets": tokens}
  e1, e2 = ev(params, raw), ev(params, raw)
  assert {k: float(v) for k, v in e1.items()} == {k: float(v) for k, v in e2.items()}
  assert 0 < float(e1["count"]) < tokens.size and float(e1["correct"]) <= float(e1["count"])


def test_encoder_trains_on_shakespeare_and_reports_masked_accuracy(tmp_path):
  c = tiny_config(steps=30)
  m = c.model
  m.vocab_size, m.causal, m.norm_position, m.final_norm, m.embed_norm = VOCAB, False, "post", False, True
  m.position, m.norm, m.type_vocab_size = "learned", "layernorm", 2
  c.train.eval_every, c.train.log_every, c.train.sample_tokens = 15, 5, 50   # no sample from an encoder
  final = loop.train(c, tmp_path)
  rows = read_metrics(tmp_path)
  losses = [r["loss"] for r in rows if "loss" in r]
  evals = [r for r in rows if "val_loss" in r]
  assert losses[-1] < losses[0] - 1.0, losses               # ln(257) = 5.55 at the start
  assert [r["step"] for r in evals] == [15, 30] and evals[-1]["val_loss"] < evals[0]["val_loss"]
  assert 0.1 < final["val_accuracy"] < 1.0                    # masked-token accuracy, well above 1/256
  assert "sample" not in final
  # tformer-eval on the workdir: the same masked batches, so the loop's final numbers exactly
  res = eval_cli.main([f"--workdir={tmp_path}"])
  assert res["objective"] == "masked_lm"
  assert res["val_loss"] == pytest.approx(final["val_loss"], rel=1e-6)
  assert res["val_accuracy"] == pytest.approx(final["val_accuracy"], rel=1e-6)


def test_encoder_errors_are_one_line(tmp_path):
  with pytest.raises(ConfigError, match=r"model.vocab_size: an encoder's masked-LM needs an id for \[MASK\].*"
                                        r"vocab_size=257"):
    objectives.check_mask_token(_encoder(vocab_size=256), 256)
  objectives.check_mask_token(_encoder(vocab_size=256, mask_token_id=3), 256)   # the tokenizer's own id
  objectives.check_mask_token(_encoder(), 256)
  model = Transformer(_encoder())
  with pytest.raises(ValueError, match="generation needs a causal decoder"):
    decode.generate(model, {}, [[1, 2]], max_new_tokens=2)
  c = tiny_config(steps=2)
  c.model.causal, c.model.vocab_size = False, 256
  with pytest.raises(ConfigError, match="model.vocab_size: an encoder's masked-LM"):
    loop.train(c, tmp_path / "run")
  assert not (tmp_path / "run").exists()
