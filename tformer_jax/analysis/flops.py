"""FLOP accounting for a training step, stated exactly so every benchmark counts the same way.

  flops_per_step = 6 * N_matmul * T  +  12 * n_layers * (n_heads * head_dim) * S * T * c

  T          tokens per step (batch * seq)
  S          the attention context (seq; keys every query is scored against); a sliding-window layer
             (model.window, every layer or the local layers of model.layer_pattern) counts
             min(window, seq) keys with the factor 12 under either convention below
  N_matmul   parameters that take part in a matmul for every token: all parameters except the
             token / position / token-type embedding tables (lookups, not matmuls), plus the LM
             head (vocab * d_model) counted once whether or not it is tied to the embedding.
             Norm scales and biases are included (they are < 0.2% of N here). MoE expert weights
             count top_k / num_experts of their size (the experts a token actually runs).
  6          2 FLOPs per multiply-add, forward (1x) + backward (2x: input and weight gradients).
  12         QK^T and PV: 2 * 2 * S * head_dim per head per token forward, x3 for fwd + bwd. Under MLA
             QK^T is (qk_nope_head_dim + qk_rope_head_dim) wide and PV v_head_dim: head_dim is their mean
             (`attention_head_dim`; the layer's training form, every head's K and V formed)
  c          1 for 'full' (what a masked dense kernel computes: causal-naive, the convention
             used here by default); 0.5 for 'causal' (only the lower triangle, what a causal
             flash kernel that skips masked blocks does).

Elementwise work (softmax, norms, GELU, the optimizer) is not counted: MFU is matmul FLOPs over
the machine's matmul rate, as in PaLM (Chowdhery et al. 2022, appendix B).

What a compiled step executes adds the rematerialised forward (`with_recompute`): remat 'full' runs
each layer's forward twice (x 4/3 on the layers: forward 2 + recompute 2 + backward 4, less the
projections no backward reads, `_not_rerun`: a pre-LN block's FFN output; the embedding
and LM head are outside the checkpointed blocks), 'dots_no_batch' recomputes the attention's batched
matmuls (x 4/3 on the attention term), 'dots' saves every matmul output (x 1), and the named policies
('save_qkvo', 'save_mlp_in') rerun what 'full' does less the forward of the projections they keep.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from tformer_jax.config import GLU_ACTIVATIONS, REMAT_POLICIES, ModelConfig
from tformer_jax.nn import Transformer
from tformer_jax.train.state import unbox_plain

EMBED_TABLES = ("embed", "pos_embed", "type_embed")
FORMULA = {
    "full": "6*N_matmul*T + 12*n_layers*n_heads*head_dim*seq*T",
    "causal": "6*N_matmul*T + 6*n_layers*n_heads*head_dim*seq*T",
}


def _path_keys(path: tuple) -> list[str]:
  return [str(getattr(k, "key", getattr(k, "name", ""))) for k in path]


def param_shapes(m: ModelConfig) -> Any:
  """The parameter tree of `Transformer(m)` as ShapeDtypeStructs (nothing is allocated or run; traced
  under whatever backend is current: backends never change parameters)."""
  tokens = jax.ShapeDtypeStruct((1, min(8, m.max_len)), jnp.int32)
  boxed = jax.eval_shape(lambda r, t: Transformer(m).init(r, t)["params"], jax.random.PRNGKey(0), tokens)
  return unbox_plain(boxed)


def param_counts(m: ModelConfig) -> dict[str, int]:
  """{'total', 'embedding', 'nonembed', 'head', 'matmul'} parameter counts of `Transformer(m)`."""
  total = embedding = head = moe_total = moe_active = 0
  e = m.moe.num_experts
  for path, leaf in jax.tree_util.tree_flatten_with_path(param_shapes(m))[0]:
    keys = _path_keys(path)
    n = int(leaf.size)
    total += n
    if keys[-1] in EMBED_TABLES and len(keys) == 1:
      embedding += n
    elif keys[-1] == "head" and len(keys) == 1:
      head += n
    elif e and "moe" in keys and leaf.ndim >= 3 and not keys[-1].startswith("shared_"):
      moe_total += n
      moe_active += n * m.moe.top_k // e
  if m.lm_head and m.tie_embeddings:
    head = m.vocab_size * m.d_model
  nonembed = total - embedding
  matmul = nonembed - moe_total + moe_active + (head if m.tie_embeddings and m.lm_head else 0)
  return {"total": total, "embedding": embedding, "nonembed": nonembed, "head": head, "matmul": matmul}


def attention_head_dim(m: ModelConfig) -> float:
  """The width the attention term counts per head: head_dim, or under MLA the mean of the q/k width
  (qk_nope_head_dim + qk_rope_head_dim) and the value width (v_head_dim), QK^T's and PV's."""
  if m.use_mla:
    return (m.mla.qk_nope_head_dim + m.mla.qk_rope_head_dim + m.mla.v_head_dim) / 2
  return m.hd


def flops_per_step(m: ModelConfig, batch: int, seq: int, attn: str = "full") -> dict[str, Any]:
  """Training FLOPs per optimizer step (see the module docstring) and their parts."""
  if attn not in FORMULA:
    raise ValueError(f"attn must be one of {tuple(FORMULA)}, got {attn!r}")
  counts = param_counts(m)
  t = batch * seq
  dense = 6 * counts["matmul"] * t
  c = 12 if attn == "full" else 6
  local = sum(1 for i in range(m.num_layers) if m.is_local_layer(i))
  # a local (sliding-window) layer's queries see at most `window` keys: 12 x its keys, either convention
  attention = (c * (m.num_layers - local) * seq + 12 * local * min(m.window, seq)) * m.num_heads * t
  attention = int(attention * attention_head_dim(m))
  return {"flops_per_step": dense + attention, "dense_flops": dense, "attention_flops": attention,
          "tokens_per_step": t, "n_matmul": counts["matmul"], "params": counts["total"],
          "params_nonembed": counts["nonembed"], "formula": FORMULA[attn]}


def _projection_params(m: ModelConfig, name: str) -> int:
  """Weights of the projection whose output nn/ tags `name` (config.REMAT_NAMES), one layer."""
  q, kv = m.num_heads * m.hd, m.kv_heads * m.hd
  glu = m.activation in GLU_ACTIVATIONS
  return {"query_proj": m.d_model * q, "key_proj": m.d_model * kv, "value_proj": m.d_model * kv,
          "out_proj": q * m.d_model, "mlp_in": m.d_model * m.ff, "mlp_gate": m.d_model * m.ff if glu else 0}[name]


def _not_rerun(m: ModelConfig) -> int:
  """Weights, summed over the layers, whose forward a recomputed layer skips: the projections whose outputs
  only feed the layer's output sum, which the backward never reads (JAX's remat reruns only what the
  gradient needs): in a pre-LN block the FFN's output projection, with a parallel residual the attention's
  output projection too. A post-LN block's norm reads that sum, so it reruns them all; MoE FFNs (their
  outputs weigh the router's gradient) are rerun too."""
  if m.norm_position != "pre" and not m.parallel_residual:
    return 0
  dense = sum(not m.is_moe_layer(i) for i in range(m.num_layers))   # layers with a dense FFN
  out_proj = m.num_heads * m.hd * m.d_model if m.parallel_residual else 0
  return dense * m.ff * m.d_model + m.num_layers * out_proj


