"""The XLA:CPU backend: everything that exists only for training speed on CPU, behind one door.

Same values as the reference backend (tests/test_backends.py: gradients within 1e-5 in float32);
what changes is how XLA:CPU runs them (docs/benchmarks.md has the measurements):
  norm       the closed-form LayerNorm/RMSNorm backward (ops/norms.py).
  dense      a hand-written VJP whose weight gradient is x^T dy (XLA's autodiff layout makes it
             transpose dy and fuse the backward residual chain into each transpose); with the C++
             kernels, that product by the run's BLAS (backends/cpu/kernels/matmul.py; runtime.cpu_blas),
             and under runtime.cpu_matmul 'all' the forward and input-gradient products too.
  residual   `grad_fusion_barrier`: identity whose cotangent is materialised, so the residual-stream
             gradient is computed once per block instead of fused into every consumer.
  attention  'chunked' runs as the C++ kernel (backends/cpu/kernels/attention.py) with the kernels on.
  glu        SwiGLU's silu(g) * u as one C++ pass per direction (backends/cpu/kernels/glu.py), with the kernels on.
  loss       the fused cross-entropy's bfloat16 products with float32 results (`loss_matmul`): the weight
             gradient on the bfloat16 kernel, the logits and dh on XLA's dot, with the kernels on MKL or oneDNN.
  optimizer  AdamW as one in-place C++ pass per parameter array (`FusedAdamW`), with the kernels on.
The kernels take float32, and bfloat16 where the BLAS has a bf16 gemm (oneMKL's cblas_gemm_bf16bf16f32,
oneDNN's dnnl_gemm_bf16bf16f32: bf16 operands, float32 accumulation); other dtypes, and bf16 on OpenBLAS
(except SwiGLU, which calls no BLAS), keep XLA's ops.
The custom VJPs block forward-mode autodiff (`jax.jvp`); use the reference backend for that.
The C++ kernels are single-device custom calls: runtime.cpu_kernels='auto' leaves them off under a
multi-device jit mesh (XLA would gather their operands onto every device); 'on' keeps them there.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import optax

from tformer_jax.backends.base import AdamWSpec, Backend
from tformer_jax.backends.cpu import kernels as cpu_kernel
from tformer_jax.ops import norms as norm_ops

Array = jax.Array
PyTree = Any


@dataclasses.dataclass(frozen=True)
class XlaCpuBackend(Backend):
  """cpu_kernels: use the C++ kernels (float32; bfloat16 with cpu_blas 'mkl' or 'onednn'; others keep XLA's
  ops). cpu_matmul: which of the projections' products they run, 'weight_grads' (dw) or 'all' (y, dx and dw).
  cpu_blas: the sgemm they call, 'openblas' | 'mkl' | 'onednn' (a process-wide setting: resolve_runtime
  applies it, see backends/cpu/kernels/build.py)."""
  cpu_kernels: bool = True
  cpu_matmul: str = "weight_grads"
  cpu_blas: str = "openblas"
  name: ClassVar[str] = "xla_cpu"

  def describe(self) -> str:
    kernels = (f"C++ kernels on: {self.cpu_blas}, matmuls {self.cpu_matmul}" if self.cpu_kernels
               else "C++ kernels off")
    return f"{self.name} (attention {self.attention_impl}, {kernels})"

  @property
  def bf16_gemm(self) -> bool:
    """Whether the kernels' BLAS has a bfloat16 gemm (their bfloat16 variants run on it)."""
    return self.cpu_blas in cpu_kernel.build.BF16_BLAS

  def dense(self, spec: str, x: Array, w: Array) -> Array:
    return project(spec, x, w, self.cpu_kernels, self.cpu_matmul == "all", bf16=self.bf16_gemm)

  def glu(self, activation: str, act, gate: Array, up: Array) -> Array:
    if self.cpu_kernels and activation == "swiglu" and gate.shape == up.shape \
        and _kernel_dtype(True, gate, up) and gate.dtype == up.dtype:
      return cpu_kernel.swiglu_cpu(gate, up)
    return super().glu(activation, act, gate, up)

  def loss_matmul(self):
    # bfloat16 products with float32 results, the weight gradient on the kernel (_bf16_or_xla_matmul); float32
    # ones measured no faster on it than on XLA's dot (docs/runtime.md), so they stay there
    return _bf16_or_xla_matmul if self.cpu_kernels and self.bf16_gemm else None

  def norm(self, x: Array, scale: Array, bias: Array | None, *, eps: float, center: bool) -> Array:
    return norm_ops.norm_closed_form_vjp(x, scale, bias, eps, center)

  def residual(self, x_BxLxD: Array) -> Array:
    return grad_fusion_barrier(x_BxLxD)

  def chunked_attention(self, q_BxLxHxD: Array, k_BxSxKxD: Array, v_BxSxKxD: Array, **kw) -> Array:
    softcap, sinks_H = kw.pop("softcap", 0.0), kw.pop("sinks_H", None)   # the C++ kernel has neither
    if self.cpu_kernels and _kernel_dtype(self.bf16_gemm, q_BxLxHxD, k_BxSxKxD, v_BxSxKxD) \
        and kw.get("q_segment_ids_BxL") is None and not softcap and sinks_H is None:
      return cpu_kernel.chunked_attention_cpu(q_BxLxHxD, k_BxSxKxD, v_BxSxKxD, **kw)
    kw.update(softcap=softcap, sinks_H=sinks_H)
    return super().chunked_attention(q_BxLxHxD, k_BxSxKxD, v_BxSxKxD, **kw)

  def wrap_optimizer(self, tx: optax.GradientTransformation, spec: AdamWSpec
                     ) -> optax.GradientTransformation:
    return fused_adamw(tx, spec) if self.cpu_kernels else tx


