"""Config translation between Hugging Face `config.json` dicts and `ModelConfig` keyword arguments.

One function each way per family (`<family>_to_model(hf) -> kwargs`, `<family>_to_hf(cfg) -> dict`).
They read plain JSON dicts (transformers 5 `rope_parameters` as well as the older `rope_theta` +
`rope_scaling` / `rotary_pct` spellings) and never import transformers. Options our model cannot
reproduce raise `HFConfigError` naming the option instead of converting to something different.
An error raised by a `_to_hf` function names the ModelConfig field (`field`) and, in `fix`, values
that get past it, so `interop.hf` can go on and list every field a family cannot hold.
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
# Families

def _common(hf: dict) -> dict:
  return {"vocab_size": get_int(hf, "vocab_size")}


def gpt2_to_model(hf: dict) -> dict:
  for opt in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
    require(hf, opt, (False,), False)
  d = get_int(hf, "n_embd", "hidden_size")
  return dict(
      _common(hf), d_model=d, num_layers=get_int(hf, "n_layer", "num_hidden_layers"),
      num_heads=get_int(hf, "n_head", "num_attention_heads"), d_ff=get_int(hf, "n_inner", default=4 * d),
      activation=activation(hf, "activation_function", "gelu_new"), norm="layernorm",
      norm_eps=get_float(hf, "layer_norm_epsilon", default=1e-5), position="learned",
      max_len=get_int(hf, "n_positions", "max_position_embeddings", default=1024),
      tie_embeddings=get_bool(hf, "tie_word_embeddings", default=True), qkv_bias=True, out_bias=True,
      mlp_bias=True, attention_scale=0.0 if get(hf, "scale_attn_weights", default=True) else 1.0)


def gpt2_to_hf(cfg: ModelConfig) -> dict:
  if cfg.attention_scale not in (0.0, 1.0):
    raise HFConfigError(f"gpt2 cannot represent model.attention_scale={cfg.attention_scale} (only 1/sqrt(head_dim) "
                        "or none)", "attention_scale", {"attention_scale": 0.0})
  return dict(
      architectures=["GPT2LMHeadModel"], model_type="gpt2", vocab_size=cfg.vocab_size, n_embd=cfg.d_model,
      n_layer=cfg.num_layers, n_head=cfg.num_heads, n_inner=cfg.ff,
      activation_function=activation_back(cfg, "gpt2"),
      layer_norm_epsilon=cfg.norm_eps, n_positions=cfg.max_len, tie_word_embeddings=cfg.tie_embeddings,
      scale_attn_weights=cfg.attention_scale == 0.0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
      initializer_range=cfg.init_std,
      # GPT2Config's default bos/eos (50256) lie outside a smaller vocabulary: none then.
      **({} if cfg.vocab_size > 50256 else {"bos_token_id": None, "eos_token_id": None}))


def _llama_like(hf: dict, default_theta: float, window: bool) -> dict:
  d, h = get_int(hf, "hidden_size"), get_int(hf, "num_attention_heads", minimum=1)
  bias = get_bool(hf, "attention_bias", default=False)
  out = dict(
      _common(hf), d_model=d, num_layers=get_int(hf, "num_hidden_layers"), num_heads=h,
      num_kv_heads=get_int(hf, "num_key_value_heads", default=h),
      head_dim=get_int(hf, "head_dim", default=d // h),
      d_ff=get_int(hf, "intermediate_size"), activation=activation(hf, "hidden_act", "silu", glu=True),
      norm="rmsnorm", norm_eps=get_float(hf, "rms_norm_eps", default=1e-6), norm_bias=False,
      position="rope", rope_layout="half", max_len=get_int(hf, "max_position_embeddings", default=2048),
      tie_embeddings=get_bool(hf, "tie_word_embeddings", default=False),
      qkv_bias=bias, out_bias=bias,
      mlp_bias=get_bool(hf, "mlp_bias", default=False),
      **rope_from_hf(hf, default_theta=default_theta))
  if window:
    w = get_int(hf, "sliding_window", default=0)
    out["window"] = 0 if w >= out["max_len"] else w   # a window as long as the context is none
  elif hf.get("sliding_window"):
    raise HFConfigError(f"{hf.get('model_type')}: unsupported sliding_window={hf['sliding_window']}")
  return out


def _llama_like_back(cfg: ModelConfig, family: str, arch: str, window: bool) -> dict:
  if cfg.qkv_bias != cfg.out_bias and family == "llama":
    raise HFConfigError(f"llama cannot represent model.qkv_bias={cfg.qkv_bias} with model.out_bias={cfg.out_bias} "
                        "(one attention_bias covers both)", "out_bias", {"out_bias": cfg.qkv_bias})
  out = dict(
      architectures=[arch], model_type=family, vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
      intermediate_size=cfg.ff, num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
      num_key_value_heads=cfg.kv_heads, head_dim=cfg.hd, hidden_act=activation_back(cfg, family, glu=True),
      rms_norm_eps=cfg.norm_eps, max_position_embeddings=cfg.max_len, rope_parameters=rope_to_hf(cfg, family),
      tie_word_embeddings=cfg.tie_embeddings, attention_dropout=0.0, initializer_range=cfg.init_std)
  if family == "llama":
    out.update(attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias)
  if window:
    out["sliding_window"] = cfg.window or None
  return out


def llama_to_model(hf: dict) -> dict:
  return _llama_like(hf, 10000.0, window=False)


def llama_to_hf(cfg: ModelConfig) -> dict:
  return _llama_like_back(cfg, "llama", "LlamaForCausalLM", window=False)


def mistral_to_model(hf: dict) -> dict:
  return _llama_like(hf, 10000.0, window=True)


def mistral_to_hf(cfg: ModelConfig) -> dict:
  return _llama_like_back(cfg, "mistral", "MistralForCausalLM", window=True)


def mixtral_to_model(hf: dict) -> dict:
  out = _llama_like(hf, 1e6, window=True)
  out["moe"] = dict(num_experts=get_int(hf, "num_local_experts"), top_k=get_int(hf, "num_experts_per_tok"),
                    every=1, d_ff=out["d_ff"], renormalize=True, dispatch="dropless",
                    jitter=get_float(hf, "router_jitter_noise", default=0.0),
                    aux_loss_coef=get_float(hf, "router_aux_loss_coef", default=0.001), z_loss_coef=0.0)
  return out


def mixtral_to_hf(cfg: ModelConfig) -> dict:
  # Every Mixtral layer is MoE: intermediate_size is the experts' hidden size (a dense d_ff is unused;
  # a model with dense layers too comes back with moe.every=1 and is refused by the comparison).
  m = cfg.moe
  out = _llama_like_back(cfg, "mixtral", "MixtralForCausalLM", window=True)
  out.update(intermediate_size=m.d_ff or cfg.ff, num_local_experts=m.num_experts, num_experts_per_tok=m.top_k,
             router_jitter_noise=m.jitter, router_aux_loss_coef=m.aux_loss_coef, output_router_logits=False)
  return out


def bloom_to_model(hf: dict) -> dict:
  require(hf, "apply_residual_connection_post_layernorm", (False,), False)
  d = get_int(hf, "hidden_size", "n_embed")
  return dict(
      _common(hf), d_model=d, num_layers=get_int(hf, "n_layer", "num_hidden_layers"),
      num_heads=get_int(hf, "n_head", "num_attention_heads"), d_ff=4 * d, activation="gelu_tanh",
      norm="layernorm", norm_eps=get_float(hf, "layer_norm_epsilon", default=1e-5), position="alibi",
      embed_norm=True, max_len=get_int(hf, "seq_length", default=2048),
      tie_embeddings=get_bool(hf, "tie_word_embeddings", default=True), qkv_bias=True, out_bias=True,
      mlp_bias=True)


def bloom_to_hf(cfg: ModelConfig) -> dict:
  return dict(
      architectures=["BloomForCausalLM"], model_type="bloom", vocab_size=cfg.vocab_size,
      hidden_size=cfg.d_model,
      n_layer=cfg.num_layers, n_head=cfg.num_heads, layer_norm_epsilon=cfg.norm_eps, seq_length=cfg.max_len,
      tie_word_embeddings=cfg.tie_embeddings, apply_residual_connection_post_layernorm=False,
      hidden_dropout=0.0, attention_dropout=0.0, initializer_range=cfg.init_std)


def gpt_neox_to_model(hf: dict) -> dict:
  bias = get_bool(hf, "attention_bias", default=True)
  return dict(
      _common(hf), d_model=get_int(hf, "hidden_size"), num_layers=get_int(hf, "num_hidden_layers"),
      num_heads=get_int(hf, "num_attention_heads"), d_ff=get_int(hf, "intermediate_size"),
      activation=activation(hf, "hidden_act", "gelu"), norm="layernorm",
      norm_eps=get_float(hf, "layer_norm_eps", default=1e-5), position="rope", rope_layout="half",
      max_len=get_int(hf, "max_position_embeddings", default=2048),
      parallel_residual=get_bool(hf, "use_parallel_residual", default=True),
      tie_embeddings=get_bool(hf, "tie_word_embeddings", default=False),
      qkv_bias=bias, out_bias=bias,
      mlp_bias=True, **rope_from_hf(hf, default_theta=10000.0, default_fraction=0.25, allow_partial=True))


def gpt_neox_to_hf(cfg: ModelConfig) -> dict:
  if cfg.qkv_bias != cfg.out_bias:
    raise HFConfigError(f"gpt_neox cannot represent model.qkv_bias={cfg.qkv_bias} with model.out_bias={cfg.out_bias} "
                        "(one attention_bias covers both)", "out_bias", {"out_bias": cfg.qkv_bias})
  return dict(
      architectures=["GPTNeoXForCausalLM"], model_type="gpt_neox", vocab_size=cfg.vocab_size,
      hidden_size=cfg.d_model, num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
      intermediate_size=cfg.ff, hidden_act=activation_back(cfg, "gpt_neox"), layer_norm_eps=cfg.norm_eps,
      max_position_embeddings=cfg.max_len, use_parallel_residual=cfg.parallel_residual,
      tie_word_embeddings=cfg.tie_embeddings, attention_bias=cfg.qkv_bias,
      rope_parameters=rope_to_hf(cfg, "gpt_neox", partial=True), attention_dropout=0.0, hidden_dropout=0.0,
      initializer_range=cfg.init_std)


def bert_to_model(hf: dict) -> dict:
  require(hf, "position_embedding_type", ("absolute",), "absolute")
  require(hf, "is_decoder", (False,), False)
  require(hf, "add_cross_attention", (False,), False)
  return dict(
      _common(hf), d_model=get_int(hf, "hidden_size"), num_layers=get_int(hf, "num_hidden_layers"),
      num_heads=get_int(hf, "num_attention_heads"), d_ff=get_int(hf, "intermediate_size"),
      activation=activation(hf, "hidden_act", "gelu"), norm="layernorm",
      norm_eps=get_float(hf, "layer_norm_eps", default=1e-12), norm_position="post", final_norm=False,
      embed_norm=True, position="learned", max_len=get_int(hf, "max_position_embeddings", default=512),
      causal=False, type_vocab_size=get_int(hf, "type_vocab_size", default=2), lm_head=False,
      qkv_bias=True, out_bias=True, mlp_bias=True)


def bert_to_hf(cfg: ModelConfig) -> dict:
  return dict(
      architectures=["BertModel"], model_type="bert", vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
      num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, intermediate_size=cfg.ff,
      hidden_act=activation_back(cfg, "bert"), layer_norm_eps=cfg.norm_eps,
      max_position_embeddings=cfg.max_len, type_vocab_size=cfg.type_vocab_size, hidden_dropout_prob=0.0,
      attention_probs_dropout_prob=0.0, initializer_range=cfg.init_std, pad_token_id=0)


# ---------------------------------------------------------------------------------------------
# Per-layer attention types (layer_types), and the families built on them: qwen2, qwen3, gemma2,
# gemma3_text, olmo2

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


def _one_attention_bias(cfg: ModelConfig, family: str) -> None:
  if cfg.qkv_bias != cfg.out_bias:
    raise HFConfigError(f"{family} cannot represent model.qkv_bias={cfg.qkv_bias} with model.out_bias={cfg.out_bias} "
                        "(one attention_bias covers both)", "out_bias", {"out_bias": cfg.qkv_bias})


def _global_rope_only(cfg: ModelConfig, family: str) -> None:
  """Families whose sliding layers share the global RoPE (one rope_parameters for every layer)."""
  if cfg.layer_pattern and cfg.local_rope_theta not in (0.0, cfg.rope_theta):
    raise HFConfigError(f"{family} cannot represent model.local_rope_theta={cfg.local_rope_theta} (every layer "
                        "uses the global RoPE)", "local_rope_theta", {"local_rope_theta": 0.0})


def _decoder(hf: dict, default_theta: float, *, bias: bool | None = None) -> dict:
  """The Llama-shaped part of a decoder config (sizes, RMSNorm, RoPE, GLU, tied or not), with
  `attention_bias` on all four projections unless `bias` fixes it."""
  out = _llama_like({**hf, "sliding_window": None}, default_theta, window=False)   # windows: per family
  b = get_bool(hf, "attention_bias", default=False) if bias is None else bias
  out.update(qkv_bias=b, out_bias=b, mlp_bias=False)
  return out


def _qwen_windows(hf: dict, out: dict) -> dict:
  """Qwen2/Qwen3: sliding_window applies only with use_sliding_window, to the layers of layer_types
  (older config.json: every layer from max_window_layers on)."""
  n = out["num_layers"]
  window = get_int(hf, "sliding_window", default=0) if get_bool(hf, "use_sliding_window", default=False) else 0
  start = get_int(hf, "max_window_layers", default=n)
  kinds = layer_kinds(hf, n, lambda i: "L" if window and i >= start else "G")
  return layer_attention(kinds, window, out["max_len"], 0.0, out)


def _qwen_windows_back(cfg: ModelConfig) -> dict:
  types = layer_types_back(cfg)
  first_local = next((i for i, t in enumerate(types) if t == "sliding_attention"), cfg.num_layers)
  split = all(t == "sliding_attention" for t in types[first_local:])   # the older max_window_layers form
  return dict(use_sliding_window=bool(cfg.window), sliding_window=cfg.window or None, layer_types=types,
              max_window_layers=first_local if split else cfg.num_layers)


def qwen2_to_model(hf: dict) -> dict:
  out = _decoder(hf, 10000.0, bias=False)
  out.update(qkv_bias=True, **_qwen_windows(hf, out))            # q/k/v biases always; none on o_proj
  return out


def qwen2_to_hf(cfg: ModelConfig) -> dict:
  _global_rope_only(cfg, "qwen2")
  out = _llama_like_back(cfg, "qwen2", "Qwen2ForCausalLM", window=False)
  out.update(_qwen_windows_back(cfg))
  return out


def qwen3_to_model(hf: dict) -> dict:
  out = _decoder(hf, 10000.0)
  out.update(qk_norm="head", **_qwen_windows(hf, out))
  return out


def qwen3_to_hf(cfg: ModelConfig) -> dict:
  _one_attention_bias(cfg, "qwen3")
  _global_rope_only(cfg, "qwen3")
  out = _llama_like_back(cfg, "qwen3", "Qwen3ForCausalLM", window=False)
  out.update(attention_bias=cfg.qkv_bias, **_qwen_windows_back(cfg))
  return out


def olmo2_to_model(hf: dict) -> dict:
  out = _decoder(hf, 10000.0)
  out.update(qk_norm="proj", norm_position="reordered")
  return out


def olmo2_to_hf(cfg: ModelConfig) -> dict:
  _one_attention_bias(cfg, "olmo2")
  out = _llama_like_back(cfg, "olmo2", "Olmo2ForCausalLM", window=False)
  out.update(attention_bias=cfg.qkv_bias)
  return out


def _gemma_rope(hf: dict, out_theta: float) -> tuple[dict, float]:
  """(the global RoPE kwargs, the sliding layers' base) of Gemma 3: transformers 5's per-layer-type
  rope_parameters, or the older rope_theta + rope_scaling (global) and rope_local_base_freq."""
  rp = hf.get("rope_parameters")
  if isinstance(rp, dict) and any(isinstance(v, dict) for v in rp.values()):
    unknown = sorted(set(rp) - set(LAYER_TYPES))
    if unknown:
      raise HFConfigError(f"{hf.get('model_type')}: rope_parameters for unknown layer types {unknown}")
    full, local = rp.get("full_attention") or {}, rp.get("sliding_attention") or {}
    if not isinstance(full, dict) or not isinstance(local, dict):
      raise HFConfigError(f"{hf.get('model_type')}: rope_parameters per layer type are not objects")
    glob = rope_from_hf({**hf, "rope_parameters": full, "rope_scaling": None, "rope_theta": None},
                        default_theta=out_theta)
  else:
    local = {"rope_theta": hf.get("rope_local_base_freq", 10000.0)}
    glob = rope_from_hf(hf, default_theta=out_theta)
  kind = get(local, "rope_type", "type", default="default")
  if kind != "default":
    raise HFConfigError(f"{hf.get('model_type')}: unsupported rope_type {kind!r} for the sliding layers "
                        "(their RoPE is unscaled)")
  return glob, get_float(local, "rope_theta", default=10000.0)


def _gemma(hf: dict, default_theta: float, *, qk_norm: str, local_rope: bool) -> dict:
  family = hf.get("model_type")
  if get_bool(hf, "use_bidirectional_attention", default=False):
    raise HFConfigError(f"{family}: unsupported use_bidirectional_attention=True (an embedding model)")
  d, h = get_int(hf, "hidden_size"), get_int(hf, "num_attention_heads", minimum=1)
  hd = get_int(hf, "head_dim", default=d // h)
  act = get(hf, "hidden_activation", "hidden_act", default="gelu_pytorch_tanh")
  if act not in GLU_ACTS:
    raise HFConfigError(f"{family}: unsupported hidden_activation={act!r} (supported: {sorted(GLU_ACTS)})")
  if local_rope:
    rope, local_theta = _gemma_rope(hf, default_theta)
  else:
    rope, local_theta = rope_from_hf(hf, default_theta=default_theta), 0.0
  bias = get_bool(hf, "attention_bias", default=False)
  scalar = get_float(hf, "query_pre_attn_scalar", default=float(hd))
  if scalar <= 0:
    raise HFConfigError(f"{family}: query_pre_attn_scalar={scalar} is not positive")
  out = dict(
      _common(hf), d_model=d, num_layers=get_int(hf, "num_hidden_layers"), num_heads=h,
      num_kv_heads=get_int(hf, "num_key_value_heads", default=h), head_dim=hd,
      d_ff=get_int(hf, "intermediate_size"), activation=GLU_ACTS[act], norm="rmsnorm",
      norm_eps=get_float(hf, "rms_norm_eps", default=1e-6), norm_bias=False, norm_position="sandwich",
      norm_unit_offset=True, embed_scale=True, position="rope", rope_layout="half",
      max_len=get_int(hf, "max_position_embeddings", default=8192),
      tie_embeddings=get_bool(hf, "tie_word_embeddings", default=True), qkv_bias=bias, out_bias=bias,
      mlp_bias=False, qk_norm=qk_norm, attention_scale=0.0 if scalar == hd else scalar ** -0.5,
      attn_softcap=get_float(hf, "attn_logit_softcapping", default=0.0),
      final_logit_softcap=get_float(hf, "final_logit_softcapping", default=0.0), **rope)
  for cap in ("attn_softcap", "final_logit_softcap"):
    if out[cap] < 0:
      raise HFConfigError(f"{family}: a negative soft cap ({cap}={out[cap]})")
  n = out["num_layers"]
  # Without layer_types: Gemma 3 slides except on every sliding_window_pattern-th layer, Gemma 2 alternates.
  every = get_int(hf, "sliding_window_pattern", "_sliding_window_pattern", default=6, minimum=1) if local_rope else 2
  kinds = layer_kinds(hf, n, lambda i: "L" if (i + 1) % every else "G")
  out.update(layer_attention(kinds, get_int(hf, "sliding_window", default=0), out["max_len"], local_theta, out))
  return out


def _gemma_back(cfg: ModelConfig, family: str, arch: str, *, local_rope: bool) -> dict:
  _one_attention_bias(cfg, family)
  if cfg.activation not in GLU_ACTS_BACK:
    raise HFConfigError(f"{family} cannot represent model.activation={cfg.activation!r} "
                        f"(supported: {sorted(GLU_ACTS_BACK)})", "activation", {"activation": "geglu_tanh"})
  scale = cfg.attention_scale
  scalar: float = cfg.hd if not scale else scale ** -2
  if abs(scalar - round(scalar)) < 1e-6 * scalar:
    scalar = round(scalar)
  rope = rope_to_hf(cfg, family)
  if local_rope:
    local = cfg.local_rope_theta or cfg.rope_theta
    if not cfg.local_rope_theta and cfg.layer_pattern and cfg.rope_scaling.type != "none":
      raise HFConfigError(f"{family} cannot represent model.local_rope_theta=0 with model.rope_scaling (its "
                          "sliding layers' RoPE is unscaled)", "local_rope_theta",
                          {"local_rope_theta": cfg.rope_theta})
    rope = {"full_attention": rope, "sliding_attention": {"rope_type": "default", "rope_theta": local}}
  else:
    _global_rope_only(cfg, family)
  return dict(
      architectures=[arch], model_type=family, vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
      intermediate_size=cfg.ff, num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
      num_key_value_heads=cfg.kv_heads, head_dim=cfg.hd, hidden_activation=GLU_ACTS_BACK[cfg.activation],
      rms_norm_eps=cfg.norm_eps, max_position_embeddings=cfg.max_len, rope_parameters=rope,
      tie_word_embeddings=cfg.tie_embeddings, attention_bias=cfg.qkv_bias, attention_dropout=0.0,
      query_pre_attn_scalar=scalar, attn_logit_softcapping=cfg.attn_softcap or None,
      final_logit_softcapping=cfg.final_logit_softcap or None, sliding_window=cfg.window or None,
      layer_types=layer_types_back(cfg), initializer_range=cfg.init_std)


def gemma2_to_model(hf: dict) -> dict:
  return _gemma(hf, 10000.0, qk_norm="none", local_rope=False)


def gemma2_to_hf(cfg: ModelConfig) -> dict:
  return _gemma_back(cfg, "gemma2", "Gemma2ForCausalLM", local_rope=False)


def gemma3_text_to_model(hf: dict) -> dict:
  return _gemma(hf, 1e6, qk_norm="head", local_rope=True)


def gemma3_text_to_hf(cfg: ModelConfig) -> dict:
  return _gemma_back(cfg, "gemma3_text", "Gemma3ForCausalLM", local_rope=True)


# ---------------------------------------------------------------------------------------------
# Mixture-of-experts families: qwen3_moe, gpt_oss, deepseek_v3

def _moe_common(hf: dict, experts: str, d_ff: str) -> dict:
  """The MoEConfig kwargs every MoE family shares: sizes, top-k, the auxiliary loss coefficient
  (transformers' router_aux_loss_coef; no z-loss, no jitter), dropless dispatch."""
  return dict(num_experts=get_int(hf, experts, "num_local_experts", "num_experts"),
              top_k=get_int(hf, "num_experts_per_tok", minimum=1), d_ff=get_int(hf, d_ff), dispatch="dropless",
              aux_loss_coef=get_float(hf, "router_aux_loss_coef", default=0.001), z_loss_coef=0.0, jitter=0.0)


def _first_dense(hf: dict, n: int, listed: str) -> int:
  """k of a config.json's list of dense layers that must be the first k (our moe.first_k_dense)."""
  layers = hf.get(listed) or []
  k = len(layers)
  if not isinstance(layers, list) or sorted(layers) != list(range(k)) or k > n:
    raise HFConfigError(f"{hf.get('model_type')}: unsupported {listed}={layers!r} (only the first k layers "
                        "can be dense: model.moe.first_k_dense)")
  return k


def _one_window(hf: dict, out: dict) -> dict:
  """Mistral-style: one sliding window on every layer (Qwen3-MoE: only with use_sliding_window)."""
  if not get_bool(hf, "use_sliding_window", default=False):
    return dict(window=0)
  w = get_int(hf, "sliding_window", default=0)
  return dict(window=0 if w >= out["max_len"] else w)


def qwen3_moe_to_model(hf: dict) -> dict:
  out = _decoder(hf, 10000.0)
  out.update(qk_norm="head", **_one_window(hf, out))
  n = out["num_layers"]
  if get_int(hf, "num_experts", "num_local_experts", default=0):
    out["moe"] = dict(_moe_common(hf, "num_experts", "moe_intermediate_size"), router="softmax",
                      renormalize=get_bool(hf, "norm_topk_prob", default=False),
                      every=get_int(hf, "decoder_sparse_step", default=1, minimum=1),
                      first_k_dense=_first_dense(hf, n, "mlp_only_layers"))
  return out


def qwen3_moe_to_hf(cfg: ModelConfig) -> dict:
  _one_attention_bias(cfg, "qwen3_moe")
  if cfg.layer_pattern:
    raise HFConfigError(f"qwen3_moe cannot represent model.layer_pattern={cfg.layer_pattern!r} (one window on "
                        "every layer)", "layer_pattern", {"layer_pattern": ""})
  m = cfg.moe
  out = _llama_like_back(cfg, "qwen3_moe", "Qwen3MoeForCausalLM", window=False)
  out.update(attention_bias=cfg.qkv_bias, use_sliding_window=bool(cfg.window), sliding_window=cfg.window or None,
             num_experts=m.num_experts, num_experts_per_tok=m.top_k, moe_intermediate_size=m.d_ff or cfg.ff,
             norm_topk_prob=m.renormalize, decoder_sparse_step=m.every,
             mlp_only_layers=list(range(m.first_k_dense)), router_aux_loss_coef=m.aux_loss_coef,
             output_router_logits=False)
  return out


def gpt_oss_to_model(hf: dict) -> dict:
  out = _decoder(hf, 150000.0, bias=get_bool(hf, "attention_bias", default=True))
  kinds = layer_kinds(hf, out["num_layers"], lambda i: "L" if (i + 1) % 2 else "G")
  out.update(attention_sinks=True, **layer_attention(kinds, get_int(hf, "sliding_window", default=0),
                                                     out["max_len"], 0.0, out))
  out["moe"] = dict(_moe_common(hf, "num_local_experts", "intermediate_size"), router="softmax_topk",
                    renormalize=True, every=1, expert_bias=True,
                    swiglu_limit=get_float(hf, "swiglu_limit", default=7.0),
                    swiglu_alpha=get_float(hf, "swiglu_alpha", default=1.702))
  if out["activation"] != "swiglu" or out["moe"]["swiglu_limit"] <= 0:
    raise HFConfigError(f"gpt_oss: unsupported hidden_act={hf.get('hidden_act')!r} with "
                        f"swiglu_limit={hf.get('swiglu_limit')!r} (its experts are a clamped SwiGLU)")
  return out


def gpt_oss_to_hf(cfg: ModelConfig) -> dict:
  _one_attention_bias(cfg, "gpt_oss")
  _global_rope_only(cfg, "gpt_oss")
  m = cfg.moe
  out = _llama_like_back(cfg, "gpt_oss", "GptOssForCausalLM", window=False)
  out.update(attention_bias=cfg.qkv_bias, sliding_window=cfg.window or None, layer_types=layer_types_back(cfg),
             intermediate_size=m.d_ff or cfg.ff, num_local_experts=m.num_experts, num_experts_per_tok=m.top_k,
             swiglu_limit=m.swiglu_limit, swiglu_alpha=m.swiglu_alpha, router_aux_loss_coef=m.aux_loss_coef,
             output_router_logits=False)
  return out


def deepseek_v3_to_model(hf: dict) -> dict:
  d, h = get_int(hf, "hidden_size"), get_int(hf, "num_attention_heads", minimum=1)
  rope = rope_from_hf(hf, default_theta=10000.0)
  rp = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
  scaled = rope.get("rope_scaling", {}).get("type", "none") != "none"
  bias = get_bool(hf, "attention_bias", default=False)
  n_group = get_int(hf, "n_group", default=1)
  out = dict(
      _common(hf), d_model=d, num_layers=get_int(hf, "num_hidden_layers"), num_heads=h,
      d_ff=get_int(hf, "intermediate_size"), activation=activation(hf, "hidden_act", "silu", glu=True),
      norm="rmsnorm", norm_eps=get_float(hf, "rms_norm_eps", default=1e-6), norm_bias=False, position="rope",
      rope_layout="interleaved" if get_bool(hf, "rope_interleave", default=True) else "half",
      max_len=get_int(hf, "max_position_embeddings", default=4096),
      tie_embeddings=get_bool(hf, "tie_word_embeddings", default=False), qkv_bias=bias, out_bias=bias,
      mlp_bias=False, **rope,
      mla=dict(kv_lora_rank=get_int(hf, "kv_lora_rank", minimum=1), q_lora_rank=get_int(hf, "q_lora_rank", default=0),
               qk_nope_head_dim=get_int(hf, "qk_nope_head_dim"), qk_rope_head_dim=get_int(hf, "qk_rope_head_dim"),
               v_head_dim=get_int(hf, "v_head_dim"),
               mscale_all_dim=get_float(rp, "mscale_all_dim", default=0.0) if scaled else 0.0))
  out["moe"] = dict(
      _moe_common(hf, "n_routed_experts", "moe_intermediate_size"), router="sigmoid",
      renormalize=get_bool(hf, "norm_topk_prob", default=True), every=1,
      n_group=0 if n_group == 1 else n_group, topk_group=0 if n_group == 1 else get_int(hf, "topk_group", default=1),
      routed_scaling_factor=get_float(hf, "routed_scaling_factor", default=1.0),
      num_shared_experts=get_int(hf, "n_shared_experts", default=0),
      first_k_dense=min(get_int(hf, "first_k_dense_replace", default=0), get_int(hf, "num_hidden_layers")))
  return out


def deepseek_v3_to_hf(cfg: ModelConfig) -> dict:
  if not cfg.use_mla:
    raise HFConfigError("deepseek_v3 cannot represent a model without MLA (model.mla.kv_lora_rank=0)", "mla")
  m, a = cfg.moe, cfg.mla
  if m.shared_d_ff and m.shared_d_ff != (m.d_ff or cfg.ff):
    raise HFConfigError(f"deepseek_v3 cannot represent model.moe.shared_d_ff={m.shared_d_ff} (its shared experts "
                        "are as wide as the routed ones)", "moe.shared_d_ff")
  rope = rope_to_hf(cfg, "deepseek_v3")
  if a.mscale_all_dim:
    rope["mscale_all_dim"] = a.mscale_all_dim
  groups = m.n_group if m.n_group > 1 else 1
  return dict(
      architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=cfg.vocab_size,
      hidden_size=cfg.d_model, intermediate_size=cfg.ff, moe_intermediate_size=m.d_ff or cfg.ff,
      num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_heads,
      n_shared_experts=m.shared_count, n_routed_experts=m.num_experts, num_experts_per_tok=m.top_k,
      routed_scaling_factor=m.routed_scaling_factor, n_group=groups, topk_group=m.topk_group if groups > 1 else 1,
      first_k_dense_replace=m.first_k_dense, norm_topk_prob=m.renormalize, kv_lora_rank=a.kv_lora_rank,
      q_lora_rank=a.q_lora_rank or None, qk_rope_head_dim=a.qk_rope_head_dim, qk_nope_head_dim=a.qk_nope_head_dim,
      v_head_dim=a.v_head_dim, hidden_act=activation_back(cfg, "deepseek_v3", glu=True), rms_norm_eps=cfg.norm_eps,
      max_position_embeddings=cfg.max_len, tie_word_embeddings=cfg.tie_embeddings, rope_parameters=rope,
      rope_interleave=cfg.rope_layout == "interleaved", attention_bias=cfg.qkv_bias, attention_dropout=0.0,
      router_aux_loss_coef=m.aux_loss_coef, num_nextn_predict_layers=cfg.mtp_depth, initializer_range=cfg.init_std)
