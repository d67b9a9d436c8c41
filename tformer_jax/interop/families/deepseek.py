"""DeepSeek-V3: Multi-head Latent Attention, dense first layers, a sigmoid router with a correction bias and
group-limited routing, shared experts, and the multi-token prediction layers."""
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
  moe_common,
  rope_from_hf,
  rope_to_hf,
)
from tformer_jax.interop.families.llama import GLU_MLP, LLAMA_OUTER, E, glu_experts
from tformer_jax.interop.families.table import L, Rule, decoder, linear, norm

_M = "model.layers.{i}"
# DeepSeek-V3: MLA (q directly or through its normed bottleneck, the joint K/V latent with the shared RoPE
# key, kv_b's per-head key then value dims), dense first layers (Llama's mlp rows), a sigmoid router with
# its correction bias (a buffer), shared experts as one MLP of n_shared_experts x moe_intermediate_size.
_A = f"{L}/attn"
_SA = f"{_M}.self_attn"
_SH = f"{_M}.mlp.shared_experts"
DEEPSEEK_V3_ROWS = LLAMA_OUTER + GLU_MLP + (
    *norm(f"{_M}.input_layernorm", f"{L}/ln1", bias=False),
    *norm(f"{_M}.post_attention_layernorm", f"{L}/ln2", bias=False),
    Rule(f"{_SA}.q_proj.weight", f"{_A}/wq", "(h j) d", "d h j"),
    *linear(f"{_SA}.q_a_proj", f"{_A}/wq_a", "q d", "d q", "q", ours_bias=f"{_A}/bq_a"),
    Rule(f"{_SA}.q_a_layernorm.weight", f"{_A}/q_a_norm/scale", "q", "q"),
    Rule(f"{_SA}.q_b_proj.weight", f"{_A}/wq_b", "(h j) q", "q h j"),
    *linear(f"{_SA}.kv_a_proj_with_mqa", f"{_A}/wkv_a", "c d", "d c", "c", ours_bias=f"{_A}/bkv_a"),
    Rule(f"{_SA}.kv_a_layernorm.weight", f"{_A}/kv_a_norm/scale", "l", "l"),
    Rule(f"{_SA}.kv_b_proj.weight", f"{_A}/wkv_b", "(h u) l", "l h u"),
    *linear(f"{_SA}.o_proj", f"{_A}/wo", "d (h w)", "h w d", "d", ours_bias=f"{_A}/bo"),
    Rule(f"{_SH}.gate_proj.weight", f"{E}/shared_w_gate", "s d", "d s"),
    Rule(f"{_SH}.up_proj.weight", f"{E}/shared_w_up", "s d", "d s"),
    Rule(f"{_SH}.down_proj.weight", f"{E}/shared_w_down", "d s", "s d"),
    glu_experts((Rule(f"{_M}.mlp.gate.weight", f"{E}/router", "e d", "d e"),
                  Rule(f"{_M}.mlp.gate.e_score_correction_bias", f"{E}/correction_bias", "e", "e"))),
)

# Its multi-token prediction layers model.layers.{num_layers + k}: the decoder layer (the rows above) plus
# enorm, hnorm, eh_proj (input [enorm(embedding) ; hnorm(hidden)], m = d) and shared_head.norm; the checkpoint
# repeats the embedding and the head there (shared with the main model's: written, not read).
DEEPSEEK_V3_MTP = (
    *norm(f"{_M}.enorm", f"{L}/enorm", bias=False),
    *norm(f"{_M}.hnorm", f"{L}/hnorm", bias=False),
    Rule(f"{_M}.eh_proj.weight", f"{L}/eh_proj", "m (2 d)", "(2 d) m"),
    *norm(f"{_M}.shared_head.norm", f"{L}/final_norm", bias=False),
)
DEEPSEEK_V3_MTP_COPIES = (Rule(f"{_M}.embed_tokens.weight", "embed", "v d", "v d"),
                          Rule(f"{_M}.shared_head.head.weight", "head", "v d", "d v"))


def deepseek_v3_to_model(hf: dict) -> dict:
  d, h = get_int(hf, "hidden_size"), get_int(hf, "num_attention_heads", minimum=1)
  rope = rope_from_hf(hf, default_theta=10000.0)
  rp = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
  scaled = rope.get("rope_scaling", {}).get("type", "none") != "none"
  bias = get_bool(hf, "attention_bias", default=False)
  n_group = get_int(hf, "n_group", default=1)
  out = dict(
      common(hf), d_model=d, num_layers=get_int(hf, "num_hidden_layers"), num_heads=h,
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
      moe_common(hf, "n_routed_experts", "moe_intermediate_size"), router="sigmoid",
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


DEEPSEEK_V3 = decoder("deepseek_v3", DEEPSEEK_V3_ROWS, deepseek_v3_to_model, deepseek_v3_to_hf,
                      ignore=(r"^model\.layers\.\d+\.(embed_tokens|shared_head\.head)\.weight$",),
                      mtp=DEEPSEEK_V3_MTP, mtp_copies=DEEPSEEK_V3_MTP_COPIES)
