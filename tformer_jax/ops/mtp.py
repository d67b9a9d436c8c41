"""Multi-token prediction's shifted targets (DeepSeek-V3, section 2.2): pure functions, no Flax.

With inputs t_0 .. t_{L-1} and targets y_i = t_{i+1}, MTP depth k (1..D) at position i combines the
previous depth's hidden state at i with the embedding of t_{i+k} = y_{i+k-1} and predicts t_{i+k+1} =
y_{i+k}: its inputs are the targets shifted left by k - 1, its targets the targets shifted left by k, and
the last k positions of each row have no target (masked; inside packed documents, a target in another
document than position i is masked too).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def shift_left(x_BxL: Array, k: int, fill: int | float = 0) -> Array:
  """x moved k positions to the left along axis 1, the last k positions set to `fill`."""
  if k == 0:
    return x_BxL
  tail = jnp.full((x_BxL.shape[0], k, *x_BxL.shape[2:]), fill, x_BxL.dtype)
  return jnp.concatenate([x_BxL[:, k:], tail], axis=1)


def depth_inputs(targets_BxL: Array, k: int) -> Array:
  """Depth k's (1-based) input tokens t_{i+k} (0 past the row's end: those positions have no target)."""
  return shift_left(targets_BxL, k - 1)


def depth_targets(targets_BxL: Array, mask_BxL: Array, k: int, segment_ids_BxL: Array | None = None
                  ) -> tuple[Array, Array]:
  """(targets t_{i+k+1}, float mask) of depth k (1-based): the targets and the loss mask shifted left by
  k, the last k positions masked, and with segment ids a target in another document masked."""
  mask = shift_left(mask_BxL.astype(jnp.float32), k)
  if segment_ids_BxL is not None:
    mask = mask * (shift_left(segment_ids_BxL, k, -1) == segment_ids_BxL).astype(jnp.float32)
  return shift_left(targets_BxL, k), mask
