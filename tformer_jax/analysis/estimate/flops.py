"""Training FLOPs per token: the model's (analysis/flops.py's formula, remat's recompute) and what the step
executes beyond it (the MoE dispatch, the chunked loss's recomputed logits)."""
from __future__ import annotations

import dataclasses

from tformer_jax.analysis import flops as flops_lib
from tformer_jax.analysis.estimate.execution import Execution
from tformer_jax.config import GLU_ACTIVATIONS, ModelConfig
from tformer_jax.ops.moe import capacity as moe_capacity


def flops_per_token(m: ModelConfig, seq: int, remat: bool = False) -> float:
  """Training FLOPs per token, analysis/flops.py's formula (6 * N_matmul + 12 * n * L * h * hd); remat:
  + the recomputed forward of the layers (remat 'full': x 4/3 on the layers, not the embedding and
  head: `flops.with_recompute`, the figure tformer-aot compares the compiled HLO with)."""
  mm = dataclasses.replace(m, remat="full" if remat else "none")
  return float(flops_lib.with_recompute(mm, 1, seq)["with_recompute"]) / seq


def extra_flops_per_token(m: ModelConfig, ex: Execution, batch: int, seq: int) -> float:
  """Training FLOPs per token the step runs beyond `flops_per_token`: the MoE dispatch and the chunked
  loss's recomputed logits (one more (T x D x V) matmul)."""
  mo, t = m.moe, batch * seq
  loss = 2.0 * m.d_model * m.vocab_size if ex.loss_chunk > 0 and m.lm_head else 0.0
  if not mo.num_experts:
    return loss
  e, k, d, f = mo.num_experts, mo.top_k, m.d_model, mo.d_ff or m.ff
  per_row = 2.0 * d * f * (3 if m.activation in GLU_ACTIVATIONS else 2)   # one row through one expert
  if mo.dispatch == "capacity":
    c = moe_capacity(t, e, k, mo.capacity_factor)
    # every slot through its expert (forward + backward) and the one-hot einsums: building dispatch and
    # combine (3 x 2 K E C) and applying them (5 x 2 E C D), per token
    extra = 3.0 * (e * c / t - k) * per_row + 6.0 * k * e * c + 10.0 * e * c * d
  elif ex.platform != "tpu":
    extra = 3.0 * k * (e - 1) * per_row                             # ragged_dot's expansion: every expert
  else:
    extra = 0.0
  return loss + extra * sum(m.is_moe_layer(i) for i in range(m.num_layers))
