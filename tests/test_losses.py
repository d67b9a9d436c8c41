"""The GPU training step's pieces: the chunked cross-entropy (ops/losses.py) against the full-logits
reference, Transformer(return_hidden=True), the train/eval steps with train.loss_chunk, the
once-per-step cast of the matmul weights, and the memory the chunking saves (XLA's compiled memory
analysis: nothing timed)."""
import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tformer_jax.bench import compile as compile_bench
from tformer_jax.config import ConfigError, default_config, load_config_file, validate
from tformer_jax.nn import Transformer
from tformer_jax.ops import losses
from tformer_jax.train import loop, optim, precision, state as state_lib, step as step_lib

from train_utils import REPO

# float32: summation order only. bfloat16: the same bf16 logits and gradients, up to one rounding
# (2^-8 = 0.4%) where the chunked path rounds in another place; 1% of the largest entry.
TOL = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 1e-2}
# The parameters that stay float32 under a bf16 policy (read in float32, or gathered).
FLOAT32_NAMES = {"embed", "pos_embed", "type_embed", "rel_bias", "scale", "bias", "router"}


def rel_err(a, b) -> float:
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def tree_rel_err(a, b) -> float:
  """|a - b| / |b| over whole trees (global 2-norms)."""
  sq = lambda t: sum(float(jnp.sum(jnp.square(x.astype(jnp.float32)))) for x in jax.tree.leaves(t))  # noqa: E731
  return (sq(jax.tree.map(lambda x, y: x.astype(jnp.float32) - y, a, b)) / sq(b)) ** 0.5


def _odd_case(dtype, sizes, seed):
  """h (B, L, D), w (D, V) in dtype, targets and a float32 loss mask (~70% ones), from one seed."""
  b, l, d, v = sizes
  k = jax.random.split(jax.random.PRNGKey(seed), 4)
  h = jax.random.normal(k[0], (b, l, d)).astype(dtype)
  w = (0.5 * jax.random.normal(k[1], (d, v))).astype(dtype)
  t = jax.random.randint(k[2], (b, l), 0, v)
  return h, w, t, (jax.random.uniform(k[3], (b, l)) > 0.3).astype(jnp.float32)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_chunked_losses_match_the_full_logits(dtype):
  """Odd sizes (L=37 is no multiple of any chunk; V=101), a chunk below the batch size (one position
  per chunk), one in between, one above the token count; a loss mask; non-power-of-two scaling."""
  b, l, d, v = 3, 37, 16, 101
  h, w, t, mask = _odd_case(dtype, (b, l, d, v), seed=0)
  tol = TOL[dtype]

  def per_token(h, w, chunk):
    return 0.3 * jnp.sum(losses.cross_entropy(h, w, t, chunk=chunk) * mask)

  def summed(h, w, m, chunk):
    return 0.3 * losses.nll_sum(h, w, t, m, chunk=chunk)

  def everything(h, w, mask):   # one compile: the reference, then each chunk
    return [(jax.value_and_grad(per_token, (0, 1))(h, w, chunk),
             jax.value_and_grad(summed, (0, 1, 2))(h, w, mask, chunk),
             losses.nll_and_correct(h, w, t, chunk=chunk)) for chunk in (0, 2, 7, 1000)]

  (ref, ref_sum, (nll_ref, correct_ref)), *chunked = jax.jit(everything)(h, w, mask)
  np.testing.assert_allclose(ref_sum[0], ref[0], rtol=1e-6)
  np.testing.assert_array_equal(correct_ref, jax.jit(lambda h, w: jnp.argmax(losses.logits(h, w), -1) == t)(h, w))
  for chunk, ((val, (gh, gw)), (val_sum, (gh_s, gw_s, gm_s)), (nll, correct)) in zip((2, 7, 1000), chunked):
    assert gh.dtype == gh_s.dtype == h.dtype and gw.dtype == gw_s.dtype == w.dtype
    for got, want in ((val, ref[0]), (val_sum, ref[0]), (gm_s, ref_sum[1][2])):
      assert rel_err(got, want) < 1e-5, (chunk, rel_err(got, want))
    for got, want in ((gh, ref[1][0]), (gw, ref[1][1]), (gh_s, ref[1][0]), (gw_s, ref[1][1])):
      assert rel_err(got, want) < tol, (chunk, rel_err(got, want))
    assert rel_err(nll, nll_ref) < 1e-5
    np.testing.assert_array_equal(correct, correct_ref)
  with pytest.raises(ValueError, match="chunk must be an integer >= 0"):
    losses.cross_entropy(h, w, t, chunk=-1)


