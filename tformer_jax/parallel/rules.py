"""Logical-axis -> mesh-axis rules. The model names axes ('embed', 'heads', 'mlp', ...); these presets
decide where they live, so a new parallelism layout needs no model edit."""
from __future__ import annotations

from tformer_jax.config import ConfigError

Rules = tuple[tuple[str, object], ...]

_BATCH = (("batch", ("data", "fsdp")),)
_TP = (("heads", "tensor"), ("kv_heads", "tensor"), ("mlp", "tensor"), ("vocab", "tensor"))
_EXPERT = (("expert", "expert"),)
# context parallelism: activations' sequence axis over 'context' (attention: ops/context_parallel.py)
_CONTEXT = (("length", "context"),)

PRESETS: dict[str, Rules] = {
    "dp": _BATCH + _EXPERT + _CONTEXT,
    "fsdp": _BATCH + (("embed", "fsdp"),) + _EXPERT + _CONTEXT,
    "tp": _BATCH + _TP + _EXPERT + _CONTEXT,
    "fsdp_tp": _BATCH + (("embed", "fsdp"),) + _TP + _EXPERT + _CONTEXT,
}
PRESETS["fsdp+tp"] = PRESETS["fsdp_tp"]


def get_rules(name_or_rules, mesh_axes: tuple[str, ...]) -> Rules:
  """A preset name (dp, fsdp, tp, fsdp_tp) or explicit ((logical, mesh_axis|tuple|None), ...) pairs.
  Mesh axes absent from the mesh are dropped, so one preset serves meshes with or without 'expert'."""
  if isinstance(name_or_rules, str):
    if name_or_rules not in PRESETS:
      raise ConfigError(f"mesh.rules: unknown preset {name_or_rules!r}; expected one of {sorted(PRESETS)}")
    rules = PRESETS[name_or_rules]
  else:
    rules = tuple((str(a), b) for a, b in name_or_rules)
  out = []
  for logical, target in rules:
    targets = target if isinstance(target, (tuple, list)) else (target,)
    kept = tuple(t for t in targets if t is not None and t in mesh_axes)
    out.append((logical, kept if len(kept) > 1 else (kept[0] if kept else None)))
  return tuple(out)


def unused_axes(rules: Rules, mesh_shape: dict[str, int]) -> list[str]:
  """Mesh axes of size > 1 that no rule maps a logical axis to (their devices would replicate the
  work). The batch axes ('data', 'fsdp') always split the batch."""
  used = {"data", "fsdp"}
  for _, target in rules:
    used.update(target if isinstance(target, tuple) else (target,))
  return [a for a, n in mesh_shape.items() if n > 1 and a not in used]
