"""Shared pieces of the linen layer: dtypes, initialisers, norms and the logical-axis param helper."""
from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from tformer_jax.config import ModelConfig
from tformer_jax.ops import norms as norm_ops


def dtypes(cfg: ModelConfig) -> tuple[jnp.dtype, jnp.dtype]:
  """(compute dtype, param dtype)."""
  return jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)


def normal(std: float) -> nn.initializers.Initializer:
  return nn.initializers.normal(stddev=std)


def residual_std(cfg: ModelConfig) -> float:
  """Std of residual output projections: GPT-2's init_std / sqrt(2 * num_layers) when enabled."""
  return cfg.init_std / math.sqrt(2 * cfg.num_layers) if cfg.scale_residual_init else cfg.init_std


def param(module: nn.Module, name: str, init, shape: tuple[int, ...], axes: tuple[str | None, ...],
          dtype: jnp.dtype) -> jax.Array:
  """A parameter carrying logical axis names only (mesh rules live in configs)."""
  return module.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)


class Norm(nn.Module):
  """LayerNorm or RMSNorm over the last axis (ops.norms: closed-form backward), computed in float32,
  cast back to the input dtype."""
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.cfg
    _, pdt = dtypes(cfg)
    d = x.shape[-1]
    x32 = x.astype(jnp.float32)
    scale = param(self, "scale", nn.initializers.ones, (d,), ("norm",), pdt).astype(jnp.float32)
    if cfg.norm == "rmsnorm":
      return norm_ops.rms_norm(x32, scale, cfg.norm_eps).astype(x.dtype)
    bias = None
    if cfg.norm_bias:
      bias = param(self, "bias", nn.initializers.zeros, (d,), ("norm",), pdt).astype(jnp.float32)
    return norm_ops.layer_norm(x32, scale, bias, cfg.norm_eps).astype(x.dtype)


def activation_fn(name: str):
  return {
      "gelu": lambda x: jax.nn.gelu(x, approximate=False),
      "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
      "relu": jax.nn.relu,
      "silu": jax.nn.silu,
      "swiglu": jax.nn.silu,
      "geglu": lambda x: jax.nn.gelu(x, approximate=False),
  }[name]


def _one_trip_loop(x: jax.Array) -> jax.Array:
  """x, through a while loop that runs once; its trip count comes from x (x[0] * 0 + 1, which is 1
  for any x: NaN and inf convert to 0) and its body adds float(i) * 0 (XLA folds neither, a float
  times 0 being NaN for inf), so XLA cannot drop the loop or hoist x out of it."""
  n = (x.reshape(-1)[0] * 0).astype(jnp.int32) + 1
  body = lambda c: (c[0] + 1, c[1] + c[0].astype(x.dtype) * 0)  # noqa: E731
  return jax.lax.while_loop(lambda c: c[0] < n, body, (jnp.int32(0), x))[1]


@jax.custom_vjp
def grad_fusion_barrier(x: jax.Array) -> jax.Array:
  """Identity whose cotangent is materialised: the backward passes it through a one-trip loop, a
  fusion boundary XLA keeps (it drops `lax.optimization_barrier` before fusing on CPU).

  Why: XLA:CPU fuses the residual-stream gradient, a sum over every later layer's contribution, into
  each of its consumers instead of computing it once, so layer l's backward recomputes the chain of
  all layers above it (O(L^2) elementwise work; gpt2_cpu: fusions with 27 to 113 operands). Put at
  each block's input it cuts the chain per layer: on gpt2_cpu LayerNorm backward 55 -> 20 ms/step,
  +2.8% tokens/s, 24-layer unrolled compile 30 -> 14 s. Values and gradients are unchanged (tested)."""
  return x


def _barrier_fwd(x):
  return x, None


def _barrier_bwd(_, g):
  return (_one_trip_loop(g),)


grad_fusion_barrier.defvjp(_barrier_fwd, _barrier_bwd)


