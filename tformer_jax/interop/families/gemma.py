"""Gemma 2 and Gemma 3 (text): the sandwich of norms, (1 + w) RMSNorm, scaled embeddings, soft caps, sliding
layers in a pattern (Gemma 3: with their own RoPE base), per-head QK-norm (Gemma 3)."""
from __future__ import annotations

from tformer_jax.config import ModelConfig
from tformer_jax.interop.families.fields import (
  GLU_ACTS,
  GLU_ACTS_BACK,
  LAYER_TYPES,
  HFConfigError,
  common,
  get,
  get_bool,
  get_float,
  get_int,
  global_rope_only,
  layer_attention,
  layer_kinds,
  layer_types_back,
  one_attention_bias,
  rope_from_hf,
  rope_to_hf,
)
from tformer_jax.interop.families.llama import GLU_MLP, HEAD_QK_NORM, LLAMA_OUTER, LLAMA_PROJ
from tformer_jax.interop.families.table import L, decoder, norm

_M = "model.layers.{i}"
# Gemma's sandwich: a norm before and after each sublayer; its RMSNorm is (1 + w) and w is stored as is.
GEMMA2_ROWS = LLAMA_OUTER + LLAMA_PROJ + GLU_MLP + (
    *norm(f"{_M}.input_layernorm", f"{L}/ln1", bias=False),
    *norm(f"{_M}.post_attention_layernorm", f"{L}/post_attn_norm", bias=False),
    *norm(f"{_M}.pre_feedforward_layernorm", f"{L}/ln2", bias=False),
    *norm(f"{_M}.post_feedforward_layernorm", f"{L}/post_ffn_norm", bias=False),
)
GEMMA3_ROWS = GEMMA2_ROWS + HEAD_QK_NORM


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
      common(hf), d_model=d, num_layers=get_int(hf, "num_hidden_layers"), num_heads=h,
      num_kv_heads=get_int(hf, "num_key_value_heads", default=h), head_dim=hd,
      d_ff=get_int(hf, "intermediate_size"), activation=GLU_ACTS[act], norm="rmsnorm",
      norm_eps=get_float(hf, "rms_norm_eps", default=1e-6), norm_bias=False, norm_position="sandwich",
      norm_unit_offset=True, embed_scale=True, position="rope", rope_layout="half",
      max_len=get_int(hf, "max_position_embeddings", default=8192),
      tie_embeddings=get_bool(hf, "tie_word_embeddings", default=True), qkv_bias=bias, out_bias=bias,
      mlp_bias=False, qk_norm=qk_norm, attention_scale=0.0 if scalar == hd else scalar ** -0.5,
      # Gemma 3 replaced the attention cap by QK-norm: transformers' Gemma3Attention stores
      # attn_logit_softcapping and never applies it, so neither do we.
      attn_softcap=0.0 if local_rope else get_float(hf, "attn_logit_softcapping", default=0.0),
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
  one_attention_bias(cfg, family)
  if cfg.activation not in GLU_ACTS_BACK:
    raise HFConfigError(f"{family} cannot represent model.activation={cfg.activation!r} "
                        f"(supported: {sorted(GLU_ACTS_BACK)})", "activation", {"activation": "geglu_tanh"})
  scale = cfg.attention_scale
  scalar: float = cfg.hd if not scale else scale ** -2
  if abs(scalar - round(scalar)) < 1e-6 * scalar:
    scalar = round(scalar)
  rope = rope_to_hf(cfg, family)
  if local_rope and cfg.attn_softcap:
    raise HFConfigError(f"{family} cannot represent model.attn_softcap={cfg.attn_softcap} (transformers' Gemma 3 "
                        "ignores attn_logit_softcapping)", "attn_softcap", {"attn_softcap": 0.0})
  if local_rope:
    local = cfg.local_rope_theta or cfg.rope_theta
    if not cfg.local_rope_theta and cfg.layer_pattern and cfg.rope_scaling.type != "none":
      raise HFConfigError(f"{family} cannot represent model.local_rope_theta=0 with model.rope_scaling (its "
                          "sliding layers' RoPE is unscaled)", "local_rope_theta",
                          {"local_rope_theta": cfg.rope_theta})
    rope = {"full_attention": rope, "sliding_attention": {"rope_type": "default", "rope_theta": local}}
  else:
    global_rope_only(cfg, family)
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

GEMMA2 = decoder("gemma2", GEMMA2_ROWS, gemma2_to_model, gemma2_to_hf)
GEMMA3_TEXT = decoder("gemma3_text", GEMMA3_ROWS, gemma3_text_to_model, gemma3_text_to_hf)