def test_the_loss_working_set_shrinks_with_the_chunk():
  """XLA's compiled memory analysis of value-and-grad of the loss alone: the full form holds several
  float32 (B, L, V) arrays (5 here); the chunked forms about two chunks' worth (logits, their gradient)."""
  b, l, d, v, chunk = 4, 512, 64, 8192, 128
  logits_bytes, chunk_bytes = b * l * v * 4, chunk * v * 4     # 64 MiB, 4 MiB
  args = (jax.ShapeDtypeStruct((b, l, d), jnp.float32), jax.ShapeDtypeStruct((d, v), jnp.float32),
          jax.ShapeDtypeStruct((b, l), jnp.int32))

  def temp(loss, chunk):
    fn = jax.value_and_grad(lambda h, w, t: loss(h, w, t, chunk), (0, 1))
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes

  per_token = lambda h, w, t, c: jnp.sum(losses.cross_entropy(h, w, t, chunk=c))  # noqa: E731
  summed = lambda h, w, t, c: losses.nll_sum(h, w, t, chunk=c)  # noqa: E731
  assert temp(summed, 0) >= 2 * logits_bytes
  for loss in (per_token, summed):
    assert temp(loss, chunk) < 3 * chunk_bytes, temp(loss, chunk)


@pytest.mark.parametrize("path", ["configs/llama_tiny.py", "configs/gpt2_tiny.py"])
def test_return_hidden_gives_the_logits_parts(path):
  """(h_BxLxD, unembed_DxV) in the compute dtype: the untied head, or embed.T when tied; their product
  is the model's logits. Without an LM head there is nothing to return."""
  m = loop.resolve_model_config(small(path, "bf16"))
  model = Transformer(m)
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 16), 0, m.vocab_size)
  params = jax.jit(model.init)(jax.random.PRNGKey(0), tokens)
  logits, (h, unembed) = jax.jit(lambda p, x: (model.apply(p, x), model.apply(p, x, return_hidden=True)))(
      params, tokens)
  assert h.shape == (2, 16, m.d_model) and unembed.shape == (m.d_model, m.vocab_size)
  assert h.dtype == unembed.dtype == jnp.bfloat16
  table = params["params"]["embed" if m.tie_embeddings else "head"].unbox()
  np.testing.assert_array_equal(unembed, (table.T if m.tie_embeddings else table).astype(jnp.bfloat16))
  np.testing.assert_allclose(losses.logits(h, unembed), logits, rtol=1e-2, atol=1e-2)
  with pytest.raises(ValueError, match="lm_head"):
    jax.eval_shape(functools.partial(Transformer(dataclasses.replace(m, lm_head=False)).init, return_hidden=True),
                   jax.random.PRNGKey(0), tokens)


def small(path: str, precision_name: str):
  """A shipped config's architecture at a test size (d_model 32, 2 layers, 4 experts of 32)."""
  cfg = load_config_file(REPO / path)
  cfg.train.precision = precision_name
  m = cfg.model
  m.d_model, m.num_layers, m.num_heads, m.num_kv_heads, m.d_ff = 32, 2, 4, min(m.num_kv_heads, 2), 64
  m.moe.num_experts, m.moe.d_ff = min(m.moe.num_experts, 4), 32
  return cfg