def residual_grad_barrier(cfg: ModelConfig, x: jax.Array) -> jax.Array:
  """`grad_fusion_barrier(x)` when cfg.residual_grad_barrier says so: 'on', or 'auto' on the CPU
  backend (on GPU a while loop's trip count goes through the host, so 'auto' leaves it off)."""
  mode = cfg.residual_grad_barrier
  if mode == "on" or (mode == "auto" and jax.default_backend() == "cpu"):
    return grad_fusion_barrier(x)
  return x


def cpu_kernels_apply(cfg: ModelConfig) -> bool:
  """Whether 'auto' may pick the C++ CPU kernels (ops.cpu_kernel): float32 compute and
  `cpu_kernel.usable_here()` (CPU backend, no multi-device mesh, the kernels build)."""
  if dtypes(cfg)[0] != jnp.float32:
    return False
  from tformer_jax.ops import cpu_kernel
  return cpu_kernel.usable_here()


def resolve_weight_grad_impl(cfg: ModelConfig) -> str:
  """cfg.weight_grad_impl with 'auto' replaced: 'cpu_kernel' where `cpu_kernels_apply`, else 'xla'.
  Both compute the same weight gradients (float32 summation order aside)."""
  if cfg.weight_grad_impl != "auto":
    return cfg.weight_grad_impl
  return "cpu_kernel" if cpu_kernels_apply(cfg) else "xla"


# Set False to use plain jnp.einsum autodiff everywhere (A/B benchmarking of `project`).
PROJECT_VJP = True


def project(spec: str, x: jax.Array, w: jax.Array, weight_grad: str = "xla") -> jax.Array:
  """jnp.einsum(spec, x, w) for an activation x and a weight w, with a hand-written VJP.

  Same values and gradients as autodiff; only the gradient *layouts* differ: autodiff computes the
  weight gradient as dot(dy, x) with dy (the residual-stream gradient) as the left operand, which
  makes XLA transpose dy, and on CPU it then fuses the whole backward residual chain (a sum over
  every later layer) into each such transpose. Here dw = einsum(x, dy) (x first, no transpose of
  dy) and dx = einsum(dy, w). weight_grad='cpu_kernel' computes dw = x^T dy of the 2-D case in
  float32 with ops.cpu_kernel.matmul_cpu (faster than XLA:CPU's dot for that transposed product).
  """
  if not PROJECT_VJP:
    return jnp.einsum(spec, x, w)
  return _project(spec, weight_grad, x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _project(spec: str, weight_grad: str, x: jax.Array, w: jax.Array) -> jax.Array:
  return jnp.einsum(spec, x, w)


def _project_fwd(spec: str, weight_grad: str, x: jax.Array, w: jax.Array):
  return jnp.einsum(spec, x, w), (x, w)


def _project_bwd(spec: str, weight_grad: str, res, g: jax.Array):
  x, w = res
  ins, out = spec.split("->")
  sx, sw = ins.split(",")
  rows = "".join(c for c in sx if c in out and c not in sw)   # e.g. 'bl': summed over for dw
  kx = sx[len(rows):]                                        # x's contracted letters, e.g. 'd'
  n = out[len(rows):]                                        # the output's weight letters
  if sx.startswith(rows) and out.startswith(rows) and sw == kx + n:
    # 2-D matmuls with one contracting dimension each: XLA then needs no transposed copies.
    r = math.prod(x.shape[:len(rows)])
    x2, g2 = x.reshape(r, -1), g.reshape(r, -1)
    w2 = w.reshape(x2.shape[1], g2.shape[1])
    if weight_grad == "cpu_kernel" and x2.dtype == g2.dtype == jnp.float32:
      from tformer_jax.ops.cpu_kernel import matmul_cpu
      dw = matmul_cpu(x2, g2, transpose_a=True).reshape(w.shape)
    else:
      dw = jax.lax.dot_general(x2, g2, (((0,), (0,)), ((), ()))).reshape(w.shape)
    dx = jax.lax.dot_general(g2, w2, (((1,), (1,)), ((), ()))).reshape(x.shape)
  else:
    dx = jnp.einsum(f"{out},{sw}->{sx}", g, w)
    dw = jnp.einsum(f"{sx},{out}->{sw}", x, g)
  return dx.astype(x.dtype), dw.astype(w.dtype)


_project.defvjp(_project_fwd, _project_bwd)
