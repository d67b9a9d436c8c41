"""tformer-estimate's text report: the estimate by term next to XLA's figures, the KV cache sizes."""
from __future__ import annotations

from typing import Any

from tformer_jax.analysis.estimate.execution import Estimate, MiB
from tformer_jax.analysis.estimate.params import kv_cache_bytes, kv_cache_bytes_as
from tformer_jax.config import ModelConfig


def format_report(m: ModelConfig, est: Estimate, batch: int, seq: int, xla: dict[str, Any] | None = None,
                  kv: tuple[int, int] | None = None) -> str:
  """A text report: the estimate by term, next to XLA's numbers when given (with estimate/XLA)."""
  unit, scale = ("GiB", 1024 * MiB) if est.total >= 16 * 1024 * MiB else ("MiB", MiB)
  mb = lambda b: f"{b / scale:10.2f} {unit}"  # noqa: E731
  moe = f", MoE {m.moe.num_experts} experts top-{m.moe.top_k} {m.moe.dispatch}" if m.moe.num_experts else ""
  lines = [f"model: d_model={m.d_model} layers={m.num_layers} heads={m.num_heads}/{m.kv_heads} head_dim={m.hd} "
           f"ff={m.ff} vocab={m.vocab_size} ({m.activation}, {m.norm}{moe}); batch={batch} seq={seq} "
           f"remat={m.remat} scan_layers={m.scan_layers}",
           f"parameters: {est.params:,} (exact, from jax.eval_shape)"]
  if est.execution:
    lines.append(f"estimated for: {est.execution}")
  lines.append("")
  for k, v in est.bytes.items():
    if v or k in ("params", "optimizer", "activations"):
      lines.append(f"  {k:<15}{mb(v)}")
  phase = max(est.phases, key=est.phases.get) if est.phases else "backward"
  if "per device of" in est.execution:        # estimate_on_mesh: activation_per_layer is one layer's backward
    lines.append(f"  {'total':<15}{mb(est.total)}   (per device; peak in the {phase} phase, one recomputed "
                 f"layer's backward adds {est.activation_per_layer / scale:.2f} {unit})")
  else:
    lines.append(f"  {'total':<15}{mb(est.total)}   (peak in the {phase} phase; the largest block keeps "
                 f"{est.activation_per_layer / scale:.2f} {unit}; one device: --devices=N for a mesh)")
  formula = ("6 N_matmul + 12 n L h hd, the layers x4/3 (remat 'full')" if est.remat and m.remat == "full"
             else "6 N_matmul + 12 n L h hd")
  lines.append(f"  FLOPs/token    {est.flops_per_token:,.0f}  ({formula})")
  executed = est.executed_flops_per_token or est.flops_per_token
  if executed != est.flops_per_token:
    lines.append(f"  executed       {executed:,.0f}  (+ the MoE dispatch / chunked loss as the step runs them)")
  lines += [f"  note: {note}" for note in est.notes]
  if xla is not None:
    lines += ["", f"XLA compiled train step (memory_analysis), {xla.get('runtime', 'the current backend')}:",
              f"  arguments      {mb(xla['argument'])}", f"  temporaries    {mb(xla['temp'])}",
              f"  total          {mb(xla['total'])}   estimate/XLA = {est.total / xla['total']:.3f}"]
    if "flops_per_token" in xla:
      lines.append(f"  FLOPs/token    {xla['flops_per_token']:,.0f}   estimate/XLA = "
                   f"{executed / xla['flops_per_token']:.3f}  ({xla.get('flops_runtime', 'cost_analysis')})")
  if kv is not None:
    b, length = kv
    for name, nbytes in (("float32", 4), ("bf16/fp16", 2)):
      total = kv_cache_bytes(m.num_layers, b, length, m.kv_heads, m.hd, nbytes)
      lines.append(f"KV cache batch={b} len={length} {name}: {mb(total)} "
                   f"({total / m.num_layers / MiB:.2f} MiB per layer)")
    q8 = kv_cache_bytes_as(m, b, length, "int8")
    lines.append(f"KV cache batch={b} len={length} int8 (decode.cache_dtype=int8, scales included): {mb(q8)} "
                 f"({q8 / kv_cache_bytes(m.num_layers, b, length, m.kv_heads, m.hd, 2):.3f}x bf16)")
  return "\n".join(lines)