def model_and_batch(path: str, precision_name: str, batch: int = 4, seq: int = 33):
  cfg = small(path, precision_name)
  cfg.optim.warmup_steps, cfg.optim.schedule = 0, "constant"   # the first step moves the params
  cfg.data.batch_size, cfg.data.seq_len = batch, seq
  model = Transformer(loop.resolve_model_config(cfg))
  k = jax.random.split(jax.random.PRNGKey(1), 2)
  tokens = jax.random.randint(k[0], (batch, seq + 1), 0, model.cfg.vocab_size)
  data = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
          "loss_mask": (jax.random.uniform(k[1], (batch, seq)) > 0.2).astype(jnp.int32)}
  return cfg, model, data


def float32_state_and_batch(path: str):
  """(cfg, model, data, tx, schedule, state) of `path`'s model in float32, a batch of 4 x 16 tokens with a loss
  mask, 2 micro-batches (optim.grad_accum): a train step's inputs (test_logit_losses.py too)."""
  cfg, model, data = model_and_batch(path, "float32", batch=4, seq=16)
  cfg.optim.grad_accum = 2
  tx, schedule = optim.make_optimizer(cfg.optim, 10)
  init = state_lib.init_fn(model, tx, precision.get_policy("float32").initial_loss_scale(), 16)
  state = jax.jit(lambda r: state_lib.unbox_plain(init(r)))(jax.random.PRNGKey(0))
  return cfg, model, data, tx, schedule, state


def test_loss_chunk_and_cast_once_keep_the_loss_and_gradients():
  """bf16 policy, a loss mask, tied embeddings (the unembedding is embed.T) with biases and learned
  positions (gpt2). The once-per-step cast gives the very same loss and gradients (float32); the
  chunked loss the same to bf16 noise."""
  _, model, data = model_and_batch("configs/gpt2_tiny.py", "bf16")
  params = state_lib.unbox_plain(jax.jit(model.init)(jax.random.PRNGKey(0), data["inputs"])["params"])

  def value_and_grads(p, chunk: int, cast: bool):
    def f(p):
      p = precision.cast_for_compute(p, model.cfg.dtype) if cast else p
      return step_lib.loss_sum_fn(model, p, data, None, train=True, loss_chunk=chunk)[0]
    return jax.value_and_grad(f)(p)

  (v0, g0), (v_cast, g_cast), (v_chunk, g_chunk) = jax.jit(lambda p: [
      value_and_grads(p, chunk, cast) for chunk, cast in ((0, False), (0, True), (8, True))])(params)
  np.testing.assert_array_equal(v_cast, v0)
  jax.tree.map(np.testing.assert_array_equal, g_cast, g0)
  assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(g_cast))
  assert abs(float(v_chunk - v0)) < 1e-4 * abs(float(v0))
  assert tree_rel_err(g_chunk, g0) < TOL["bfloat16"]


def test_train_and_eval_steps_with_loss_chunk_moe_and_grad_accum():
  """The whole step in float32 for the MoE model (aux losses, untied head), 2 micro-batches, a loss
  mask: loss_chunk gives the full-logits step's loss, aux loss, gradient norm and updated parameters;
  the eval sums agree (the token accuracy exactly)."""
  cfg, model, data, tx, schedule, state = float32_state_and_batch("configs/mixtral_tiny.py")

  def both(state, data):
    return [(*step_lib.make_train_step(model, tx, schedule, cfg.optim, loss_chunk=chunk)(state, data),
             step_lib.eval_step(state.params, data, model=model, loss_chunk=chunk)) for chunk in (0, 12)]

  (new0, m0, e0), (new1, m1, e1) = jax.jit(both)(state, data)
  assert float(m0["aux_loss"]) > 0
  for key in ("loss", "nll", "aux_loss", "grad_norm"):
    np.testing.assert_allclose(m1[key], m0[key], rtol=1e-5)
  assert tree_rel_err(jax.tree.map(jnp.subtract, new1.params, state.params),
                      jax.tree.map(jnp.subtract, new0.params, state.params)) < 1e-4
  assert float(e1["count"]) == float(e0["count"]) == float(jnp.sum(data["loss_mask"]))
  assert float(e1["correct"]) == float(e0["correct"])
  np.testing.assert_allclose(e1["nll_sum"], e0["nll_sum"], rtol=1e-5)