# ---------------------------------------------------------------------------------------------------
# dense: einsum with a hand-written VJP


def project(spec: str, x: Array, w: Array, cpu_kernels: bool = False, blas_all: bool = False,
            bf16: bool = False) -> Array:
  """jnp.einsum(spec, x, w) for an activation x and a weight w, with a hand-written VJP.

  Same values and gradients as autodiff; only the gradient *layouts* differ: autodiff computes the
  weight gradient as dot(dy, x) with dy (the residual-stream gradient) as the left operand, which
  makes XLA transpose dy, and on CPU it then fuses the whole backward residual chain (a sum over
  every later layer) into each such transpose. Here dw = einsum(x, dy) (x first, no transpose of
  dy) and dx = einsum(dy, w). With cpu_kernels, a spec that is one 2-D float32 matmul (the rows of x
  times w: every projection of the models here) computes dw = x^T dy with backends.cpu.kernels.matmul_cpu
  (the C++ call on the run's BLAS, faster than XLA:CPU's dot for that transposed product), and with
  blas_all too the forward y = x w and dx = dy w^T (runtime.cpu_matmul 'all'); a weight with a side under
  MIN_KERNEL_SIDE (a LoRA adapter) keeps XLA's dots, in the same layouts. bf16: bfloat16 x and w run on
  the kernel too (the BLAS has a bfloat16 gemm: oneMKL, oneDNN), float32 accumulation, outputs rounded to bfloat16.
  """
  return _project(spec, cpu_kernels, cpu_kernels and blas_all, cpu_kernels and bf16, x, w)


def _as_matmul(spec: str, x: Array, w: Array) -> tuple[int, int, int, tuple[int, ...]] | None:
  """(rows, k, n, y's shape) when einsum(spec, x, w) is the 2-D matmul x.reshape(rows, k) @ w.reshape(k, n)
  (x's leading letters are the output's, its trailing ones w's leading ones), else None."""
  ins, out = spec.split("->")
  sx, sw = ins.split(",")
  rows = "".join(c for c in sx if c in out and c not in sw)   # e.g. 'bl': summed over for dw
  kx = sx[len(rows):]                                        # x's contracted letters, e.g. 'd'
  n = out[len(rows):]                                        # the output's weight letters
  if not (sx.startswith(rows) and out.startswith(rows) and sw == kx + n):
    return None
  r, k = math.prod(x.shape[:len(rows)]), math.prod(x.shape[len(rows):])
  return r, k, math.prod(w.shape[len(kx):]), tuple(x.shape[:len(rows)]) + tuple(w.shape[len(kx):])


def _f32(*arrays: Array) -> bool:
  return all(a.dtype == jnp.float32 for a in arrays)


def _kernel_dtype(bf16: bool, *arrays: Array) -> bool:
  """The kernel's operand dtypes: all float32, or (bf16: the BLAS has a bfloat16 gemm) all bfloat16."""
  return _f32(*arrays) or (bf16 and all(a.dtype == jnp.bfloat16 for a in arrays))


