"""Gated delta rule (Gated DeltaNet, Yang et al. 2024) and its per-channel gate (Kimi Delta Attention).

Per head, with state S (Dk, Dv), a_t = exp(g_t) (g_t <= 0, the log-gate) and beta_t in (0, 1):
  S_t = a_t S_{t-1} - beta_t k_t (k_t^T a_t S_{t-1} - v_t^T) = a_t S_{t-1} + k_t delta_t^T,  o_t = S_t^T q_t,
  delta_t = beta_t (v_t - (a_t S_{t-1})^T k_t).
This is the paper's S_t = a_t S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T in the transposed (Dk, Dv)
layout of transformers' qwen3_next / kimi_linear torch references, which these forms follow step for step:
q and k are cast to float32, optionally L2-normalised (x * rsqrt(sum x^2 + 1e-6), `use_qk_l2norm`, as
`use_qk_l2norm_in_kernel`), then q alone is scaled by Dk^-0.5. g of shape (B, L, H) is a scalar gate per head
(GDN); g of shape (B, L, H, Dk) is KDA's per-channel gate: diag(exp(g_t)) decays the Dk rows of S.

Layout: q, k (B, L, Hk, Dk); v (B, L, H, Dv); g (B, L, H) or (B, L, H, Dk); beta (B, L, H); the state
(B, H, Dk, Dv), float32. Hk | H: each q/k head serves H / Hk consecutive value heads (transformers'
repeat_interleave). transformers transposes to (B, H, L, D) inside; here the public layout is (B, L, H, D)
throughout. All arithmetic is in float32; outputs come back in q's dtype, states in float32.

segment_ids (B, L) int (packed documents): where the id differs from the previous token's, the state is reset
to zero before that token; the first token continues from `initial_state` (zero when None).

Forms: `gated_delta_rule_reference` (lax.scan over tokens), `gated_delta_rule_chunked` (the WY/UT form: a
triangular solve within each chunk, lax.scan over chunks carrying the state; activations linear in L), and
`gated_delta_rule_step` (one decode token).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.scipy.linalg import solve_triangular

Array = jnp.ndarray
L2NORM_EPS = 1e-6


def l2norm(x: Array, eps: float = L2NORM_EPS) -> Array:
  """x * rsqrt(sum(x^2) + eps) over the last axis (transformers' / fla's l2norm, not F.normalize)."""
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _check_shapes(q: Array, k: Array, v: Array, g: Array, beta: Array, state: Array | None) -> None:
  b, l, hk, dk = q.shape
  h, dv = v.shape[2], v.shape[3]
  ok = (k.shape == q.shape and v.shape[:2] == (b, l) and h % hk == 0 and beta.shape == (b, l, h)
        and g.shape in ((b, l, h), (b, l, h, dk)) and (state is None or state.shape == (b, h, dk, dv)))
  if not ok:
    raise ValueError(f"bad shapes q {q.shape}, k {k.shape}, v {v.shape}, g {g.shape}, beta {beta.shape}, "
                     f"state {None if state is None else state.shape}: want q, k (B, L, Hk, Dk), v (B, L, H, Dv), "
                     "g (B, L, H) or (B, L, H, Dk), beta (B, L, H), state (B, H, Dk, Dv), Hk | H")


def _prepare(q: Array, k: Array, v: Array, g: Array, beta: Array, state: Array | None, use_qk_l2norm: bool
             ) -> tuple[Array, Array, Array, Array, Array, Array]:
  """float32 q (scaled), k, v (B, L, H, D), g (B, L, H, G) with G in {1, Dk}, beta (B, L, H), state (B, H, Dk, Dv)."""
  _check_shapes(q, k, v, g, beta, state)
  b, _, hk, dk = q.shape
  h, dv = v.shape[2], v.shape[3]
  q, k = (jnp.repeat(x.astype(jnp.float32), h // hk, axis=2) for x in (q, k))
  if use_qk_l2norm:
    q, k = l2norm(q), l2norm(k)
  q = q * dk**-0.5
  g = g.astype(jnp.float32)
  g = g[..., None] if g.ndim == 3 else g
  s = jnp.zeros((b, h, dk, dv), jnp.float32) if state is None else state.astype(jnp.float32)
  return q, k, v.astype(jnp.float32), g, beta.astype(jnp.float32), s


def _resets(segment_ids: Array | None, b: int, l: int) -> Array:
  """(B, L) bool: True where a new segment starts after the first token (the state is zeroed there)."""
  if segment_ids is None:
    return jnp.zeros((b, l), bool)
  if segment_ids.shape != (b, l):
    raise ValueError(f"segment_ids must be (B, L) = {(b, l)}, got {segment_ids.shape}")
  return jnp.concatenate([jnp.zeros((b, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)


def _token_update(s_BxHxKxV: Array, q_BxHxK: Array, k_BxHxK: Array, v_BxHxV: Array, g_BxHxG: Array,
                  beta_BxH: Array) -> tuple[Array, Array]:
  """One step of the recurrence on prepared float32 inputs: (o_BxHxV, new state)."""
  s = s_BxHxKxV * jnp.exp(g_BxHxG)[..., None]
  kv_mem_BxHxV = jnp.einsum("bhkv,bhk->bhv", s, k_BxHxK)
  delta_BxHxV = (v_BxHxV - kv_mem_BxHxV) * beta_BxH[..., None]
  s = s + k_BxHxK[..., None] * delta_BxHxV[..., None, :]
  return jnp.einsum("bhkv,bhk->bhv", s, q_BxHxK), s


def gated_delta_rule_reference(q_BxLxHkxK: Array, k_BxLxHkxK: Array, v_BxLxHxV: Array, g: Array, beta_BxLxH: Array,
                               *, initial_state: Array | None = None, segment_ids: Array | None = None,
                               use_qk_l2norm: bool = True) -> tuple[Array, Array]:
  """Naive per-token recurrence (lax.scan over L): (out_BxLxHxV in q's dtype, final_state_BxHxKxV float32)."""
  q, k, v, g, beta, s0 = _prepare(q_BxLxHkxK, k_BxLxHkxK, v_BxLxHxV, g, beta_BxLxH, initial_state, use_qk_l2norm)
  reset_BxL = _resets(segment_ids, q.shape[0], q.shape[1])

  def body(s, xs):
    q_t, k_t, v_t, g_t, beta_t, reset_t = xs
    s = jnp.where(reset_t[:, None, None, None], 0.0, s)
    o_t, s = _token_update(s, q_t, k_t, v_t, g_t, beta_t)
    return s, o_t

  xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta, reset_BxL))
  s, o_LxBxHxV = jax.lax.scan(body, s0, xs)
  return jnp.moveaxis(o_LxBxHxV, 0, 1).astype(q_BxLxHkxK.dtype), s


