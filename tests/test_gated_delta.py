"""Gated delta rule (ops/gated_delta.py): the chunked and decode forms equal the per-token recurrence, packed
segments equal separate runs, gradients agree, and transformers' torch references (qwen3_next, kimi_linear) agree."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tformer_jax.ops.gated_delta import gated_delta_rule_chunked, gated_delta_rule_reference, gated_delta_rule_step

TOL = dict(atol=1e-5, rtol=1e-5)
B, L, HK, H, DK, DV = 2, 37, 1, 2, 6, 5  # Hk | H (grouped heads), Dk != Dv, L not a multiple of the chunk (16)
SEGMENTS = np.array([[0] * 5 + [1] * 11 + [2] + [3] * 20,  # a reset at a chunk start (16), a 1-token segment,
                     [7] * 20 + [8] * 17])  # segments that span chunk boundaries
GATES = ["scalar", "channel"]


def _inputs(gate, l=L, hk=HK, h=H, dk=DK, dv=DV, seed=0):
  """q, k, v, g (log-gate <= 0, (B, L, H) or (B, L, H, Dk)), beta in (0, 1), initial state."""
  ks = jax.random.split(jax.random.PRNGKey(seed), 6)
  g_shape = (B, l, h) if gate == "scalar" else (B, l, h, dk)
  return (jax.random.normal(ks[0], (B, l, hk, dk)), jax.random.normal(ks[1], (B, l, hk, dk)),
          jax.random.normal(ks[2], (B, l, h, dv)), -jax.nn.softplus(jax.random.normal(ks[3], g_shape)),
          jax.nn.sigmoid(jax.random.normal(ks[4], (B, l, h))), jax.random.normal(ks[5], (B, h, dk, dv)))


def _close(got, want, **tol):
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), **(tol or TOL))


@pytest.mark.parametrize("gate", GATES)
def test_chunked_and_step_equal_reference(gate):
  q, k, v, g, beta, s0 = _inputs(gate)
  want = jax.jit(functools.partial(gated_delta_rule_reference, initial_state=s0))(q, k, v, g, beta)
  _close(jax.jit(functools.partial(gated_delta_rule_chunked, initial_state=s0, chunk_size=16))(q, k, v, g, beta), want)
  step, s, outs = jax.jit(gated_delta_rule_step), s0, []
  for t in range(L):
    o, s = step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], s)
    outs.append(o)
  _close((jnp.stack(outs, axis=1), s), want)
  assert want[0].shape == (B, L, H, DV) and want[1].shape == (B, H, DK, DV) and want[1].dtype == jnp.float32


def test_reference_is_the_formula():
  """S_t = a_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T, o_t = S_t^T q_t / sqrt(Dk), normalised q, k."""
  q, k, v, g, beta, s0 = (np.asarray(x, np.float64) for x in _inputs("scalar", l=5))
  out, s_fin = gated_delta_rule_reference(*(jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta)),
                                          initial_state=jnp.asarray(s0, jnp.float32))
  unit = lambda x: x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)  # noqa: E731
  q, k = unit(q), unit(k)
  for bb, hh in ((0, 0), (1, 1)):
    s = s0[bb, hh]
    for t in range(5):
      kt, qt = k[bb, t, 0], q[bb, t, 0] / np.sqrt(DK)
      s = np.exp(g[bb, t, hh]) * (np.eye(DK) - beta[bb, t, hh] * np.outer(kt, kt)) @ s
      s = s + beta[bb, t, hh] * np.outer(kt, v[bb, t, hh])
      np.testing.assert_allclose(np.asarray(out)[bb, t, hh], s.T @ qt, **TOL)
    np.testing.assert_allclose(np.asarray(s_fin)[bb, hh], s, **TOL)


@pytest.mark.parametrize("gate", GATES)
def test_segments_equal_separate_runs(gate):
  """Each packed segment starts from a zero state (the first from initial_state) and sees nothing of the others."""
  q, k, v, g, beta, s0 = _inputs(gate)
  seg = jnp.asarray(SEGMENTS)
  for init in (None, s0):
    ref = gated_delta_rule_reference(q, k, v, g, beta, initial_state=init, segment_ids=seg)
    chunked = gated_delta_rule_chunked(q, k, v, g, beta, initial_state=init, segment_ids=seg, chunk_size=16)
    _close(chunked, ref)
    for bb in range(B):
      starts = [0, *np.flatnonzero(np.diff(SEGMENTS[bb])) + 1, L]
      for i, (lo, hi) in enumerate(zip(starts[:-1], starts[1:])):
        part = tuple(x[bb:bb + 1, lo:hi] for x in (q, k, v, g, beta))
        first = None if init is None or i else init[bb:bb + 1]
        o, s = gated_delta_rule_reference(*part, initial_state=first)
        np.testing.assert_allclose(np.asarray(chunked[0][bb:bb + 1, lo:hi]), np.asarray(o), **TOL)
      np.testing.assert_allclose(np.asarray(chunked[1][bb:bb + 1]), np.asarray(s), **TOL)


@pytest.mark.parametrize("gate,segments", [("scalar", False), ("channel", True)])
def test_chunked_gradients_equal_reference(gate, segments):
  q, k, v, g, beta, s0 = _inputs(gate)
  seg = jnp.asarray(SEGMENTS) if segments else None
  wo, ws = _inputs(gate, seed=1)[2], _inputs(gate, seed=1)[5]

  def loss(fn, *args):
    o, s = fn(*args[:5], initial_state=args[5], segment_ids=seg)
    return jnp.sum(o * wo) + jnp.sum(s * ws)

  grad = lambda fn: jax.jit(jax.grad(functools.partial(loss, fn), argnums=tuple(range(6))))  # noqa: E731
  got = grad(functools.partial(gated_delta_rule_chunked, chunk_size=16))(q, k, v, g, beta, s0)
  want = grad(gated_delta_rule_reference)(q, k, v, g, beta, s0)
  _close(got, want, atol=1e-4, rtol=1e-4)
  assert all(float(jnp.abs(x).max()) > 0 for x in want)


@pytest.mark.parametrize("gate", GATES)
def test_decode_continues_the_chunked_prefill(gate):
  q, k, v, g, beta, s0 = _inputs(gate)
  prefill = 29
  whole = gated_delta_rule_chunked(q, k, v, g, beta, initial_state=s0, chunk_size=16)
  o_pre, s = gated_delta_rule_chunked(*(x[:, :prefill] for x in (q, k, v, g, beta)), initial_state=s0,
                                      chunk_size=16)
  step, outs = jax.jit(gated_delta_rule_step), [o_pre]
  for t in range(prefill, L):
    o, s = step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], s)
    outs.append(o[:, None])
  _close((jnp.concatenate(outs, axis=1), s), whole)


def test_low_precision_inputs_compute_in_float32():
  q, k, v, g, beta, s0 = _inputs("scalar")
  args16 = tuple(x.astype(jnp.bfloat16) for x in (q, k, v, g, beta))
  o16, s16 = gated_delta_rule_chunked(*args16, initial_state=s0, chunk_size=16)
  o32, s32 = gated_delta_rule_chunked(*(x.astype(jnp.float32) for x in args16), initial_state=s0, chunk_size=16)
  assert o16.dtype == jnp.bfloat16 and s16.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(s16), np.asarray(s32), **TOL)
  np.testing.assert_allclose(np.asarray(o16, np.float32), np.asarray(o32.astype(jnp.bfloat16), np.float32), **TOL)


def test_bad_shapes_raise():
  q, k, v, g, beta, s0 = _inputs("scalar")
  with pytest.raises(ValueError, match="bad shapes"):
    gated_delta_rule_chunked(q, k, v, g[..., :1], beta)
  with pytest.raises(ValueError, match="bad shapes"):
    gated_delta_rule_reference(q, k, v, g, beta, initial_state=s0[..., :2])
  with pytest.raises(ValueError, match="segment_ids"):
    gated_delta_rule_chunked(q, k, v, g, beta, segment_ids=jnp.zeros((B, L - 1), jnp.int32))


@pytest.mark.parametrize("gate,grad", [("scalar", False), ("scalar", True), ("channel", False)])
def test_chunked_memory_is_linear_in_length(gate, grad):
  """XLA's temporaries for the jitted chunked form (grad: of the sum of its outputs w.r.t. q, k, v, g, beta), B=1,
  H=2, Dk=Dv=32, chunk 64, on XLA:CPU, L=512 -> L=2048 (4x the length; quadratic would be 16x): scalar gate
  1.33 -> 5.82 MB (4.4x), its gradient 3.90 -> 15.6 MB (4.0x), per-channel gate 25.8 -> 104 MB (4.0x: the
  (C, C, Dk) pairwise decays)."""
  def temp_bytes(l):
    shapes = [(1, l, 2, 32)] * 3 + [(1, l, 2) if gate == "scalar" else (1, l, 2, 32), (1, l, 2)]
    fn = functools.partial(gated_delta_rule_chunked, chunk_size=64)
    if grad:
      fn = jax.grad(lambda *a, f=fn: sum(jnp.sum(x) for x in f(*a)), argnums=tuple(range(5)))
    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes

  short, long = temp_bytes(512), temp_bytes(2048)
  assert 0 < short and long / short < 6, (short, long)


@pytest.mark.reference
@pytest.mark.parametrize("gate", GATES)
def test_matches_transformers_torch_references(gate):
  """qwen3_next's torch_{chunk,recurrent}_gated_delta_rule (scalar gate; 2 q/k heads for 4 value heads: grouped
  by repeat_interleave, not tiled) and kimi_linear's {chunk,recurrent}_kimi_delta_attention (per-channel gate):
  L=70 with chunk 64 ends mid-chunk."""
  torch = pytest.importorskip("torch")
  if gate == "scalar":
    mod = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    chunk, recurrent, hk, h = mod.torch_chunk_gated_delta_rule, mod.torch_recurrent_gated_delta_rule, 2, 4
  else:
    mod = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    chunk, recurrent, hk, h = mod.chunk_kimi_delta_attention, mod.recurrent_kimi_delta_attention, H, H
  q, k, v, g, beta, s0 = (np.array(x) for x in _inputs(gate, l=70, hk=hk, h=h, dk=8, dv=6))
  ours = gated_delta_rule_chunked(q, k, v, g, beta, initial_state=s0, chunk_size=64)
  ours_ref = gated_delta_rule_reference(q, k, v, g, beta, initial_state=s0)
  t = [torch.from_numpy(x) for x in (q, k, v, g, beta)]
  kw = dict(initial_state=torch.from_numpy(s0), output_final_state=True, use_qk_l2norm_in_kernel=True)
  for theirs in (chunk(*t, chunk_size=64, **kw), recurrent(*t, **kw)):
    theirs = tuple(x.numpy() for x in theirs)
    _close(ours, theirs)
    _close(ours_ref, theirs)
