"""AdamW through the C++ CPU kernel (ops.cpu_kernel.adamw_update_cpu): optim.update_impl.

`optim.make_optimizer` builds optax.chain([clip_by_global_norm,] adamw); on the CPU backend XLA runs
that update as three loop fusions per parameter array plus copies of the old moments. `FusedAdamW`
computes the same step with one in-place pass per array and returns the *same* optimizer-state tree
(counts, mu, nu), so checkpoints, `tx.init` and the optax path stay interchangeable.

  optax       tx.update + optax.apply_updates (every backend)
  cpu_kernel  the kernel (CPU, float32 parameters)
  auto        cpu_kernel on the CPU backend with float32 parameters, no multi-device mesh and the
              kernels building here; else optax
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from tformer_jax.train import optim

UPDATE_IMPLS = ("optax", "cpu_kernel", "auto")
PyTree = Any


def kernel_applies(params: PyTree) -> bool:
  """'auto''s test, at trace time: float32 leaves and `cpu_kernel.usable_here()` (CPU backend, no
  multi-device mesh, the kernels build)."""
  if any(jnp.dtype(x.dtype) != jnp.float32 for x in jax.tree.leaves(params)):
    return False
  from tformer_jax.ops import cpu_kernel
  return cpu_kernel.usable_here()


def _split_state(opt_state: Any, clip: bool):
  """(clip state or None, ScaleByAdamState, masked-decay state, ScaleByScheduleState)."""
  try:
    clip_state, (adam, decay, sched) = opt_state if clip else (None, opt_state[0])
    assert isinstance(adam, optax.ScaleByAdamState)
    assert isinstance(sched, optax.ScaleByScheduleState)
  except (TypeError, ValueError, AssertionError) as e:
    raise ValueError("optim.update_impl='cpu_kernel' expects the state of optim.make_optimizer's "
                     f"chain([clip_by_global_norm,] adamw); got {jax.tree.structure(opt_state)}") from e
  return clip_state, adam, decay, sched


class FusedAdamW:
  """`(grads, opt_state, params, finite, grad_norm) -> (params, opt_state)`, equal to the optax path
  (tx.update, apply_updates, then keeping the old state where `finite` is False) up to float32
  rounding. grad_norm is the global norm of grads (the step has it already)."""

  def __init__(self, optim_cfg: Any, schedule: optax.Schedule, impl: str):
    if impl not in ("cpu_kernel", "auto"):
      raise ValueError(f"optim.update_impl: unknown value {impl!r}; expected one of {UPDATE_IMPLS}")
    self.impl, self.schedule = impl, schedule
    self.clip = float(optim_cfg.clip_norm)
    self.b1, self.b2 = float(optim_cfg.b1), float(optim_cfg.b2)
    self.eps, self.wd = float(optim_cfg.eps), float(optim_cfg.weight_decay)

  def applies(self, params: PyTree) -> bool:
    return self.impl == "cpu_kernel" or kernel_applies(params)

  def __call__(self, grads: PyTree, opt_state: Any, params: PyTree, finite: jax.Array,
               grad_norm: jax.Array) -> tuple[PyTree, Any]:
    from tformer_jax.ops.cpu_kernel.adamw import adamw_apply_cpu, adamw_scalars
    clip_state, adam, decay, sched = _split_state(opt_state, self.clip > 0)
    if self.clip > 0:   # optax.clip_by_global_norm as one factor on g
      scale = jnp.where(grad_norm < self.clip, 1.0, self.clip / grad_norm)
    else:
      scale = jnp.ones((), jnp.float32)
    # the step's scalars once, for decayed and for undecayed arrays
    scalars = {decayed: adamw_scalars(
        lr=self.schedule(sched.count), b1=self.b1, b2=self.b2, eps=self.eps,
        weight_decay=self.wd if decayed else 0.0, count=optax.safe_increment(adam.count),
        grad_scale=scale, finite=finite) for decayed in (True, False)}

    def leaf(p, g, m, v, decayed):
      return adamw_apply_cpu(p, g.astype(jnp.float32), m, v, scalars[bool(decayed)])

    treedef = jax.tree.structure(params)
    outs = [leaf(*xs) for xs in zip(*(treedef.flatten_up_to(t) for t in (
        params, grads, adam.mu, adam.nu, optim.decay_mask(params))))]
    new_params, new_mu, new_nu = (treedef.unflatten([o[i] for o in outs]) for i in range(3))
    step = finite.astype(adam.count.dtype)
    new_adam = adam._replace(count=adam.count + step, mu=new_mu, nu=new_nu)
    new_sched = sched._replace(count=sched.count + step)
    adamw_state = (new_adam, decay, new_sched)
    return new_params, ((clip_state, adamw_state) if self.clip > 0 else (adamw_state,))