# The kernel splits a product into one block per thread: a weight side narrower than this (a LoRA adapter's
# rank) leaves each sgemm too little work, and XLA's dot is faster there (measured: docs/results/README.md);
# 16 keeps every projection of the models here (head dims of 8 and more, grouped K/V) on the kernel.
MIN_KERNEL_SIDE = 16


def _kernel_size(k: int, n: int) -> bool:
  return min(k, n) >= MIN_KERNEL_SIDE


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _project(spec: str, cpu_kernels: bool, blas_all: bool, bf16: bool, x: Array, w: Array) -> Array:
  return _project_fwd(spec, cpu_kernels, blas_all, bf16, x, w)[0]


def _project_fwd(spec: str, cpu_kernels: bool, blas_all: bool, bf16: bool, x: Array, w: Array):
  mm = _as_matmul(spec, x, w)
  if blas_all and mm and _kernel_dtype(bf16, x, w) and _kernel_size(mm[1], mm[2]):
    r, k, n, shape = mm
    y = cpu_kernel.matmul_cpu(x.reshape(r, k), w.reshape(k, n), out_dtype=x.dtype).reshape(shape)
    return y, (x, w)
  return jnp.einsum(spec, x, w), (x, w)


def _project_bwd(spec: str, cpu_kernels: bool, blas_all: bool, bf16: bool, res, g: Array):
  x, w = res
  mm = _as_matmul(spec, x, w)
  if mm:
    # 2-D matmuls with one contracting dimension each: XLA then needs no transposed copies.
    r, k, n, _ = mm
    x2, g2, w2 = x.reshape(r, k), g.reshape(r, n), w.reshape(k, n)
    blas = cpu_kernels and _kernel_dtype(bf16, x2, g2, w2) and _kernel_size(k, n)
    if blas:
      dw = cpu_kernel.matmul_cpu(x2, g2, transpose_a=True, out_dtype=w.dtype).reshape(w.shape)
    else:
      dw = jax.lax.dot_general(x2, g2, (((0,), (0,)), ((), ()))).reshape(w.shape)
    if blas and blas_all:
      dx = cpu_kernel.matmul_cpu(g2, w2, transpose_b=True, out_dtype=x.dtype).reshape(x.shape)
    else:
      dx = jax.lax.dot_general(g2, w2, (((1,), (1,)), ((), ()))).reshape(x.shape)
  else:
    ins, out = spec.split("->")
    sx, sw = ins.split(",")
    dx = jnp.einsum(f"{out},{sw}->{sx}", g, w)
    dw = jnp.einsum(f"{sx},{out}->{sw}", x, g)
  return dx.astype(x.dtype), dw.astype(w.dtype)


_project.defvjp(_project_fwd, _project_bwd)


def _bf16_or_xla_matmul(a: Array, b: Array, transpose_a: bool, transpose_b: bool) -> Array:
  """op(a) @ op(b) in float32: the C++ kernel for bfloat16 operands with a transposed (the fused loss's
  weight gradient, h^T dlogits, where XLA's bfloat16 dot is slowest), XLA's dot with float32 results otherwise
  (the logits and dh products, where the two ran level; figures in docs/runtime.md)."""
  if a.dtype == jnp.bfloat16 and b.dtype == jnp.bfloat16 and transpose_a:
    return cpu_kernel.matmul_cpu(a, b, transpose_a=transpose_a, transpose_b=transpose_b)
  dims = (((0,) if transpose_a else (1,), (1,) if transpose_b else (0,)), ((), ()))
  return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


# ---------------------------------------------------------------------------------------------------
# residual: the gradient fusion barrier


def _one_trip_loop(x: Array) -> Array:
  """x, through a while loop that runs once; its trip count comes from x (x[0] * 0 + 1, which is 1
  for any x: NaN and inf convert to 0) and its body adds float(i) * 0 (XLA folds neither, a float
  times 0 being NaN for inf), so XLA cannot drop the loop or hoist x out of it."""
  n = (x.reshape(-1)[0] * 0).astype(jnp.int32) + 1
  body = lambda c: (c[0] + 1, c[1] + c[0].astype(x.dtype) * 0)  # noqa: E731
  return jax.lax.while_loop(lambda c: c[0] < n, body, (jnp.int32(0), x))[1]


@jax.custom_vjp
def grad_fusion_barrier(x: Array) -> Array:
  """Identity whose cotangent is materialised: the backward passes it through a one-trip loop, a
  fusion boundary XLA keeps (it drops `lax.optimization_barrier` before fusing on CPU).

  Why: XLA:CPU fuses the residual-stream gradient, a sum over every later layer's contribution, into
  each of its consumers instead of computing it once, so layer l's backward recomputes the chain of
  all layers above it (O(L^2) elementwise work). Put at each block's input it cuts the chain per
  layer (docs/benchmarks.md, 'The residual-gradient barrier', has the effect). On GPU a while loop's
  trip count goes through the host, so only this backend uses it."""
  return x


