"""Linear attention (Katharopoulos et al., 2020): softmax(QK^T) replaced by phi(Q) phi(K)^T.

phi(x) = elu(x) + 1 > 0, so out_i = phi(q_i) sum_j phi(k_j)^T v_j / (phi(q_i) sum_j phi(k_j)), with j over
all keys (bidirectional) or j <= i (causal). The bidirectional form costs O(L D^2); the causal form is
chunked: exact quadratic attention inside each chunk plus a running (D x Dv) state and a (D,) normaliser
carried across chunks by `lax.scan`. Layout: q (B, L, H, D), k (B, S, K, D), v (B, S, K, Dv), K | H (GQA
without repeating K/V). Everything is computed in float32 and cast back to v's dtype.
`linear_attention_quadratic` also takes any visibility mask (padding, packed documents, decoding into
a KV cache): the model's `attention='linear'` runs it where the O(L) forms do not apply.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jnp.ndarray


def feature_map(x: Array) -> Array:
  """phi(x) = elu(x) + 1, in float32."""
  return jax.nn.elu(x.astype(jnp.float32)) + 1.0


def _grouped(q_BxLxHxD: Array, k_BxSxKxD: Array, v_BxSxKxE: Array) -> tuple[Array, Array, Array]:
  b, l, h, d = q_BxLxHxD.shape
  kh = k_BxSxKxD.shape[2]
  if h % kh or k_BxSxKxD.shape[:3] != v_BxSxKxE.shape[:3] or k_BxSxKxD.shape[-1] != d:
    raise ValueError(f"bad shapes q {q_BxLxHxD.shape}, k {k_BxSxKxD.shape}, v {v_BxSxKxE.shape}")
  phq_BxLxKxGxD = feature_map(q_BxLxHxD).reshape(b, l, kh, h // kh, d)
  return phq_BxLxKxGxD, feature_map(k_BxSxKxD), v_BxSxKxE.astype(jnp.float32)


def linear_attention_quadratic(q_BxLxHxD: Array, k_BxSxKxD: Array, v_BxSxKxE: Array, *,
                               causal: bool, mask: Array | None = None, return_weights: bool = False
                               ) -> Array | tuple[Array, Array]:
  """Reference O(L S) form: A = phi(Q) phi(K)^T (lower-triangular if causal), out = A V / A 1.

  mask: bool (B|1, 1, L, S), True = visible (an `ops.masks.Visibility.mask`: padding, segments, a
  query decoding at a cache slot): A is zero elsewhere. A query that sees no key gets 0.
  return_weights: also the normalised A as (B, H, L, S) float32 (rows sum to 1, as softmax weights)."""
  b, l, h, _ = q_BxLxHxD.shape
  s = k_BxSxKxD.shape[1]
  phq, phk, v = _grouped(q_BxLxHxD, k_BxSxKxD, v_BxSxKxE)
  a_BxKxGxLxS = jnp.einsum("blkgd,bskd->bkgls", phq, phk)
  if causal:
    if l != s:
      raise ValueError(f"causal linear attention needs L == S, got {l} and {s}")
    a_BxKxGxLxS = jnp.where(jnp.tril(jnp.ones((l, s), bool)), a_BxKxGxLxS, 0.0)
  if mask is not None:
    if mask.ndim != 4 or mask.shape[1] != 1:
      raise ValueError(f"mask must be (B|1, 1, L, S), got {mask.shape}")
    a_BxKxGxLxS = jnp.where(mask[:, :, None], a_BxKxGxLxS, 0.0)
  num_BxLxKxGxE = jnp.einsum("bkgls,bske->blkge", a_BxKxGxLxS, v)
  den_BxKxGxL = jnp.sum(a_BxKxGxLxS, axis=-1)
  den_BxKxGxL = jnp.where(den_BxKxGxL > 0, den_BxKxGxL, 1.0)
  out = num_BxLxKxGxE / jnp.transpose(den_BxKxGxL, (0, 3, 1, 2))[..., None]
  out = out.reshape(b, l, h, -1).astype(v_BxSxKxE.dtype)
  if return_weights:
    return out, (a_BxKxGxLxS / den_BxKxGxL[..., None]).reshape(b, h, l, s)
  return out


def linear_attention(q_BxLxHxD: Array, k_BxSxKxD: Array, v_BxSxKxE: Array, *, causal: bool,
                     chunk_size: int = 64) -> Array:
  """(B, L, H, Dv) linear attention in O(L D Dv) (causal: plus O(L C D) within chunks of size C)."""
  b, l, h, d = q_BxLxHxD.shape
  s, kh = k_BxSxKxD.shape[1], k_BxSxKxD.shape[2]
  e = v_BxSxKxE.shape[-1]
  g = h // max(kh, 1)
  phq, phk, v = _grouped(q_BxLxHxD, k_BxSxKxD, v_BxSxKxE)
  if not causal:
    kv_BxKxDxE = jnp.einsum("bskd,bske->bkde", phk, v)
    z_BxKxD = jnp.sum(phk, axis=1)
    num = jnp.einsum("blkgd,bkde->blkge", phq, kv_BxKxDxE)
    den = jnp.einsum("blkgd,bkd->blkg", phq, z_BxKxD)
    return (num / den[..., None]).reshape(b, l, h, e).astype(v_BxSxKxE.dtype)

  if l != s:
    raise ValueError(f"causal linear attention needs L == S, got {l} and {s}")
  c = max(1, min(chunk_size, l))
  n = -(-l // c)
  pad = n * c - l  # padded keys (phi = 0, v = 0) sit after every real query and add nothing
  if pad:  # padded queries get phi = 1 so their (discarded) rows have a positive normaliser: no NaN grads
    phq = jnp.pad(phq, ((0, 0), (0, pad), (0, 0), (0, 0), (0, 0)), constant_values=1.0)
    phk = jnp.pad(phk, ((0, 0), (0, pad), (0, 0), (0, 0)))
    v = jnp.pad(v, ((0, 0), (0, pad), (0, 0), (0, 0)))
  # chunk-major for the scan: (N, B, C, ...)
  phq_NxBxCxKxGxD = jnp.moveaxis(phq.reshape(b, n, c, kh, g, d), 1, 0)
  phk_NxBxCxKxD = jnp.moveaxis(phk.reshape(b, n, c, kh, d), 1, 0)
  v_NxBxCxKxE = jnp.moveaxis(v.reshape(b, n, c, kh, e), 1, 0)
  tril_CxC = jnp.tril(jnp.ones((c, c), bool))

  def chunk(carry, xs):
    state_BxKxDxE, z_BxKxD = carry
    q_c, k_c, v_c = xs
    a_BxKxGxCxC = jnp.where(tril_CxC, jnp.einsum("bqkgd,bckd->bkgqc", q_c, k_c), 0.0)
    num = jnp.einsum("bkgqc,bcke->bqkge", a_BxKxGxCxC, v_c)
    num = num + jnp.einsum("bqkgd,bkde->bqkge", q_c, state_BxKxDxE)
    den = jnp.transpose(jnp.sum(a_BxKxGxCxC, axis=-1), (0, 3, 1, 2))
    den = den + jnp.einsum("bqkgd,bkd->bqkg", q_c, z_BxKxD)
    state_BxKxDxE = state_BxKxDxE + jnp.einsum("bckd,bcke->bkde", k_c, v_c)
    z_BxKxD = z_BxKxD + jnp.sum(k_c, axis=1)
    return (state_BxKxDxE, z_BxKxD), num / den[..., None]

  init = (jnp.zeros((b, kh, d, e), jnp.float32), jnp.zeros((b, kh, d), jnp.float32))
  _, out_NxBxCxKxGxE = jax.lax.scan(chunk, init, (phq_NxBxCxKxGxD, phk_NxBxCxKxD, v_NxBxCxKxE))
  out = jnp.moveaxis(out_NxBxCxKxGxE, 0, 1).reshape(b, n * c, h, e)[:, :l]
  return out.astype(v_BxSxKxE.dtype)