def gated_delta_rule_step(q_BxHkxK: Array, k_BxHkxK: Array, v_BxHxV: Array, g: Array, beta_BxH: Array,
                          state_BxHxKxV: Array, use_qk_l2norm: bool = True) -> tuple[Array, Array]:
  """One decode token: g (B, H) or (B, H, Dk); (out_BxHxV in q's dtype, new_state_BxHxKxV float32)."""
  q, k, v, g, beta, s = _prepare(q_BxHkxK[:, None], k_BxHkxK[:, None], v_BxHxV[:, None], g[:, None],
                                 beta_BxH[:, None], state_BxHxKxV, use_qk_l2norm)
  o_BxHxV, s = _token_update(s, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0])
  return o_BxHxV.astype(q_BxHkxK.dtype), s


def _pair(x_XxCxK: Array, y_XxCxK: Array, decay_XxCxCxG: Array) -> Array:
  """(..., C, C): sum_d x_id y_jd decay_ijd, decay's last axis 1 (scalar gate) or Dk (per channel)."""
  if decay_XxCxCxG.shape[-1] == 1:
    return jnp.einsum("...id,...jd->...ij", x_XxCxK, y_XxCxK) * decay_XxCxCxG[..., 0]
  return jnp.einsum("...id,...jd,...ijd->...ij", x_XxCxK, y_XxCxK, decay_XxCxCxG)