def _barrier_fwd(x):
  return x, None


def _barrier_bwd(_, g):
  return (_one_trip_loop(g),)


grad_fusion_barrier.defvjp(_barrier_fwd, _barrier_bwd)


# ---------------------------------------------------------------------------------------------------
# optimizer: AdamW as one C++ pass per array


class _AdamWParts(NamedTuple):
  clip: Any
  adam: optax.ScaleByAdamState
  decay: Any
  sched: optax.ScaleByScheduleState


def _split_state(opt_state: Any, clip: bool) -> _AdamWParts:
  """The pieces of `train.optim.make_optimizer`'s chain([clip_by_global_norm,] adamw) state."""
  try:
    clip_state, (adam, decay, sched) = opt_state if clip else (None, opt_state[0])
    assert isinstance(adam, optax.ScaleByAdamState)
    assert isinstance(sched, optax.ScaleByScheduleState)
  except (TypeError, ValueError, AssertionError) as e:
    raise ValueError("the xla_cpu fused AdamW expects the state of optim.make_optimizer's "
                     f"chain([clip_by_global_norm,] adamw); got {jax.tree.structure(opt_state)}") from e
  return _AdamWParts(clip_state, adam, decay, sched)


def fused_adamw(reference: optax.GradientTransformation, spec: AdamWSpec
                ) -> optax.GradientTransformationExtraArgs:
  """The AdamW chain of `spec` (clip, adamw with the decay mask) as one C++ pass per float32 array:
  the same state tree as `reference` (its `init` is reused, so checkpoints are interchangeable) and
  the same updates up to float32 rounding. Extra args of `update`: finite (False: zero updates, state
  kept; default all gradients finite) and grad_norm (the gradients' global norm, if known)."""

  def update(grads: PyTree, state: Any, params: PyTree | None = None, *, finite: Array | None = None,
             grad_norm: Array | None = None, **extra) -> tuple[PyTree, Any]:
    del extra
    if params is None:
      raise ValueError("the fused AdamW needs params (weight decay)")
    bad = [f"{jax.tree_util.keystr(k)}: {x.dtype}" for k, x in jax.tree_util.tree_leaves_with_path(params)
           if x.dtype != jnp.float32]
    if bad:
      raise ValueError(f"the fused AdamW (runtime.cpu_kernels) updates float32 parameters; got {bad[0]}")
    parts = _split_state(state, spec.clip_norm > 0)
    if finite is None:
      finite = jnp.all(jnp.asarray([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
    if spec.clip_norm > 0:   # optax.clip_by_global_norm as one factor on g
      norm = optax.tree.norm(grads) if grad_norm is None else grad_norm
      scale = jnp.where(norm < spec.clip_norm, 1.0, spec.clip_norm / norm)
    else:
      scale = jnp.ones((), jnp.float32)
    scalars = {decayed: cpu_kernel.adamw_scalars(   # the step's scalars, once per weight decay
        lr=spec.schedule(parts.sched.count), b1=spec.b1, b2=spec.b2, eps=spec.eps,
        weight_decay=spec.weight_decay if decayed else 0.0, count=optax.safe_increment(parts.adam.count),
        grad_scale=scale, finite=finite) for decayed in (True, False)}
    treedef = jax.tree.structure(params)
    flat = (treedef.flatten_up_to(t) for t in (params, grads, parts.adam.mu, parts.adam.nu,
                                                spec.decay_mask(params)))
    outs = [cpu_kernel.adamw_apply_cpu(p, g.astype(jnp.float32), m, v, scalars[bool(decayed)])
            for p, g, m, v, decayed in zip(*flat)]
    updates, mu, nu = (treedef.unflatten([o[i] for o in outs]) for i in range(3))
    step = jnp.asarray(finite).astype(parts.adam.count.dtype)
    adam = parts.adam._replace(count=parts.adam.count + step, mu=mu, nu=nu)
    adamw_state = (adam, parts.decay, parts.sched._replace(count=parts.sched.count + step))
    return updates, ((parts.clip, adamw_state) if spec.clip_norm > 0 else (adamw_state,))

  return optax.GradientTransformationExtraArgs(reference.init, update)
