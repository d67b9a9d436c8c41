"""`adamw_update_cpu`: one AdamW step on one float32 array as a C++ custom call, in place.

Same arithmetic as optax.chain(clip_by_global_norm, adamw) on that array, in one pass over p, g, mu
and nu (XLA:CPU runs three fusions per array plus copies). `adamw_apply_cpu` returns the update (as
optax does; the moments in place), `adamw_update_cpu` the new parameters. Used by the xla_cpu
backend's optimizer (backends/cpu/xla_cpu.py). Not differentiable (an optimizer step).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from tformer_jax.backends.cpu.kernels import build

Array = jnp.ndarray


def adamw_scalars(*, lr: Array | float, b1: float, b2: float, eps: float,
                  weight_decay: Array | float, count: Array, grad_scale: Array | float = 1.0,
                  finite: Array | bool = True) -> Array:
  """The kernel's 11 float32 scalars for one step, rounded as optax rounds them; one vector serves
  every array with the same weight decay (see `adamw_update_cpu` for the arguments)."""
  t = jnp.asarray(count, jnp.int32)
  b1, b2 = float(b1), float(b2)
  return jnp.stack([jnp.asarray(x, jnp.float32) for x in (
      lr, b1, b2, 1.0 - b1, 1.0 - b2, eps, weight_decay, 1 - b1 ** t, 1 - b2 ** t, grad_scale,
      jnp.asarray(finite, jnp.float32))])


def adamw_apply_cpu(p: Array, g: Array, mu: Array, nu: Array, scalars: Array
                    ) -> tuple[Array, Array, Array]:
  """(update, mu, nu) of one step, with the scalars from `adamw_scalars` (computed once per step):
  the update is -lr * (adam direction + weight decay * p), zero for a non-finite step."""
  arrays = (p, g, mu, nu)
  if any(a.dtype != jnp.float32 for a in arrays) or len({a.shape for a in arrays}) != 1:
    raise ValueError("adamw_update_cpu: p, g, mu, nu must be float32 arrays of one shape, got "
                     + ", ".join(f"{a.dtype}{tuple(a.shape)}" for a in arrays))
  if jax.default_backend() != "cpu":
    raise ValueError(f"adamw_update_cpu is a CPU kernel; the default backend is "
                     f"{jax.default_backend()!r}")
  build.load()
  out = jax.ShapeDtypeStruct(p.shape, jnp.float32)
  call = jax.ffi.ffi_call("tfj_adamw", (out, out, out), input_output_aliases={1: 0, 2: 1, 3: 2},
                          vmap_method="sequential")
  return call(p, g, mu, nu, scalars)


def adamw_update_cpu(p: Array, g: Array, mu: Array, nu: Array, *, lr: Array | float, b1: float,
                     b2: float, eps: float, weight_decay: Array | float, count: Array,
                     grad_scale: Array | float = 1.0, finite: Array | bool = True
                     ) -> tuple[Array, Array, Array]:
  """(p, mu, nu) after one AdamW step with bias corrections for step `count` (1-based, as optax's
  incremented count); g is multiplied by grad_scale first (a global-norm clip); `finite` False
  returns the inputs unchanged. All four arrays float32 and of one shape; CPU backend only."""
  update, mu, nu = adamw_apply_cpu(p, g, mu, nu, adamw_scalars(
      lr=lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, count=count,
      grad_scale=grad_scale, finite=finite))
  return p + update, mu, nu
