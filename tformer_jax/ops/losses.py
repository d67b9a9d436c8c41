"""Cross-entropy over the vocabulary from the final hidden states and the unembedding matrix.

  nll_BxL = cross_entropy(h_BxLxD, w_DxV, targets_BxL, chunk=0)       # the full logits (reference)
  nll_BxL = cross_entropy(h_BxLxD, w_DxV, targets_BxL, chunk=8192)    # never more than ~8192 tokens' logits
  total = nll_sum(h_BxLxD, w_DxV, targets_BxL, weights_BxL, chunk=8192)   # sum(weights * nll): training
  nll_BxL, correct_BxL = nll_and_correct(h_BxLxD, w_DxV, targets_BxL, chunk=8192)   # eval (no gradient)

Both compute what the model's logits path computes: logits = h @ w in the inputs' dtype (bfloat16
under the bf16 policy), then float32; nll = logsumexp(logits) - logits[target], float32.

The reference holds the (B, L, V) float32 logits (at 16 x 2048 x 32000 that is 4.2 GB, and autodiff
keeps several such arrays alive). The chunked form walks the sequence in chunks of
`max(1, chunk // B)` positions of every row (so a batch sharded over devices stays sharded), and has
a hand-written VJP: the forward saves only the per-token logsumexp (float32), the backward recomputes
one chunk's logits at a time, forms (softmax - onehot) * g, and accumulates the matrix gradient in
float32 (one rounding to w's dtype at the end, as a single matmul over all tokens would do). Cost: one
extra (tokens x D x V) matmul in the backward (4 instead of 3).

`nll_sum` (what a training loss needs: one scalar, sum(weights * nll)) avoids that extra matmul: the
upstream gradient of a scalar is one number, so its forward computes the gradients with respect to h
and w while each chunk's logits exist (the "fused" cross-entropy), keeps them (the size of h and of
w, float32 for w) instead of h, and its backward only scales them. 3 matmuls, as with full logits.
Its three products (logits, dh, dw) can run on a caller's 2-D matmul, `matmul=` (a CPU kernel; the
default is XLA's dot): same values, the logits rounded to the inputs' dtype as the model's head rounds them.

Two options, in every path (full logits, chunked, fused):
  softcap > 0   Gemma 2/3's final-logit soft-cap: logits = softcap * tanh(logits / softcap), before the
                log-softmax; the gradients go through the tanh (d/dx = 1 - (capped / softcap)^2). 0 = off.
  z_loss > 0    PaLM's z-loss, z_loss * logsumexp(logits)^2 per token, added to the loss (`loss_sums`);
                the chunked forms take it from the per-token logsumexp they already keep: no full logits.

  total, nll, lse_sq = loss_sums(h, w, t, weights, chunk=8192, softcap=30.0, z_loss=1e-4)
  # total = nll + 1e-4 * lse_sq (differentiable); nll = sum(weights * nll), lse_sq = sum(weights * lse^2)
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array
# matmul(a, b, transpose_a, transpose_b) -> op(a) @ op(b) in float32, for 2-D a and b of one dtype
Matmul = Callable[[Array, Array, bool, bool], Array]


def logits(h_BxLxD: Array, w_DxV: Array, softcap: float = 0.0) -> Array:
  """(B, L, V) float32 logits, the matmul in the inputs' dtype (the model's head); softcap > 0:
  softcap * tanh(logits / softcap) (in float32)."""
  return cap(jnp.einsum("bld,dv->blv", h_BxLxD, w_DxV).astype(jnp.float32), softcap)


def cap(logits_f32: Array, softcap: float) -> Array:
  """softcap * tanh(logits / softcap) (Gemma 2's final-logit soft-cap); unchanged for softcap 0."""
  if not softcap:
    return logits_f32
  return softcap * jnp.tanh(logits_f32 / softcap)


def _cap_grad(dcapped: Array, capped: Array, softcap: float) -> Array:
  """The gradient through `cap`: d(capped)/d(raw) = 1 - tanh^2 = 1 - (capped / softcap)^2."""
  if not softcap:
    return dcapped
  return dcapped * (1.0 - jnp.square(capped / softcap))


def cross_entropy_logits(logits_BxLxV: Array, targets_BxL: Array) -> Array:
  """Per-token negative log-likelihood (B, L) in float32, from full logits."""
  logp_BxLxV = jax.nn.log_softmax(logits_BxLxV.astype(jnp.float32), axis=-1)
  return -jnp.take_along_axis(logp_BxLxV, targets_BxL[..., None], axis=-1)[..., 0]


def nll_and_lse_logits(logits_BxLxV: Array, targets_BxL: Array) -> tuple[Array, Array]:
  """(per-token NLL, per-token logsumexp), each (B, L) float32, from full logits: one log-softmax
  (the NLL is `cross_entropy_logits`'s, bit for bit); lse = logit[target] - logp[target], whose
  gradient is the softmax."""
  logits_BxLxV = logits_BxLxV.astype(jnp.float32)
  logp_BxLxV = jax.nn.log_softmax(logits_BxLxV, axis=-1)
  logp_t = jnp.take_along_axis(logp_BxLxV, targets_BxL[..., None], axis=-1)[..., 0]
  logit_t = jnp.take_along_axis(logits_BxLxV, targets_BxL[..., None], axis=-1)[..., 0]
  return -logp_t, logit_t - logp_t


def cross_entropy(h_BxLxD: Array, w_DxV: Array, targets_BxL: Array, *, chunk: int = 0,
                  softcap: float = 0.0) -> Array:
  """Per-token NLL (B, L) float32 of the logits h @ w (soft-capped when softcap > 0). chunk > 0: about
  `chunk` tokens' logits at a time, forward and backward (see the module docstring); 0: the full logits
  (reference)."""
  _check(h_BxLxD, w_DxV, targets_BxL, chunk, softcap)
  if chunk == 0:
    return cross_entropy_logits(logits(h_BxLxD, w_DxV, softcap), targets_BxL)
  return _chunked_nll(h_BxLxD, w_DxV, targets_BxL, _positions_per_chunk(h_BxLxD.shape, chunk), float(softcap))


def nll_and_correct(h_BxLxD: Array, w_DxV: Array, targets_BxL: Array, *, chunk: int = 0,
                    softcap: float = 0.0) -> tuple[Array, Array]:
  """(per-token NLL (B, L) float32, argmax(logits) == target (B, L) bool), for evaluation: no
  gradient flows. chunk, softcap as in `cross_entropy`."""
  _check(h_BxLxD, w_DxV, targets_BxL, chunk, softcap)
  h_BxLxD, w_DxV = jax.lax.stop_gradient((h_BxLxD, w_DxV))
  if chunk == 0:
    logits_BxLxV = logits(h_BxLxD, w_DxV, softcap)
    return cross_entropy_logits(logits_BxLxV, targets_BxL), jnp.argmax(logits_BxLxV, -1) == targets_BxL
  lse_BxL, tgt_BxL, correct_BxL = _forward(h_BxLxD, w_DxV, targets_BxL, _positions_per_chunk(h_BxLxD.shape, chunk),
                                           with_correct=True, softcap=float(softcap))
  return lse_BxL - tgt_BxL, correct_BxL


def nll_sum(h_BxLxD: Array, w_DxV: Array, targets_BxL: Array, weights_BxL: Array | None = None, *,
            chunk: int = 0, matmul: Matmul | None = None, softcap: float = 0.0) -> Array:
  """sum(weights * nll) as a float32 scalar (weights default 1; e.g. the loss mask). chunk > 0: about
  `chunk` tokens' logits at a time, the gradients formed in the forward (module docstring); 0: the full
  logits. Gradients flow to h, w and weights. matmul (chunk > 0): runs the chunks' three products
  (module docstring); None: XLA's dot. softcap: as in `cross_entropy`."""
  return loss_sums(h_BxLxD, w_DxV, targets_BxL, weights_BxL, chunk=chunk, matmul=matmul, softcap=softcap)[0]


def loss_sums(h_BxLxD: Array, w_DxV: Array, targets_BxL: Array, weights_BxL: Array | None = None, *,
              chunk: int = 0, matmul: Matmul | None = None, softcap: float = 0.0, z_loss: float = 0.0
              ) -> tuple[Array, Array, Array]:
  """(total, nll, lse_sq), float32 scalars: nll = sum(weights * nll), lse_sq = sum(weights * lse^2)
  (lse = logsumexp of the (soft-capped) logits), total = nll + z_loss * lse_sq. Gradients flow through
  total only (to h, w and weights); nll and lse_sq are for the logs (stop_gradient). chunk, matmul as
  in `nll_sum`; the fused chunked path keeps no logits and no extra matmul for the z-loss."""
  _check(h_BxLxD, w_DxV, targets_BxL, chunk, softcap)
  if z_loss < 0:
    raise ValueError(f"loss_sums: z_loss must be >= 0 (0 = off), got {z_loss!r}")
  weights_BxL = (jnp.ones(targets_BxL.shape, jnp.float32) if weights_BxL is None
                 else weights_BxL.astype(jnp.float32))
  if chunk == 0:
    nll_BxL, lse_BxL = nll_and_lse_logits(logits(h_BxLxD, w_DxV, softcap), targets_BxL)
    nll = jnp.sum(nll_BxL * weights_BxL)
    lse_sq = jnp.sum(jnp.square(lse_BxL) * weights_BxL)
    total = nll + z_loss * lse_sq if z_loss else nll
    return total, jax.lax.stop_gradient(nll), jax.lax.stop_gradient(lse_sq)
  static = _Static(_positions_per_chunk(h_BxLxD.shape, chunk), jnp.dtype(h_BxLxD.dtype).name,
                   jnp.dtype(w_DxV.dtype).name, matmul, float(softcap), float(z_loss))
  total, nll, lse_sq = _fused_nll_sum(h_BxLxD, w_DxV, targets_BxL, weights_BxL, static)
  return total, jax.lax.stop_gradient(nll), jax.lax.stop_gradient(lse_sq)


class _Static(NamedTuple):
  c: int          # positions per chunk
  h_dtype: str    # the dtypes the gradients must have
  w_dtype: str
  matmul: Matmul | None = None   # the products' 2-D matmul; None: XLA's dot
  softcap: float = 0.0           # the logits' soft-cap (0 = off)
  z_loss: float = 0.0            # the z-loss coefficient (0 = off)


def _product(static: _Static, spec: str, a: Array, b: Array) -> Array:
  """One of the fused loss's products in float32: 'bcd,dv->bcv' (logits), 'bcv,dv->bcd' (dh) or
  'bcd,bcv->dv' (dw), on static.matmul when given (as 2-D products), else XLA's dot."""
  if static.matmul is None:
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)
  lead = a.shape[:-1]
  a2, b2 = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
  if spec == "bcd,dv->bcv":
    return static.matmul(a2, b2, False, False).reshape(*lead, b.shape[-1])
  if spec == "bcv,dv->bcd":
    return static.matmul(a2, b2, False, True).reshape(*lead, b.shape[0])
  return static.matmul(a2, b2, True, False)   # 'bcd,bcv->dv'


