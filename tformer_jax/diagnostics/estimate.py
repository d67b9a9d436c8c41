"""Memory and FLOPs of a training step from the config alone, next to what XLA compiles.

Estimate (bytes; T = B*L tokens, d = d_model, f = FFN width, h/kh = query/KV heads, hd = head_dim,
V = vocab, n = num_layers, w = compute dtype bytes, 4 = float32):
  params       exact count from `jax.eval_shape(model.init)` (nothing materialised) x param bytes
  grads        = params (same dtype)
  optimizer    AdamW mu + nu = 2 x params in float32 (+ scalar counts)
  batch        inputs + targets (+ loss_mask): int32
  activations  per layer, what the backward pass keeps (no remat):
                 w * T * (c_norm*2*d + 2*d + (2h + 2kh)*hd + c_act*f)  +  3*4*B*h*L*S  +  2*B*h*L*S
               c_norm = 2 (ops.norms saves the normalised input and the output feeds the next matmul);
               the two residual sums 2*d; q, k, v and the attention output (2h + 2kh)*hd;
               c_act = FFN hidden copies: relu 1, gelu_tanh/silu 2, gelu (exact) 3, swiglu 4, geglu 5;
               attention: masked scores, probabilities and their gradient (3 float32 L x S per head)
               plus two boolean masks.
               With remat (per layer, 'full'): n * w*T*d saved block inputs + one layer as above
               (recomputed inside the backward) + one layer's parameter gradients (the scan's
               per-layer slice).
  loss         4 * T * (4*V + 2*d): logits, log-softmax and two gradients of (B, L, V) in float32,
               the embedding output and the final norm.
  total        params + grads + optimizer + batch + activations + loss
FLOPs per token (training = forward + backward = 3 x forward):
  6 * N_matmul + 12 * n * L * h * hd          (remat: 8 * N_matmul + 16 * n * L * h * hd)
  N_matmul = parameters used in a matmul per token (all layer weights + the LM head; the embedding
  and position lookups are not matmuls); the second term is QK^T and AV over all L keys (the causal
  mask is applied after computing the full L x S scores).
KV cache: 2 (K and V) * n * batch * len * kh * hd * bytes.

`compiled_analysis` lowers and compiles the real `train_step` (jax.jit(...).lower(...).compile()) and
reads memory_analysis() and cost_analysis(): the comparable total is arguments + temporaries
(the donated state aliases the outputs). XLA's cost_analysis counts a loop body once, so its FLOPs
are per layer, not per model, under scan_layers. The activation constants above were read off XLA's CPU
buffer assignment (see docs/experiments.md); on CPU, remat only saves memory under scan_layers
(XLA:CPU does not schedule an unrolled remat'd graph for memory), so `--remat` compiles with
scan_layers=True.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from tformer_jax.config import ModelConfig, default_config
from tformer_jax.nn import Transformer
from tformer_jax.train import optim, precision, state as state_lib, step as step_lib

ACT_COPIES = {"relu": 1, "gelu_tanh": 2, "silu": 2, "gelu": 3, "swiglu": 4, "geglu": 5}
NORM_COPIES = {"layernorm": 2, "rmsnorm": 2}  # ops.norms keeps xhat (+ 1/std per row); y feeds a dot
LOSS_COPIES_V = 4
MiB = 1024 * 1024


def _bytes(dtype: str) -> int:
  return jnp.dtype(dtype).itemsize


def param_shapes(m: ModelConfig) -> Any:
  """The parameter tree as ShapeDtypeStructs (jax.eval_shape: nothing is allocated)."""
  tokens = jax.ShapeDtypeStruct((1, min(8, m.max_len)), jnp.int32)
  shapes = jax.eval_shape(lambda t: Transformer(m).init(jax.random.PRNGKey(0), t)["params"], tokens)
  return nn.unbox(shapes)


def param_count(m: ModelConfig) -> int:
  """Exact number of parameters of the model."""
  return int(sum(math.prod(x.shape) for x in jax.tree.leaves(param_shapes(m))))


def matmul_params(m: ModelConfig) -> int:
  """Parameters that take part in a matmul per token (layer weights and the LM head)."""
  total = 0
  for path, x in jax.tree_util.tree_flatten_with_path(param_shapes(m))[0]:
    keys = [str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)]
    if keys[0].startswith("layers") and len(x.shape) >= 2 and keys[-1] not in ("scale", "bias"):
      size = math.prod(x.shape)
      if m.moe.num_experts and "experts" in "/".join(keys):
        size = size * m.moe.top_k // m.moe.num_experts
      total += size
    elif keys[0] == "head":
      total += math.prod(x.shape)
  if m.tie_embeddings and m.lm_head:
    total += m.vocab_size * m.d_model
  return total


def kv_cache_bytes(num_layers: int, batch: int, length: int, kv_heads: int, head_dim: int,
                   bytes_per_elem: int = 2) -> int:
  """2 (K, V) * layers * batch * length * kv_heads * head_dim * bytes."""
  return 2 * num_layers * batch * length * kv_heads * head_dim * bytes_per_elem


def activation_bytes_per_layer(m: ModelConfig, batch: int, seq: int) -> int:
  """What one layer keeps for the backward pass (see the module docstring)."""
  t, w = batch * seq, _bytes(m.dtype)
  c_act = ACT_COPIES.get(m.activation, 3)
  per_token = (NORM_COPIES[m.norm] * 2 * m.d_model + 2 * m.d_model
               + (2 * m.num_heads + 2 * m.kv_heads) * m.hd + c_act * m.ff)
  scores = batch * m.num_heads * seq * seq
  return w * t * per_token + 3 * 4 * scores + 2 * scores


def flops_per_token(m: ModelConfig, seq: int, remat: bool = False) -> float:
  """Training FLOPs per token: 6 * N_matmul + 12 * n * L * h * hd (remat recomputes the layers'
  forward: 8 and 16 instead)."""
  k = 4.0 if remat else 3.0
  return 2.0 * k * matmul_params(m) + 4.0 * k * m.num_layers * seq * m.num_heads * m.hd


@dataclasses.dataclass
class Estimate:
  params: int
  bytes: dict[str, int]
  activation_per_layer: int
  flops_per_token: float
  remat: bool

  @property
  def total(self) -> int:
    return int(sum(self.bytes.values()))


def estimate(m: ModelConfig, batch: int, seq: int, *, remat: bool = False, loss_mask: bool = False
             ) -> Estimate:
  """The formula estimate for one AdamW training step of `m` on (batch, seq)."""
  n = param_count(m)
  pb = _bytes(m.param_dtype)
  per_layer = activation_bytes_per_layer(m, batch, seq)
  t, w = batch * seq, _bytes(m.dtype)
  if remat:
    layer_params = (n - _non_layer_params(m)) // max(m.num_layers, 1)
    acts = m.num_layers * w * t * m.d_model + per_layer + layer_params * pb
  else:
    acts = m.num_layers * per_layer
  parts = {
      "params": n * pb,
      "grads": n * pb,
      "optimizer": 2 * n * 4,
      "batch": (3 if loss_mask else 2) * t * 4,
      "activations": acts,
      "loss": 4 * t * (LOSS_COPIES_V * m.vocab_size + 2 * m.d_model),
  }
  return Estimate(n, parts, per_layer, flops_per_token(m, seq, remat), remat)


def _non_layer_params(m: ModelConfig) -> int:
  total = 0
  for path, x in jax.tree_util.tree_flatten_with_path(param_shapes(m))[0]:
    first = str(path[0].key) if isinstance(path[0], jax.tree_util.DictKey) else ""
    if not first.startswith("layers"):
      total += math.prod(x.shape)
  return total


def compiled_analysis(m: ModelConfig, batch: int, seq: int, optim_cfg: Any = None) -> dict[str, float]:
  """memory_analysis() and cost_analysis() of the compiled real train step (donated state)."""
  optim_cfg = optim_cfg if optim_cfg is not None else default_config().optim
  model = Transformer(m)
  tx, schedule = optim.make_optimizer(optim_cfg, 1000)
  init = state_lib.init_fn(model, tx, precision.get_policy("float32").initial_loss_scale(), seq)
  state = jax.eval_shape(lambda r: state_lib.unbox_plain(init(r)), jax.random.PRNGKey(0))
  tok = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
  fn = step_lib.make_train_step(model, tx, schedule, optim_cfg)
  compiled = jax.jit(fn, donate_argnums=(0,)).lower(state, {"inputs": tok, "targets": tok}).compile()
  ma = compiled.memory_analysis()
  ca = compiled.cost_analysis()
  ca = ca[0] if isinstance(ca, (list, tuple)) else ca
  out = {
      "argument": float(ma.argument_size_in_bytes),
      "output": float(ma.output_size_in_bytes),
      "alias": float(ma.alias_size_in_bytes),
      "temp": float(ma.temp_size_in_bytes),
      "flops": float(ca.get("flops", float("nan"))) if ca else float("nan"),
  }
  out["total"] = out["argument"] + out["temp"] + max(out["output"] - out["alias"], 0.0)
  out["flops_per_token"] = out["flops"] / (batch * seq)
  return out


def format_report(m: ModelConfig, est: Estimate, batch: int, seq: int, xla: dict[str, float] | None = None,
                  kv: tuple[int, int] | None = None) -> str:
  """A text report: the estimate by part, next to XLA's numbers when given."""
  mb = lambda b: f"{b / MiB:10.2f} MiB"  # noqa: E731
  lines = [f"model: d_model={m.d_model} layers={m.num_layers} heads={m.num_heads}/{m.kv_heads} "
           f"head_dim={m.hd} ff={m.ff} vocab={m.vocab_size} ({m.activation}, {m.norm}); "
           f"batch={batch} seq={seq} remat={'full' if est.remat else 'none'}",
           f"parameters: {est.params:,} (exact, from jax.eval_shape)", ""]
  for k, v in est.bytes.items():
    lines.append(f"  {k:<12}{mb(v)}")
  lines.append(f"  {'total':<12}{mb(est.total)}   (activations per layer {est.activation_per_layer / MiB:.2f} MiB)")
  formula = "8 N_matmul + 16 n L h hd" if est.remat else "6 N_matmul + 12 n L h hd"
  lines.append(f"  FLOPs/token  {est.flops_per_token:,.0f}  ({formula})")
  if xla is not None:
    ratio = est.total / xla["total"]
    lines += ["", "XLA compiled train step (memory_analysis / cost_analysis):",
              f"  arguments   {mb(xla['argument'])}", f"  temporaries {mb(xla['temp'])}",
              f"  total       {mb(xla['total'])}   estimate/XLA = {ratio:.3f}",
              f"  FLOPs/token  {xla['flops_per_token']:,.0f}   estimate/XLA = "
              f"{est.flops_per_token / xla['flops_per_token']:.3f}"
              + ("  (scan_layers: XLA counts the loop body once)" if m.scan_layers else "")]
  if kv is not None:
    b, length = kv
    for name, nbytes in (("float32", 4), ("bf16/fp16", 2)):
      total = kv_cache_bytes(m.num_layers, b, length, m.kv_heads, m.hd, nbytes)
      lines.append(f"KV cache batch={b} len={length} {name}: {mb(total)} "
                   f"({total / m.num_layers / MiB:.2f} MiB per layer)")
  return "\n".join(lines)


__all__ = ["Estimate", "activation_bytes_per_layer", "compiled_analysis", "estimate",
           "flops_per_token", "format_report", "kv_cache_bytes", "matmul_params", "param_count",
           "param_shapes"]
