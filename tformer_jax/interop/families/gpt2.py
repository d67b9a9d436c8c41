"""GPT-2, BLOOM and GPT-NeoX: the decoders with a fused q/k/v projection and LayerNorm (learned positions,
ALiBi, partial RoPE with a parallel residual)."""
from __future__ import annotations

from tformer_jax.config import ModelConfig
from tformer_jax.interop.families.fields import (
  HFConfigError,
  activation,
  activation_back,
  common,
  get,
  get_bool,
  get_float,
  get_int,
  require,
  rope_from_hf,
  rope_to_hf,
)
from tformer_jax.interop.families.table import HEAD, ROTARY, Family, L, Rule, linear, norm, qkv

_G = "transformer.h.{i}"
GPT2_ROWS = (
    Rule("transformer.wte.weight", "embed", "v d", "v d"),
    Rule("transformer.wpe.weight", "pos_embed", "p d", "p d"),
    *norm(f"{_G}.ln_1", f"{L}/ln1"),
    *qkv(f"{_G}.attn.c_attn", L, "d (3 h k)", "(3 h k)"),        # Conv1D: stored (in, out)
    *linear(f"{_G}.attn.c_proj", f"{L}/attn/wo", "(h k) d", "h k d", "d", ours_bias=f"{L}/attn/bo"),
    *norm(f"{_G}.ln_2", f"{L}/ln2"),
    *linear(f"{_G}.mlp.c_fc", f"{L}/mlp/wi", "d f", "d f", "f", ours_bias=f"{L}/mlp/bi"),
    *linear(f"{_G}.mlp.c_proj", f"{L}/mlp/wo", "f d", "f d", "d", ours_bias=f"{L}/mlp/bo"),
    *norm("transformer.ln_f", "final_norm"),
    HEAD,
)

_B = "transformer.h.{i}"
BLOOM_ROWS = (
    Rule("transformer.word_embeddings.weight", "embed", "v d", "v d"),
    *norm("transformer.word_embeddings_layernorm", "embed_norm"),
    *norm(f"{_B}.input_layernorm", f"{L}/ln1"),
    *qkv(f"{_B}.self_attention.query_key_value", L, "(h 3 k) d", "(h 3 k)"),
    *linear(f"{_B}.self_attention.dense", f"{L}/attn/wo", "d (h k)", "h k d", "d", ours_bias=f"{L}/attn/bo"),
    *norm(f"{_B}.post_attention_layernorm", f"{L}/ln2"),
    *linear(f"{_B}.mlp.dense_h_to_4h", f"{L}/mlp/wi", "f d", "d f", "f", ours_bias=f"{L}/mlp/bi"),
    *linear(f"{_B}.mlp.dense_4h_to_h", f"{L}/mlp/wo", "d f", "f d", "d", ours_bias=f"{L}/mlp/bo"),
    *norm("transformer.ln_f", "final_norm"),
    HEAD,
)

_N = "gpt_neox.layers.{i}"
GPT_NEOX_ROWS = (
    Rule("gpt_neox.embed_in.weight", "embed", "v d", "v d"),
    *norm(f"{_N}.input_layernorm", f"{L}/ln1"),
    *qkv(f"{_N}.attention.query_key_value", L, "(h 3 k) d", "(h 3 k)"),
    *linear(f"{_N}.attention.dense", f"{L}/attn/wo", "d (h k)", "h k d", "d", ours_bias=f"{L}/attn/bo"),
    *norm(f"{_N}.post_attention_layernorm", f"{L}/ln2"),
    *linear(f"{_N}.mlp.dense_h_to_4h", f"{L}/mlp/wi", "f d", "d f", "f", ours_bias=f"{L}/mlp/bi"),
    *linear(f"{_N}.mlp.dense_4h_to_h", f"{L}/mlp/wo", "d f", "f d", "d", ours_bias=f"{L}/mlp/bo"),
    *norm("gpt_neox.final_layer_norm", "final_norm"),
    Rule("embed_out.weight", "head", "v d", "d v"),
)


def gpt2_to_model(hf: dict) -> dict:
  for opt in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
    require(hf, opt, (False,), False)
  d = get_int(hf, "n_embd", "hidden_size")
  return dict(
      common(hf), d_model=d, num_layers=get_int(hf, "n_layer", "num_hidden_layers"),
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


def bloom_to_model(hf: dict) -> dict:
  require(hf, "apply_residual_connection_post_layernorm", (False,), False)
  d = get_int(hf, "hidden_size", "n_embed")
  return dict(
      common(hf), d_model=d, num_layers=get_int(hf, "n_layer", "num_hidden_layers"),
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
      common(hf), d_model=get_int(hf, "hidden_size"), num_layers=get_int(hf, "num_hidden_layers"),
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


GPT2 = Family("gpt2", GPT2_ROWS, gpt2_to_model, gpt2_to_hf, prefix="transformer.",
              ignore=(r"\.attn\.(masked_)?bias$",), ignore_tied=(r"^lm_head\.weight$",))
BLOOM = Family("bloom", BLOOM_ROWS, bloom_to_model, bloom_to_hf, prefix="transformer.",
               ignore_tied=(r"^lm_head\.weight$",))
GPT_NEOX = Family("gpt_neox", GPT_NEOX_ROWS, gpt_neox_to_model, gpt_neox_to_hf, prefix="gpt_neox.",
                  renames=((r"^lm_head\.weight$", "embed_out.weight"),),
                  ignore=(ROTARY, r"\.attention\.(masked_)?bias$"), ignore_tied=(r"^embed_out\.weight$",))
