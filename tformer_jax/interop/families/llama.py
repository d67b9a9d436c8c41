"""Llama, Mistral and Mixtral, and the Llama layout most decoders share: the tensor rows (attention, GLU MLP,
embeddings and head, per-head QK-norm, the experts in both of their layouts) and the config mapping.
"""
from __future__ import annotations

from tformer_jax.config import ModelConfig
from tformer_jax.interop.families.fields import (
  HFConfigError,
  activation,
  activation_back,
  common,
  get_bool,
  get_float,
  get_int,
  rope_from_hf,
  rope_to_hf,
)
from tformer_jax.interop.families.table import HEAD, L, OneOf, Rule, decoder, linear, norm

_M = "model.layers.{i}"
LLAMA_PROJ = (
    *linear(f"{_M}.self_attn.q_proj", f"{L}/attn/wq", "(h k) d", "d h k", "(h k)", "h k", f"{L}/attn/bq"),
    *linear(f"{_M}.self_attn.k_proj", f"{L}/attn/wk", "(g k) d", "d g k", "(g k)", "g k", f"{L}/attn/bk"),
    *linear(f"{_M}.self_attn.v_proj", f"{L}/attn/wv", "(g k) d", "d g k", "(g k)", "g k", f"{L}/attn/bv"),
    *linear(f"{_M}.self_attn.o_proj", f"{L}/attn/wo", "d (h k)", "h k d", "d", ours_bias=f"{L}/attn/bo"),
)
LLAMA_ATTN = LLAMA_PROJ + (
    *norm(f"{_M}.input_layernorm", f"{L}/ln1", bias=False),
    *norm(f"{_M}.post_attention_layernorm", f"{L}/ln2", bias=False),
)
LLAMA_OUTER = (
    Rule("model.embed_tokens.weight", "embed", "v d", "v d"),
    *norm("model.norm", "final_norm", bias=False),
    HEAD,
)
GLU_MLP = (
    *linear(f"{_M}.mlp.gate_proj", f"{L}/mlp/wg", "f d", "d f", "f", ours_bias=f"{L}/mlp/bg"),
    *linear(f"{_M}.mlp.up_proj", f"{L}/mlp/wi", "f d", "d f", "f", ours_bias=f"{L}/mlp/bi"),
    *linear(f"{_M}.mlp.down_proj", f"{L}/mlp/wo", "d f", "f d", "d", ours_bias=f"{L}/mlp/bo"),
)
LLAMA_ROWS = LLAMA_OUTER + LLAMA_ATTN + GLU_MLP
# Per-head QK-norm scales (Qwen3, Gemma 3), one per head dimension, flat on both sides.
HEAD_QK_NORM = (Rule(f"{_M}.self_attn.q_norm.weight", f"{L}/attn/q_norm/scale", "k", "k"),
                Rule(f"{_M}.self_attn.k_norm.weight", f"{L}/attn/k_norm/scale", "k", "k"))
E = f"{L}/moe"
MIXTRAL_ROWS = LLAMA_OUTER + LLAMA_ATTN + (OneOf((
    # What save_pretrained writes (and every Mixtral checkpoint on the hub): one tensor per expert.
    (Rule(f"{_M}.block_sparse_moe.gate.weight", f"{E}/router", "e d", "d e"),
     Rule(f"{_M}.block_sparse_moe.experts.{{e}}.w1.weight", f"{E}/w_gate", "x d", "e d x"),
     Rule(f"{_M}.block_sparse_moe.experts.{{e}}.w3.weight", f"{E}/w_up", "x d", "e d x"),
     Rule(f"{_M}.block_sparse_moe.experts.{{e}}.w2.weight", f"{E}/w_down", "d x", "e x d")),
    # transformers 5 modules (the in-memory state_dict): experts fused, gate rows before up rows.
    (Rule(f"{_M}.mlp.gate.weight", f"{E}/router", "e d", "d e"),
     Rule(f"{_M}.mlp.experts.gate_up_proj", (f"{E}/w_gate", f"{E}/w_up"), "e (2 x) d", "e d x"),
     Rule(f"{_M}.mlp.experts.down_proj", f"{E}/w_down", "e d x", "e x d")),
)),)

