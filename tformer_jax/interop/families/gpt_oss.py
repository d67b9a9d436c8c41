"""GPT-OSS: attention sinks and biases, alternating sliding layers, a biased softmax-top-k router, and
experts whose clamped SwiGLU is fused on disk (gate and up interleaved)."""
from __future__ import annotations

from tformer_jax.config import ModelConfig
from tformer_jax.interop.families.fields import (
  HFConfigError,
  get_bool,
  get_float,
  get_int,
  global_rope_only,
  layer_attention,
  layer_kinds,
  layer_types_back,
  moe_common,
  one_attention_bias,
)
from tformer_jax.interop.families.llama import LLAMA_ATTN, LLAMA_OUTER, E, decoder_config, llama_like_back
from tformer_jax.interop.families.table import L, Rule, decoder

_M = "model.layers.{i}"
# GPT-OSS: attention biases and sinks; a router with a bias; the experts fused on disk too, gate and up
# interleaved along the last axis (gate = [..., ::2], up = [..., 1::2]), with biases.
GPT_OSS_ROWS = LLAMA_OUTER + LLAMA_ATTN + (
    Rule(f"{_M}.self_attn.sinks", f"{L}/attn/sinks", "h", "h"),
    Rule(f"{_M}.mlp.router.weight", f"{E}/router", "e d", "d e"),
    Rule(f"{_M}.mlp.router.bias", f"{E}/router_bias", "e", "e"),
    Rule(f"{_M}.mlp.experts.gate_up_proj", (f"{E}/w_gate", f"{E}/w_up"), "e d (x 2)", "e d x"),
    Rule(f"{_M}.mlp.experts.gate_up_proj_bias", (f"{E}/b_gate", f"{E}/b_up"), "e (x 2)", "e x"),
    Rule(f"{_M}.mlp.experts.down_proj", f"{E}/w_down", "e x d", "e x d"),
    Rule(f"{_M}.mlp.experts.down_proj_bias", f"{E}/b_down", "e d", "e d"),
)


def gpt_oss_to_model(hf: dict) -> dict:
  out = decoder_config(hf, 150000.0, bias=get_bool(hf, "attention_bias", default=True))
  kinds = layer_kinds(hf, out["num_layers"], lambda i: "L" if (i + 1) % 2 else "G")
  out.update(attention_sinks=True, **layer_attention(kinds, get_int(hf, "sliding_window", default=0),
                                                     out["max_len"], 0.0, out))
  out["moe"] = dict(moe_common(hf, "num_local_experts", "intermediate_size"), router="softmax_topk",
                    renormalize=True, every=1, expert_bias=True,
                    swiglu_limit=get_float(hf, "swiglu_limit", default=7.0),
                    swiglu_alpha=get_float(hf, "swiglu_alpha", default=1.702))
  if out["activation"] != "swiglu" or out["moe"]["swiglu_limit"] <= 0:
    raise HFConfigError(f"gpt_oss: unsupported hidden_act={hf.get('hidden_act')!r} with "
                        f"swiglu_limit={hf.get('swiglu_limit')!r} (its experts are a clamped SwiGLU)")
  return out


def gpt_oss_to_hf(cfg: ModelConfig) -> dict:
  one_attention_bias(cfg, "gpt_oss")
  global_rope_only(cfg, "gpt_oss")
  m = cfg.moe
  out = llama_like_back(cfg, "gpt_oss", "GptOssForCausalLM", window=False)
  out.update(attention_bias=cfg.qkv_bias, sliding_window=cfg.window or None, layer_types=layer_types_back(cfg),
             intermediate_size=m.d_ff or cfg.ff, num_local_experts=m.num_experts, num_experts_per_tok=m.top_k,
             swiglu_limit=m.swiglu_limit, swiglu_alpha=m.swiglu_alpha, router_aux_loss_coef=m.aux_loss_coef,
             output_router_logits=False)
  return out


GPT_OSS = decoder("gpt_oss", GPT_OSS_ROWS, gpt_oss_to_model, gpt_oss_to_hf)