@pytest.mark.parametrize("path", ["configs/llama_tiny.py", "configs/mixtral_tiny.py", "configs/gpt2_tiny.py",
                                  "configs/bert_postln.py", "configs/bloom_alibi.py"])
def test_cast_for_compute_takes_every_matmul_weight_and_nothing_read_in_float32(path):
  """A renamed projection would silently fall back to a cast per use: every parameter left in float32
  must be one the model reads in float32 or gathers."""
  cfg = load_config_file(REPO / path)
  cfg.train.precision = "bf16"
  model = Transformer(loop.resolve_model_config(cfg))
  params = jax.eval_shape(lambda: state_lib.unbox_plain(
      model.init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"]))
  cast = jax.eval_shape(lambda p: precision.cast_for_compute(p, "bfloat16"), params)
  kept = set()
  for path_, leaf in jax.tree_util.tree_flatten_with_path(cast)[0]:
    if leaf.dtype == jnp.float32:
      kept.add(path_[-1].key)
    else:
      assert leaf.dtype == jnp.bfloat16 and path_[-1].key in precision.COMPUTE_CAST_NAMES
  assert kept <= FLOAT32_NAMES, kept - FLOAT32_NAMES


def test_loss_chunk_is_validated():
  c = default_config()
  c.train.loss_chunk = -1
  with pytest.raises(ConfigError, match=r"^train\.loss_chunk: must be >= 0"):
    validate(c, check_paths=False)


def test_bench_compile_memory_reports_the_saving(tmp_path):
  """`python -m tformer_jax.bench compile --memory` on a small config: one row per case, and the
  chunked loss lowers the train step's temp memory."""
  out = tmp_path / "mem.json"
  compile_bench.main([f"--config={REPO / 'configs' / 'gpt2_tiny.py'}", "--memory", "--loss_chunks=0,256",
                      "--cast_params=on", "--config.model.vocab_size=4096", "--config.model.num_layers=1",
                      "--config.data.batch_size=4", "--config.data.seq_len=128", f"--json={out}"])
  res = json.loads(out.read_text())
  full, chunked = res["results"]
  assert (full["loss_chunk"], chunked["loss_chunk"]) == (0, 256)
  assert full["alias"] == full["argument"] - 2 * 4 * 128 * 4   # the state is donated (not the batch)
  assert chunked["temp"] < full["temp"] - res["logits_f32_bytes"], (chunked["temp"], full["temp"])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_nll_sum_on_a_given_matmul(dtype):
  """nll_sum's `matmul=` (a backend's 2-D kernel; here XLA's dot behind the same signature) runs the chunks'
  three products (logits, dh, dw: the three transposes) and gives the default path's value (1e-5) and
  gradients (TOL) on odd sizes with a mask."""
  b, l, d, v = 3, 37, 16, 101
  h, w, t, mask = _odd_case(dtype, (b, l, d, v), seed=1)
  seen = set()

  def matmul(a, b_, ta, tb):
    assert a.ndim == b_.ndim == 2 and a.dtype == b_.dtype == jnp.dtype(dtype)
    seen.add((ta, tb))
    dims = (((0,) if ta else (1,), (1,) if tb else (0,)), ((), ()))
    return jax.lax.dot_general(a, b_, dims, preferred_element_type=jnp.float32)

  f = lambda mm: jax.jit(jax.value_and_grad(  # noqa: E731
      lambda h, w, m: 0.3 * losses.nll_sum(h, w, t, m, chunk=7, matmul=mm), (0, 1, 2)))
  (val, grads), (want, want_grads) = f(matmul)(h, w, mask), f(None)(h, w, mask)
  assert seen == {(False, False), (False, True), (True, False)}
  assert rel_err(val, want) < 1e-5
  for got, ref in zip(grads, want_grads):
    assert got.dtype == ref.dtype and rel_err(got, ref) < TOL[dtype]
