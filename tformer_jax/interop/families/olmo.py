"""OLMo 2: Llama's projections with QK-norm over the whole projection and each sublayer's output normalised
before its residual add."""
from __future__ import annotations

from tformer_jax.config import ModelConfig
from tformer_jax.interop.families.fields import one_attention_bias
from tformer_jax.interop.families.llama import GLU_MLP, LLAMA_OUTER, LLAMA_PROJ, decoder_config, llama_like_back
from tformer_jax.interop.families.table import L, Rule, decoder, norm

_M = "model.layers.{i}"
# QK-norm over the whole projection: H*Dh scales for q and K*Dh for k, flat on both sides.
PROJ_QK_NORM = (Rule(f"{_M}.self_attn.q_norm.weight", f"{L}/attn/q_norm/scale", "(h k)", "(h k)"),
                Rule(f"{_M}.self_attn.k_norm.weight", f"{L}/attn/k_norm/scale", "(g k)", "(g k)"))
# OLMo 2 normalises each sublayer's output before its residual add (norm_position 'reordered').
OLMO2_ROWS = LLAMA_OUTER + LLAMA_PROJ + PROJ_QK_NORM + GLU_MLP + (
    *norm(f"{_M}.post_attention_layernorm", f"{L}/post_attn_norm", bias=False),
    *norm(f"{_M}.post_feedforward_layernorm", f"{L}/post_ffn_norm", bias=False),
)


def olmo2_to_model(hf: dict) -> dict:
  out = decoder_config(hf, 10000.0)
  out.update(qk_norm="proj", norm_position="reordered")
  return out


def olmo2_to_hf(cfg: ModelConfig) -> dict:
  one_attention_bias(cfg, "olmo2")
  out = llama_like_back(cfg, "olmo2", "Olmo2ForCausalLM", window=False)
  out.update(attention_bias=cfg.qkv_bias)
  return out


OLMO2 = decoder("olmo2", OLMO2_ROWS, olmo2_to_model, olmo2_to_hf)