def _intra_chunk(q: Array, k: Array, v: Array, g: Array, beta: Array, sid: Array) -> tuple[Array, ...]:
  """Everything within the chunks, for all chunks at once; inputs (N, B, H, C, .), sid (N, B, 1, C).

  sid: the segment's index within the chunk, 0 = the segment the carried state belongs to. The products of gates
  the WY form needs are over (j, i] within one segment (`same`) or over [0, i] back to the carried state
  (`carried`); across a reset they are zero, which is what zeroing the state there means.
  Returns attn (N, B, H, C, C) (q_i . k_j decayed, j <= i), u = T (beta v), w = T (beta k exp(G)), the decayed
  queries and keys against the carried state, and the chunk's decay of the state (N, B, H, G)."""
  c = q.shape[-2]
  g_cum = jnp.cumsum(g, axis=-2)  # (N, B, H, C, G): log of the gates' product from the chunk's start
  same_CxC = sid[..., :, None] == sid[..., None, :]
  causal = jnp.tril(jnp.ones((c, c), bool))
  diff = g_cum[..., :, None, :] - g_cum[..., None, :, :]  # (N, B, H, C, C, G), G_i - G_j
  decay = jnp.exp(jnp.where((same_CxC & causal)[..., None], diff, -jnp.inf))
  attn = _pair(q, k, decay)
  k_beta = k * beta[..., None]
  a_strict = jnp.where(jnp.tril(jnp.ones((c, c), bool), -1), _pair(k_beta, k, decay), 0.0)
  t_inv = a_strict + jnp.eye(c, dtype=a_strict.dtype)  # u = (I + A)^-1 beta v: the UT transform
  carried = (sid == 0)[..., None]
  from_start = jnp.where(carried, jnp.exp(g_cum), 0.0)
  u = solve_triangular(t_inv, v * beta[..., None], lower=True, unit_diagonal=True)
  w = solve_triangular(t_inv, k_beta * from_start, lower=True, unit_diagonal=True)
  same_last = (sid == sid[..., -1:])[..., None]
  to_end = jnp.where(same_last, jnp.exp(g_cum[..., -1:, :] - g_cum), 0.0)
  chunk_decay = from_start[..., -1, :]
  return attn, u, w, q * from_start, k * to_end, chunk_decay


def _to_chunks(x_BxLxHxD: Array, n: int, c: int) -> Array:
  """(B, L, H, D) -> (N, B, H, C, D); L = N C."""
  b, _, h, d = x_BxLxHxD.shape
  return jnp.transpose(x_BxLxHxD.reshape(b, n, c, h, d), (1, 0, 3, 2, 4))


def gated_delta_rule_chunked(q_BxLxHkxK: Array, k_BxLxHkxK: Array, v_BxLxHxV: Array, g: Array, beta_BxLxH: Array,
                             *, initial_state: Array | None = None, segment_ids: Array | None = None,
                             use_qk_l2norm: bool = True, chunk_size: int = 64) -> tuple[Array, Array]:
  """Chunked WY/UT form, same contract as `gated_delta_rule_reference`; O(L (C + Dk + Dv)) activations per head
  (per-channel gate: O(L C Dk), its pairwise decays). L is padded to a multiple of chunk_size with identity steps
  (g = 0, beta = 0, k = 0), as transformers pads, so the final state is that of the last real token."""
  q, k, v, g, beta, s0 = _prepare(q_BxLxHkxK, k_BxLxHkxK, v_BxLxHxV, g, beta_BxLxH, initial_state, use_qk_l2norm)
  b, l, h, _ = q.shape
  c = max(1, min(chunk_size, l))
  pad = -l % c
  n = (l + pad) // c
  reset_BxL = _resets(segment_ids, b, l)
  if pad:
    q, k, v, g = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v, g))
    beta, reset_BxL = jnp.pad(beta, ((0, 0), (0, pad), (0, 0))), jnp.pad(reset_BxL, ((0, 0), (0, pad)))
  sid_NxBx1xC = jnp.cumsum(reset_BxL.reshape(b, n, c), axis=-1).transpose(1, 0, 2)[:, :, None]
  beta_NxBxHxC = jnp.transpose(beta.reshape(b, n, c, h), (1, 0, 3, 2))
  xs = _intra_chunk(*(_to_chunks(x, n, c) for x in (q, k, v, g)), beta_NxBxHxC, sid_NxBx1xC)

  def body(s_BxHxKxV, xs):
    attn_BxHxCxC, u_BxHxCxV, w_BxHxCxK, qd_BxHxCxK, kd_BxHxCxK, decay_BxHxG = xs
    v_new = u_BxHxCxV - jnp.einsum("bhck,bhkv->bhcv", w_BxHxCxK, s_BxHxKxV)
    o = jnp.einsum("bhck,bhkv->bhcv", qd_BxHxCxK, s_BxHxKxV) + jnp.einsum("bhij,bhjv->bhiv", attn_BxHxCxC, v_new)
    s = s_BxHxKxV * decay_BxHxG[..., None] + jnp.einsum("bhck,bhcv->bhkv", kd_BxHxCxK, v_new)
    return s, o

  s, o_NxBxHxCxV = jax.lax.scan(body, s0, xs)
  o_BxLxHxV = jnp.transpose(o_NxBxHxCxV, (1, 0, 3, 2, 4)).reshape(b, n * c, h, -1)[:, :l]
  return o_BxLxHxV.astype(q_BxLxHkxK.dtype), s
