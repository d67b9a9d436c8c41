"""The config side: ModelConfig <-> config.json through a family's table, and which family a ModelConfig is."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from tformer_jax.config import ConfigError, ModelConfig, MoEConfig, RopeScaling, validate_model
from tformer_jax.config.schema import MLAConfig
from tformer_jax.interop.families import FAMILIES, Family, HFConfigError, get_family

# ----------------------------------------------------------------------------------------------
# Configs


def model_config(**kwargs: Any) -> ModelConfig:
  """A validated ModelConfig from kwargs whose rope_scaling / moe may be dicts."""
  if isinstance(kwargs.get("rope_scaling"), Mapping):
    kwargs["rope_scaling"] = RopeScaling(**kwargs["rope_scaling"])
  if isinstance(kwargs.get("moe"), Mapping):
    kwargs["moe"] = MoEConfig(**kwargs["moe"])
  if isinstance(kwargs.get("mla"), Mapping):
    kwargs["mla"] = MLAConfig(**kwargs["mla"])
  cfg = ModelConfig(**kwargs)
  validate_model(cfg)
  return cfg


def model_config_from_hf(hf_cfg: Mapping[str, Any], family: Family | None = None) -> ModelConfig:
  """The validated ModelConfig of a config.json dict; HFConfigError (one line) for anything it cannot be."""
  family = family or get_family(hf_cfg.get("model_type"))
  try:
    return model_config(**family.to_model(dict(hf_cfg)))
  except HFConfigError:
    raise
  except ConfigError as e:
    raise HFConfigError(f"{family.model_type}: {e}") from None
  except (TypeError, ValueError, KeyError, AttributeError, ArithmeticError) as e:  # malformed nested values
    raise HFConfigError(f"{family.model_type}: malformed config ({type(e).__name__}: {e})") from None


def arch_signature(cfg: ModelConfig) -> dict[str, Any]:
  """The fields that decide what the model computes (`ModelConfig.architecture`)."""
  return cfg.architecture()


_MAX_FIXES = 8


def _mismatches(cfg: ModelConfig, family: Family) -> tuple[dict | None, dict[str, str]]:
  """(config.json dict, {}) if `family` reproduces `cfg` exactly, else (None, {model field: reason})
  naming every architectural field the family cannot hold (a field it refuses is replaced by one it
  can hold, `HFConfigError.fix`, to look for the others)."""
  reasons: dict[str, str] = {}
  probe = dataclasses.replace(cfg, d_ff=cfg.ff)  # a substituted activation must not resize the FFN
  for _ in range(_MAX_FIXES):
    try:
      hf = family.to_hf(probe)
      break
    except HFConfigError as e:
      if not e.field or not e.fix or e.field in reasons:
        return None, {**reasons, e.field or "?": str(e)}
      reasons[e.field] = str(e)
      probe = dataclasses.replace(probe, **e.fix)
  else:
    return None, reasons
  try:
    back = model_config_from_hf(hf, family)
  except (HFConfigError, ValueError) as e:   # a table bug: to_hf wrote what to_model refuses
    return None, {**reasons, "?": f"{family.model_type}: {e}"}
  if family.mtp:   # config.json's MTP count is not read (the tensors decide, load_hf), only written
    back = dataclasses.replace(back, mtp_depth=cfg.mtp_depth)
  want, got = arch_signature(cfg), arch_signature(back)
  for k in want:
    if want[k] != got.get(k) and k not in reasons:
      has = f"it would be {got[k]!r}" if got.get(k) is not None else f"{family.model_type} has none"
      reasons[k] = f"{family.model_type} cannot represent model.{k}={want[k]!r} ({has})"
  return (None, reasons) if reasons else (hf, {})


def hf_config_from_model(cfg: ModelConfig, family: str) -> dict:
  """The config.json dict of `cfg` as `family`; HFConfigError (one line) naming every field the
  family cannot represent."""
  hf, reasons = _mismatches(cfg, get_family(family))
  if hf is None:
    raise HFConfigError("; ".join(reasons.values()))
  return hf


# Fields that say what kind of model it is: named for context when a model has no family.
_KIND_FIELDS = ("position", "norm", "activation")
_FOLLOW_POSITION = ("rope_theta", "rotary_fraction", "rope_layout", "rope_scaling", "t5_num_buckets",
                    "t5_max_distance")


def infer_family(cfg: ModelConfig) -> str:
  """The first family (gpt2, llama, mistral, mixtral, qwen2, qwen3, olmo2, gemma2, gemma3_text, qwen3_moe, gpt_oss,
  deepseek_v3, bloom, gpt_neox, bert) that reproduces `cfg`.

  None: HFConfigError in one line naming the architectural fields that the nearest families (fewest
  differences) cannot hold, and the fields the next ones differ in."""
  groups: dict[tuple[str, ...], list[str]] = {}   # differing fields -> families, in table order
  reasons: dict[tuple[str, ...], dict[str, str]] = {}
  for name, fam in FAMILIES.items():
    hf, why = _mismatches(cfg, fam)
    if hf is not None:
      return name
    fields = tuple(k for k in why if not ("position" in why and k in _FOLLOW_POSITION))
    groups.setdefault(fields, []).append(name)
    reasons.setdefault(fields, why)
  ranked = sorted(groups, key=len)
  nearest = ranked[0]
  sig = arch_signature(cfg)
  head = ", ".join(f"model.{k}={sig[k]!r}" for k in nearest if k in sig) or "this model"
  kind = [f"{k}={getattr(cfg, k)!r}" for k in _KIND_FIELDS if k not in nearest]
  detail = f"{'/'.join(groups[nearest])}: {'; '.join(reasons[nearest].values())}"
  # The next nearest that hold what the nearest cannot (those differing in the same fields and more add nothing).
  others = [f for f in ranked[1:] if not set(nearest) <= set(f)] or ranked[1:]
  nxt = [f"{'/'.join(groups[f])} differ(s) in {', '.join(f)}" for f in others[:2]]
  raise HFConfigError(f"{head}" + (f" with {' and '.join(kind)}" if kind else "")
                      + f": no Hugging Face family holds this architecture ({'; '.join([detail] + nxt)})")