# Qwen3-MoE's (and DeepSeek-V3's) experts: one tensor per expert in the files (gate_proj/up_proj/down_proj),
# fused in transformers 5's modules (gate rows before up rows), as Mixtral's.
def glu_experts(router: tuple[Rule, ...]) -> OneOf:
  return OneOf((
      router + (Rule(f"{_M}.mlp.experts.{{e}}.gate_proj.weight", f"{E}/w_gate", "x d", "e d x"),
                Rule(f"{_M}.mlp.experts.{{e}}.up_proj.weight", f"{E}/w_up", "x d", "e d x"),
                Rule(f"{_M}.mlp.experts.{{e}}.down_proj.weight", f"{E}/w_down", "d x", "e x d")),
      router + (Rule(f"{_M}.mlp.experts.gate_up_proj", (f"{E}/w_gate", f"{E}/w_up"), "e (2 x) d", "e d x"),
                Rule(f"{_M}.mlp.experts.down_proj", f"{E}/w_down", "e d x", "e x d")),
  ))


def llama_like(hf: dict, default_theta: float, window: bool) -> dict:
  d, h = get_int(hf, "hidden_size"), get_int(hf, "num_attention_heads", minimum=1)
  bias = get_bool(hf, "attention_bias", default=False)
  out = dict(
      common(hf), d_model=d, num_layers=get_int(hf, "num_hidden_layers"), num_heads=h,
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


def llama_like_back(cfg: ModelConfig, family: str, arch: str, window: bool) -> dict:
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
  return llama_like(hf, 10000.0, window=False)


def llama_to_hf(cfg: ModelConfig) -> dict:
  return llama_like_back(cfg, "llama", "LlamaForCausalLM", window=False)


def mistral_to_model(hf: dict) -> dict:
  return llama_like(hf, 10000.0, window=True)


def mistral_to_hf(cfg: ModelConfig) -> dict:
  return llama_like_back(cfg, "mistral", "MistralForCausalLM", window=True)


def mixtral_to_model(hf: dict) -> dict:
  out = llama_like(hf, 1e6, window=True)
  out["moe"] = dict(num_experts=get_int(hf, "num_local_experts"), top_k=get_int(hf, "num_experts_per_tok"),
                    every=1, d_ff=out["d_ff"], renormalize=True, dispatch="dropless",
                    jitter=get_float(hf, "router_jitter_noise", default=0.0),
                    aux_loss_coef=get_float(hf, "router_aux_loss_coef", default=0.001), z_loss_coef=0.0)
  return out


def mixtral_to_hf(cfg: ModelConfig) -> dict:
  # Every Mixtral layer is MoE: intermediate_size is the experts' hidden size (a dense d_ff is unused;
  # a model with dense layers too comes back with moe.every=1 and is refused by the comparison).
  m = cfg.moe
  out = llama_like_back(cfg, "mixtral", "MixtralForCausalLM", window=True)
  out.update(intermediate_size=m.d_ff or cfg.ff, num_local_experts=m.num_experts, num_experts_per_tok=m.top_k,
             router_jitter_noise=m.jitter, router_aux_loss_coef=m.aux_loss_coef, output_router_logits=False)
  return out


def decoder_config(hf: dict, default_theta: float, *, bias: bool | None = None) -> dict:
  """The Llama-shaped part of a decoder config (sizes, RMSNorm, RoPE, GLU, tied or not), with
  `attention_bias` on all four projections unless `bias` fixes it."""
  out = llama_like({**hf, "sliding_window": None}, default_theta, window=False)   # windows: per family
  b = get_bool(hf, "attention_bias", default=False) if bias is None else bias
  out.update(qkv_bias=b, out_bias=b, mlp_bias=False)
  return out


LLAMA = decoder("llama", LLAMA_ROWS, llama_to_model, llama_to_hf)
MISTRAL = decoder("mistral", LLAMA_ROWS, mistral_to_model, mistral_to_hf)
MIXTRAL = decoder("mixtral", MIXTRAL_ROWS, mixtral_to_model, mixtral_to_hf)
