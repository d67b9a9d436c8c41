"""What every family's config mapping shares: typed reads of config.json values, activations, RoPE, per-layer
attention kinds, and the one error type.

A family module (one per group, beside this file) has one function each way per family
(`<family>_to_model(hf) -> ModelConfig kwargs`, `<family>_to_hf(cfg) -> config.json dict`). They read plain JSON
dicts (transformers 5 `rope_parameters` as well as the older `rope_theta` + `rope_scaling` / `rotary_pct`
spellings) and never import transformers. Options our model cannot reproduce raise `HFConfigError` naming the
option instead of converting to something different. An error raised by a `_to_hf` function names the
ModelConfig field (`field`) and, in `fix`, values that get past it, so `interop.hf` can go on and list every
field a family cannot hold.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping

from tformer_jax.config import ModelConfig, RopeScaling

_MISSING = object()

# HF activation names -> ours (plain FFN), and the GLU form (act(gate) * up).
ACTS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
        "relu": "relu", "silu": "silu", "swish": "silu"}
GLU_ACTS = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu", "gelu_pytorch_tanh": "geglu_tanh",
            "gelu_new": "geglu_tanh", "gelu_fast": "geglu_tanh"}
ACTS_BACK = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "silu": "silu"}
GLU_ACTS_BACK = {"swiglu": "silu", "geglu": "gelu", "geglu_tanh": "gelu_pytorch_tanh"}
ROPE_TYPES = {"default": "none", "linear": "linear", "dynamic": "dynamic", "yarn": "yarn", "llama3": "llama3"}


class HFConfigError(ValueError):
  """A Hugging Face config that cannot be translated (the message names the option).

  From a `_to_hf` function: `field` is the ModelConfig field the family cannot hold and `fix` the
  ModelConfig replacements the family could hold instead (to look for further differences)."""

  def __init__(self, message: str, field: str = "", fix: Mapping[str, Any] | None = None):
    super().__init__(message)
    self.field = field
    self.fix = dict(fix or {})


def get(hf: dict, *names: str, default: Any = _MISSING) -> Any:
  """The first of `names` present (and not None) in `hf`, else `default` (error if none given)."""
  for n in names:
    if hf.get(n) is not None:
      return hf[n]
  if default is _MISSING:
    raise HFConfigError(f"config.json of model_type {hf.get('model_type')!r} has no {names[0]!r}")
  return default


def _named(hf: dict, names: tuple[str, ...]) -> str:
  return next((n for n in names if hf.get(n) is not None), names[0])


def get_int(hf: dict, *names: str, default: Any = _MISSING, minimum: int = 0) -> int:
  """`get` of an integer (an integral JSON number, at least `minimum`); otherwise an error naming it."""
  v = get(hf, *names, default=default)
  if isinstance(v, float) and v.is_integer():
    v = int(v)
  if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
    raise HFConfigError(f"{hf.get('model_type')}: {_named(hf, names)}={v!r} is not an integer >= {minimum}")
  return v


def get_float(hf: dict, *names: str, default: Any = _MISSING) -> float:
  """`get` of a finite number; otherwise an error naming it."""
  v = get(hf, *names, default=default)
  if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
    raise HFConfigError(f"{hf.get('model_type')}: {_named(hf, names)}={v!r} is not a finite number")
  return float(v)


def get_bool(hf: dict, *names: str, default: Any = _MISSING) -> bool:
  """`get` of a JSON boolean (0 and 1 pass too); otherwise an error naming it."""
  v = get(hf, *names, default=default)
  if not isinstance(v, int) or v not in (0, 1):
    raise HFConfigError(f"{hf.get('model_type')}: {_named(hf, names)}={v!r} is not true or false")
  return bool(v)


def require(hf: dict, name: str, allowed: tuple, default: Any) -> Any:
  """`hf[name]` (or `default`), which must be one of `allowed`; otherwise an error naming it."""
  v = hf.get(name, default)
  v = default if v is None else v
  if v not in allowed:
    raise HFConfigError(f"{hf.get('model_type')}: unsupported {name}={v!r} (supported: {list(allowed)})")
  return v


def activation(hf: dict, name: str, default: str, glu: bool = False) -> str:
  act = get(hf, name, default=default)
  table = GLU_ACTS if glu else ACTS
  if act not in table:
    raise HFConfigError(f"{hf.get('model_type')}: unsupported {name}={act!r} (supported: {sorted(table)})")
  return table[act]


def activation_back(cfg: ModelConfig, family: str, glu: bool = False) -> str:
  table = GLU_ACTS_BACK if glu else ACTS_BACK
  if cfg.activation not in table:
    raise HFConfigError(f"{family} cannot represent model.activation={cfg.activation!r} "
                        f"(supported: {sorted(table)})", "activation", {"activation": sorted(table)[-1]})
  return table[cfg.activation]


# ---------------------------------------------------------------------------------------------
# RoPE

def rope_from_hf(hf: dict, *, default_theta: float, default_fraction: float = 1.0,
                 allow_partial: bool = False) -> dict:
  """rope_theta, rotary_fraction and rope_scaling kwargs from `rope_parameters` (transformers 5) or
  the older top-level `rope_theta` / `rope_scaling` / `rotary_pct` / `rotary_emb_base` keys."""
  for key in ("rope_scaling", "rope_parameters"):
    if not isinstance(hf.get(key) or {}, dict):
      raise HFConfigError(f"{hf.get('model_type')}: {key}={hf[key]!r} is not an object")
  rp = dict(hf.get("rope_scaling") or {})
  rp.update(hf.get("rope_parameters") or {})
  if any(isinstance(v, dict) for v in rp.values()):
    raise HFConfigError(f"{hf.get('model_type')}: per-layer-type rope_parameters are not supported")
  theta = get(hf, "rope_theta", "rotary_emb_base", default=default_theta)
  theta = get_float(rp, "rope_theta", default=theta)
  frac = get_float(rp, "partial_rotary_factor",
                   default=get_float(hf, "partial_rotary_factor", "rotary_pct", default=default_fraction))
  if frac != 1.0 and not allow_partial:
    raise HFConfigError(f"{hf.get('model_type')}: unsupported partial_rotary_factor={frac}")
  kind = get(rp, "rope_type", "type", default="default")
  if kind not in ROPE_TYPES:
    raise HFConfigError(f"{hf.get('model_type')}: unsupported rope_type {kind!r} "
                        f"(supported: {sorted(ROPE_TYPES)})")
  out: dict[str, Any] = {"rope_theta": theta, "rotary_fraction": frac}
  if kind == "default":
    return out
  max_pos = get_int(hf, "max_position_embeddings", default=2048)
  scaling: dict[str, Any] = {"type": ROPE_TYPES[kind]}
  orig = get_int(hf, "original_max_position_embeddings",
                 default=get_int(rp, "original_max_position_embeddings", default=max_pos))
  factor = rp.get("factor")
  if kind in ("linear", "dynamic", "llama3") and factor is None:
    raise HFConfigError(f"{hf.get('model_type')}: rope_type {kind!r} needs a 'factor'")
  if kind == "dynamic":
    # transformers' dynamic NTK grows beyond max_position_embeddings (not the rope 'original' one).
    orig = max_pos
  if kind == "yarn":
    factor = max_pos / orig if factor is None else factor
    att = rp.get("attention_factor")
    mscale, mscale_all = rp.get("mscale"), rp.get("mscale_all_dim")
    if att is None and mscale and mscale_all:
      def m(s: float, ms: float) -> float:
        return 1.0 if s <= 1 else 0.1 * ms * math.log(s) + 1.0
      att = m(factor, mscale) / m(factor, mscale_all)
    scaling.update(beta_fast=float(rp.get("beta_fast") or 32.0), beta_slow=float(rp.get("beta_slow") or 1.0),
                   attention_factor=float(att or 0.0), truncate=get_bool(rp, "truncate", default=True))
  if kind == "llama3":
    scaling.update(low_freq_factor=get_float(rp, "low_freq_factor"),
                   high_freq_factor=get_float(rp, "high_freq_factor"))
  scaling.update(factor=float(factor), original_max_len=orig if kind != "linear" else 0)
  out["rope_scaling"] = scaling
  return out


def rope_to_hf(cfg: ModelConfig, family: str, *, partial: bool = False) -> dict:
  """transformers 5 `rope_parameters` of a RoPE model (`partial`: the family has partial_rotary_factor)."""
  rs = cfg.rope_scaling
  kind = {v: k for k, v in ROPE_TYPES.items()}.get(rs.type)
  if kind is None:
    raise HFConfigError(f"{family} cannot represent model.rope_scaling.type={rs.type!r} "
                        f"(supported: {sorted(ROPE_TYPES.values())})", "rope_scaling",
                        {"rope_scaling": RopeScaling()})
  if cfg.rotary_fraction != 1.0 and not partial:
    raise HFConfigError(f"{family} cannot represent model.rotary_fraction={cfg.rotary_fraction} (it rotates "
                        "every dimension)", "rotary_fraction", {"rotary_fraction": 1.0})
  rp: dict[str, Any] = {"rope_type": kind, "rope_theta": cfg.rope_theta}
  if partial or cfg.rotary_fraction != 1.0:
    rp["partial_rotary_factor"] = cfg.rotary_fraction
  orig = rs.original_max_len or cfg.max_len
  if kind in ("linear", "dynamic", "yarn", "llama3"):
    rp["factor"] = rs.factor
  if kind in ("yarn", "llama3"):
    rp["original_max_position_embeddings"] = orig
  if kind == "yarn":
    rp.update(beta_fast=rs.beta_fast, beta_slow=rs.beta_slow)
    if not rs.truncate:
      rp["truncate"] = False
    if rs.attention_factor:
      rp["attention_factor"] = rs.attention_factor
  if kind == "llama3":
    rp.update(low_freq_factor=rs.low_freq_factor, high_freq_factor=rs.high_freq_factor)
  return rp


# ---------------------------------------------------------------------------------------------
# Per-layer attention kinds (layer_types), the attention-bias and RoPE checks, the MoE sizes

LAYER_TYPES = {"full_attention": "G", "sliding_attention": "L"}
LAYER_TYPES_BACK = {v: k for k, v in LAYER_TYPES.items()}


def shortest_cycle(kinds: str) -> str:
  """The shortest prefix p of `kinds` with kinds[i] == p[i % len(p)] for every i (its smallest period,
  from the KMP prefix function: linear in the number of layers). A layer count that is not a multiple
  of the cycle is fine ('LLLLLG' for Gemma 3 1B's 26 layers); a list with no shorter period is its own
  cycle (Qwen2's max_window_layers split), every layer then being its own scan step."""
  n = len(kinds)
  if n == 0:
    return ""
  pi = [0] * n
  for i in range(1, n):
    k = pi[i - 1]
    while k and kinds[i] != kinds[k]:
      k = pi[k - 1]
    pi[i] = k + (kinds[i] == kinds[k])
  return kinds[:n - pi[-1]]


def layer_kinds(hf: dict, n: int, default: Callable[[int], str]) -> str:
  """One 'L' (sliding window) or 'G' (global) per layer: config.json's `layer_types` when it has them,
  else `default(i)` (what transformers derives from the older keys)."""
  types = hf.get("layer_types")
  if types is None:
    return "".join(default(i) for i in range(n))
  if not isinstance(types, list) or len(types) != n:
    what = f"a list of {len(types)}" if isinstance(types, list) else _json_kind_of(types)
    raise HFConfigError(f"{hf.get('model_type')}: layer_types is {what}, not one entry per layer "
                        f"(num_hidden_layers={n})")
  bad = sorted({repr(t) for t in types if not isinstance(t, str) or t not in LAYER_TYPES}, key=str)
  if bad:
    raise HFConfigError(f"{hf.get('model_type')}: unsupported layer_types {', '.join(bad[:3])} "
                        f"(supported: {sorted(LAYER_TYPES)})")
  return "".join(LAYER_TYPES[t] for t in types)


def _json_kind_of(v: Any) -> str:
  return {dict: "an object", str: "a string", bool: "a boolean"}.get(type(v), "a number")


def layer_attention(kinds: str, window: int, max_len: int, local_theta: float, out: dict) -> dict:
  """window, layer_pattern and local_rope_theta kwargs of per-layer kinds: the shortest cycle of them
  where the layers differ ('' when every layer attends alike: all global, or all within `window` with
  the global RoPE); local_theta is the sliding layers' (unscaled) RoPE base, 0 = the global RoPE's."""
  rope_differs = local_theta not in (0.0, out.get("rope_theta")) or (
      local_theta and out.get("rope_scaling", {}).get("type", "none") != "none")
  if not window or "L" not in kinds or (window >= max_len and not rope_differs):
    return dict(window=0, layer_pattern="", local_rope_theta=0.0)   # a window as long as the context is none
  if "G" not in kinds and not rope_differs:
    return dict(window=window, layer_pattern="", local_rope_theta=0.0)
  return dict(window=window, layer_pattern=shortest_cycle(kinds), local_rope_theta=local_theta if rope_differs else 0.0)


def layer_types_back(cfg: ModelConfig) -> list[str]:
  """transformers' per-layer `layer_types` of a model (every layer sliding when it has a window and no
  pattern)."""
  return [LAYER_TYPES_BACK["L" if cfg.is_local_layer(i) else "G"] for i in range(cfg.num_layers)]


def one_attention_bias(cfg: ModelConfig, family: str) -> None:
  if cfg.qkv_bias != cfg.out_bias:
    raise HFConfigError(f"{family} cannot represent model.qkv_bias={cfg.qkv_bias} with model.out_bias={cfg.out_bias} "
                        "(one attention_bias covers both)", "out_bias", {"out_bias": cfg.qkv_bias})


def global_rope_only(cfg: ModelConfig, family: str) -> None:
  """Families whose sliding layers share the global RoPE (one rope_parameters for every layer)."""
  if cfg.layer_pattern and cfg.local_rope_theta not in (0.0, cfg.rope_theta):
    raise HFConfigError(f"{family} cannot represent model.local_rope_theta={cfg.local_rope_theta} (every layer "
                        "uses the global RoPE)", "local_rope_theta", {"local_rope_theta": 0.0})



def moe_common(hf: dict, experts: str, d_ff: str) -> dict:
  """The MoEConfig kwargs every MoE family shares: sizes, top-k, the auxiliary loss coefficient
  (transformers' router_aux_loss_coef; no z-loss, no jitter), dropless dispatch."""
  return dict(num_experts=get_int(hf, experts, "num_local_experts", "num_experts"),
              top_k=get_int(hf, "num_experts_per_tok", minimum=1), d_ff=get_int(hf, d_ff), dispatch="dropless",
              aux_loss_coef=get_float(hf, "router_aux_loss_coef", default=0.001), z_loss_coef=0.0, jitter=0.0)


def common(hf: dict) -> dict:
  """What every family reads first: the vocabulary size."""
  return {"vocab_size": get_int(hf, "vocab_size")}