def _check(h_BxLxD: Array, w_DxV: Array, targets_BxL: Array, chunk: int, softcap: float = 0.0) -> None:
  if not softcap >= 0:
    raise ValueError(f"cross_entropy: softcap must be >= 0 (0 = off), got {softcap!r}")
  if h_BxLxD.ndim != 3 or w_DxV.ndim != 2 or h_BxLxD.shape[-1] != w_DxV.shape[0] \
      or targets_BxL.shape != h_BxLxD.shape[:2]:
    raise ValueError(f"cross_entropy: expected h (B, L, D), w (D, V), targets (B, L); got {h_BxLxD.shape}, "
                     f"{w_DxV.shape}, {targets_BxL.shape}")
  if int(chunk) != chunk or chunk < 0:
    raise ValueError(f"cross_entropy: chunk must be an integer >= 0 (0 = full logits), got {chunk!r}")


def _positions_per_chunk(shape_BxLxD: tuple[int, ...], chunk: int) -> int:
  b, l, _ = shape_BxLxD
  return max(1, min(l, int(chunk) // b))


def _chunks(x_BxL: Array, c: int) -> tuple[Array, int]:
  """x (B, L, ...) padded with zeros along L to a multiple of c -> (n, B, c, ...), and n."""
  b, l = x_BxL.shape[:2]
  n = -(-l // c)
  x_BxL = jnp.pad(x_BxL, [(0, 0), (0, n * c - l)] + [(0, 0)] * (x_BxL.ndim - 2))
  return jnp.swapaxes(x_BxL.reshape((b, n, c) + x_BxL.shape[2:]), 0, 1), n


def _unchunk(x_NxBxC: Array, l: int) -> Array:
  """(n, B, c, ...) -> (B, L, ...), the padding dropped."""
  n, b, c = x_NxBxC.shape[:3]
  return jnp.swapaxes(x_NxBxC, 0, 1).reshape((b, n * c) + x_NxBxC.shape[3:])[:, :l]


def _forward(h_BxLxD: Array, w_DxV: Array, targets_BxL: Array, c: int, *, with_correct: bool,
             softcap: float = 0.0) -> tuple[Array, Array, Array | None]:
  """(logsumexp, target logit, argmax == target or None), each (B, L), one chunk of logits at a time."""
  l = h_BxLxD.shape[1]
  h_NxBxCxD, _ = _chunks(h_BxLxD, c)
  t_NxBxC, _ = _chunks(targets_BxL, c)

  def body(_, xs):
    h_BxCxD, t_BxC = xs
    logits_BxCxV = logits(h_BxCxD, w_DxV, softcap)
    lse_BxC = jax.nn.logsumexp(logits_BxCxV, axis=-1)
    tgt_BxC = jnp.take_along_axis(logits_BxCxV, t_BxC[..., None], axis=-1)[..., 0]
    correct_BxC = (jnp.argmax(logits_BxCxV, -1) == t_BxC) if with_correct else None
    return None, (lse_BxC, tgt_BxC, correct_BxC)

  _, (lse, tgt, correct) = jax.lax.scan(body, None, (h_NxBxCxD, t_NxBxC))
  return _unchunk(lse, l), _unchunk(tgt, l), None if correct is None else _unchunk(correct, l)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _chunked_nll(h_BxLxD: Array, w_DxV: Array, targets_BxL: Array, c: int, softcap: float) -> Array:
  lse_BxL, tgt_BxL, _ = _forward(h_BxLxD, w_DxV, targets_BxL, c, with_correct=False, softcap=softcap)
  return lse_BxL - tgt_BxL


def _chunked_nll_fwd(h_BxLxD: Array, w_DxV: Array, targets_BxL: Array, c: int, softcap: float):
  lse_BxL, tgt_BxL, _ = _forward(h_BxLxD, w_DxV, targets_BxL, c, with_correct=False, softcap=softcap)
  return lse_BxL - tgt_BxL, (h_BxLxD, w_DxV, targets_BxL, lse_BxL)


def _chunked_nll_bwd(c: int, softcap: float, res, g_BxL: Array):
  h_BxLxD, w_DxV, targets_BxL, lse_BxL = res
  l = h_BxLxD.shape[1]
  logit_dtype = jnp.result_type(h_BxLxD, w_DxV)   # the dtype the forward matmul produced
  xs = tuple(_chunks(x, c)[0] for x in (h_BxLxD, targets_BxL, lse_BxL, g_BxL.astype(jnp.float32)))

  def body(dw_DxV, xs):
    h_BxCxD, t_BxC, lse_BxC, g_BxC = xs
    dlogits_BxCxV = _softmax_grad(logits(h_BxCxD, w_DxV, softcap), lse_BxC, t_BxC, g_BxC, logit_dtype, softcap)
    dh_BxCxD = jnp.einsum("bcv,dv->bcd", dlogits_BxCxV, w_DxV)
    dw_DxV = dw_DxV + jnp.einsum("bcd,bcv->dv", h_BxCxD, dlogits_BxCxV, preferred_element_type=jnp.float32)
    return dw_DxV, dh_BxCxD

  dw_DxV, dh = jax.lax.scan(body, jnp.zeros(w_DxV.shape, jnp.float32), xs)
  return _unchunk(dh, l).astype(h_BxLxD.dtype), dw_DxV.astype(w_DxV.dtype), None


_chunked_nll.defvjp(_chunked_nll_fwd, _chunked_nll_bwd)


def _softmax_grad(logits_BxCxV: Array, lse_BxC: Array, t_BxC: Array, g_BxC: Array, dtype: jnp.dtype,
                  softcap: float = 0.0) -> Array:
  """d(sum(g * nll)) / d logits = (softmax - onehot) * g, in `dtype` (that of the logits matmul); with
  softcap, `logits_BxCxV` are the capped logits and the result is the raw logits' gradient."""
  p_BxCxV = jnp.exp(logits_BxCxV - lse_BxC[..., None])
  onehot_BxCxV = jax.nn.one_hot(t_BxC, logits_BxCxV.shape[-1], dtype=jnp.float32)
  return _cap_grad((p_BxCxV - onehot_BxCxV) * g_BxC[..., None], logits_BxCxV, softcap).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _fused_nll_sum(h_BxLxD: Array, w_DxV: Array, targets_BxL: Array, weights_BxL: Array, static: _Static
                   ) -> tuple[Array, Array, Array]:
  """(total, nll, lse_sq) as `loss_sums` defines them; only total's cotangent is used (the others are
  stop_gradient'ed by the caller)."""
  lse_BxL, tgt_BxL, _ = _forward(h_BxLxD, w_DxV, targets_BxL, static.c, with_correct=False,
                                 softcap=static.softcap)
  return _sums(lse_BxL - tgt_BxL, lse_BxL, weights_BxL, static.z_loss)[:3]


def _sums(nll_BxL: Array, lse_BxL: Array, weights_BxL: Array, z_loss: float
          ) -> tuple[Array, Array, Array, Array]:
  """(total, nll, lse_sq, the per-token loss whose weighted sum is total)."""
  nll = jnp.sum(nll_BxL * weights_BxL)
  if not z_loss:
    return nll, nll, jnp.sum(jnp.square(lse_BxL) * weights_BxL), nll_BxL
  tok_BxL = nll_BxL + z_loss * jnp.square(lse_BxL)
  return jnp.sum(tok_BxL * weights_BxL), nll, jnp.sum(jnp.square(lse_BxL) * weights_BxL), tok_BxL


def _fused_nll_sum_fwd(h_BxLxD: Array, w_DxV: Array, targets_BxL: Array, weights_BxL: Array, static: _Static):
  """One pass over the chunks: logits -> nll, and the gradients of sum(weights * nll) w.r.t. h and w
  (the matrix gradient accumulated in float32)."""
  l = h_BxLxD.shape[1]
  # The gradients are formed before the upstream scale (a float16 run's loss scale) multiplies them:
  # in float16, softmax entries near 1/V would lose their digits (below its normal range), so a
  # float16 run forms them, and keeps dh, in float32. bfloat16 has float32's range.
  grad_dtype = jnp.result_type(h_BxLxD, w_DxV)
  grad_dtype = jnp.float32 if grad_dtype == jnp.float16 else grad_dtype
  xs = tuple(_chunks(x, static.c)[0] for x in (h_BxLxD, targets_BxL, weights_BxL))

  def body(dw_DxV, xs):
    h_BxCxD, t_BxC, g_BxC = xs
    if static.matmul is None:
      logits_BxCxV = logits(h_BxCxD, w_DxV, static.softcap)
    else:   # rounded to the inputs' dtype as `logits` rounds them
      logit_dtype = jnp.result_type(h_BxCxD, w_DxV)
      logits_BxCxV = cap(_product(static, "bcd,dv->bcv", h_BxCxD, w_DxV).astype(logit_dtype).astype(jnp.float32),
                         static.softcap)
    # one exp over the chunk's logits serves both the logsumexp and the softmax (jax.nn.logsumexp, then
    # exp(logits - lse), would take two: each a pass over (chunk x V) at transcendental cost)
    max_BxC = jnp.max(logits_BxCxV, axis=-1)
    max_BxC = jnp.where(jnp.isfinite(max_BxC), max_BxC, 0.0)   # as jax.nn.logsumexp: an all -inf row
    e_BxCxV = jnp.exp(logits_BxCxV - max_BxC[..., None])
    sum_BxC = jnp.sum(e_BxCxV, axis=-1)
    lse_BxC = max_BxC + jnp.log(sum_BxC)
    nll_BxC = lse_BxC - jnp.take_along_axis(logits_BxCxV, t_BxC[..., None], axis=-1)[..., 0]
    onehot_BxCxV = jax.nn.one_hot(t_BxC, logits_BxCxV.shape[-1], dtype=jnp.float32)
    p_BxCxV = e_BxCxV / sum_BxC[..., None]
    if static.z_loss:   # d(z * lse^2) / d logits = 2 z lse * softmax
      p_BxCxV = p_BxCxV * (1.0 + 2.0 * static.z_loss * lse_BxC)[..., None]
    dlogits_BxCxV = _cap_grad((p_BxCxV - onehot_BxCxV) * g_BxC[..., None], logits_BxCxV,
                              static.softcap).astype(grad_dtype)
    if static.matmul is None:
      dh_BxCxD = jnp.einsum("bcv,dv->bcd", dlogits_BxCxV, w_DxV.astype(grad_dtype))
    else:
      dh_BxCxD = _product(static, "bcv,dv->bcd", dlogits_BxCxV, w_DxV.astype(grad_dtype)).astype(grad_dtype)
    dw_DxV = dw_DxV + _product(static, "bcd,bcv->dv", h_BxCxD.astype(grad_dtype), dlogits_BxCxV)
    return dw_DxV, (nll_BxC, lse_BxC, dh_BxCxD)

  dw_DxV, (nll, lse, dh) = jax.lax.scan(body, jnp.zeros(w_DxV.shape, jnp.float32), xs)
  total, nll_sum, lse_sq, tok_BxL = _sums(_unchunk(nll, l), _unchunk(lse, l), weights_BxL, static.z_loss)
  return (total, nll_sum, lse_sq), (_unchunk(dh, l), dw_DxV, tok_BxL)


def _fused_nll_sum_bwd(static: _Static, res, gs: tuple[Array, Array, Array]):
  dh_BxLxD, dw_DxV, tok_BxL = res
  g = gs[0].astype(jnp.float32)   # (nll, lse_sq): the logs' copies, stop_gradient'ed by `loss_sums`
  return ((dh_BxLxD.astype(jnp.float32) * g).astype(static.h_dtype), (dw_DxV * g).astype(static.w_dtype), None,
          tok_BxL * g)


_fused_nll_sum.defvjp(_fused_nll_sum_fwd, _fused_nll_sum_bwd)
