"""The layers as decoding compiles them: scanned (one layer body) or unrolled, and the params converted."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax

from tformer_jax import backends
from tformer_jax.decode.compiled import _model_key
from tformer_jax.decode.request import _cfg
from tformer_jax.nn.stacking import stack_layers, unstack_layers


def _dense_first(cfg: Any) -> int:
  """The dense first layers scanned apart (moe.first_k_dense; 0 for other models)."""
  return cfg.moe.first_k_dense if cfg.moe.num_experts else 0


def _uniform_layers(cfg: Any) -> bool:
  """All blocks alike past the dense first layers (a scan needs one body): not the case for MoE every
  k-th layer."""
  return (len({cfg.is_moe_layer(i) for i in range(_dense_first(cfg), cfg.num_layers)}) <= 1
          and _dense_first(cfg) % cfg.cycle == 0)


_LAYOUT: list[tuple[Any, list[Any], Any]] = []   # (key, the source leaves kept alive, result): one entry


def _converted(model: nn.Module, params: Any, convert: Callable[[], Any]) -> Any:
  """`convert()` of these params, the last conversion kept (repeated calls reuse it)."""
  leaves = jax.tree.leaves(params)
  key = (_model_key(model), tuple(id(x) for x in leaves))
  if _LAYOUT and _LAYOUT[0][0] == key:
    return _LAYOUT[0][2]
  out = convert()
  _LAYOUT[:] = [(key, leaves, out)]
  return out


def decode_layout(model: nn.Module, params: Any, scan: bool | None = None) -> tuple[nn.Module, Any]:
  """(model, params) as decoding compiles them: scanned (scan=True) or unrolled (False) layers, no
  remat; None = the runtime's choice (`backends.current().decode_layout`, decided per platform by
  `resolve_runtime`; outside a `backends.use` block: scanned).

  Scanning compiles one layer body instead of num_layers copies; on XLA:CPU each scanned step slices
  every layer's weights out of the stack (a copy per layer per token), so unrolled layers decode
  faster per token there but compile longer (figures: docs/runtime.md). Params are converted to the
  chosen layout (a copy of the layer weights), the last conversion kept. A stack whose layers differ
  (MoE every k-th layer) stays unrolled.
  """
  cfg = _cfg(model)
  if scan is None:
    scan = backends.current().decode_layout != "unrolled"
  scan = bool(scan) and (cfg.scan_layers or _uniform_layers(cfg))
  new_cfg = dataclasses.replace(cfg, scan_layers=scan, remat="none")
  out_model = model if new_cfg == cfg else model.clone(cfg=new_cfg)
  if cfg.scan_layers == scan:
    return out_model, params
  if scan:
    return out_model, _converted(model, params, lambda: stack_layers(params, cfg.num_layers, cfg.cycle,
                                                                     _dense_first(cfg)))
  return out_model, _converted(model, params, lambda: unstack_layers(params, cfg.num_layers, cfg.cycle,
                                                                     _dense_first(cfg)))