def with_recompute(m: ModelConfig, batch: int, seq: int, attn: str = "full") -> dict[str, Any]:
  """`flops_per_step` plus 'with_recompute': the FLOPs the step executes with `m.remat`'s recomputed
  forward (module docstring), and 'remat'."""
  out = dict(flops_per_step(m, batch, seq, attn))
  extra = 0.0
  saved = REMAT_POLICIES.get(m.remat)
  if m.remat == "full" or isinstance(saved, tuple):
    one, two = (flops_per_step(dataclasses.replace(m, num_layers=k), batch, seq, attn)["flops_per_step"]
                for k in (1, 2))
    extra = (two - one) * m.num_layers / 3
    # named outputs kept, and the projections whose outputs nothing in the backward reads: their forward
    # is not rerun
    kept = sum(_projection_params(m, n) for n in saved) if isinstance(saved, tuple) else 0
    extra -= 2 * batch * seq * (m.num_layers * kept + _not_rerun(m))
  elif m.remat == "dots_no_batch":
    extra = out["attention_flops"] / 3
  out["with_recompute"] = out["flops_per_step"] + extra
  out["remat"] = m.remat
  return out


def finetune_flops(m: ModelConfig, batch: int, seq: int, *, adapter_params: int = 0,
                   attn: str = "full") -> dict[str, Any]:
  """`with_recompute` for a fine-tuning step; with adapter_params > 0, a LoRA step over frozen weights.

  LoRA (ops/lora.py, applied unmerged: x W + (x A) s B): the frozen weights take no gradient, so the
  step executes 'with_recompute' less the weight-gradient products (2 * N_matmul * T), plus the adapters'
  own products: forward, input gradient and weight gradient (6 * adapter_params * T), and where remat
  reruns the layers ('full' and the named policies) their forward again (2 * adapter_params * T: an upper
  bound, as an adapter on a projection that is not rerun is counted rerun). adapter_params is their count
  (A and B of every adapted projection). Adds 'executed' (the FLOPs the step runs) and 'frozen_base'.
  Within 2% of the matmul FLOPs in the compiled step's HLO (tests/test_lora.py)."""
  out = with_recompute(m, batch, seq, attn)
  t = batch * seq
  executed = out["with_recompute"]
  if adapter_params:
    rerun = m.remat == "full" or isinstance(REMAT_POLICIES.get(m.remat), tuple)
    executed += -2 * out["n_matmul"] * t + (8 if rerun else 6) * adapter_params * t
  return {**out, "executed": executed, "frozen_base": bool(adapter_params)}
