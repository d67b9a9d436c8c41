"""BERT (BertModel without its pooler): the encoder, post-LN, learned positions and token types."""
from __future__ import annotations

from tformer_jax.config import ModelConfig
from tformer_jax.interop.families.fields import activation, activation_back, common, get_float, get_int, require
from tformer_jax.interop.families.table import Family, L, Rule, linear, norm

_T = "encoder.layer.{i}"
BERT_ROWS = (
    Rule("embeddings.word_embeddings.weight", "embed", "v d", "v d"),
    Rule("embeddings.position_embeddings.weight", "pos_embed", "p d", "p d"),
    Rule("embeddings.token_type_embeddings.weight", "type_embed", "t d", "t d"),
    *norm("embeddings.LayerNorm", "embed_norm"),
    *linear(f"{_T}.attention.self.query", f"{L}/attn/wq", "(h k) d", "d h k", "(h k)", "h k", f"{L}/attn/bq"),
    *linear(f"{_T}.attention.self.key", f"{L}/attn/wk", "(g k) d", "d g k", "(g k)", "g k", f"{L}/attn/bk"),
    *linear(f"{_T}.attention.self.value", f"{L}/attn/wv", "(g k) d", "d g k", "(g k)", "g k", f"{L}/attn/bv"),
    *linear(f"{_T}.attention.output.dense", f"{L}/attn/wo", "d (h k)", "h k d", "d", ours_bias=f"{L}/attn/bo"),
    *norm(f"{_T}.attention.output.LayerNorm", f"{L}/ln1"),
    *linear(f"{_T}.intermediate.dense", f"{L}/mlp/wi", "f d", "d f", "f", ours_bias=f"{L}/mlp/bi"),
    *linear(f"{_T}.output.dense", f"{L}/mlp/wo", "d f", "f d", "d", ours_bias=f"{L}/mlp/bo"),
    *norm(f"{_T}.output.LayerNorm", f"{L}/ln2"),
)


def bert_to_model(hf: dict) -> dict:
  require(hf, "position_embedding_type", ("absolute",), "absolute")
  require(hf, "is_decoder", (False,), False)
  require(hf, "add_cross_attention", (False,), False)
  return dict(
      common(hf), d_model=get_int(hf, "hidden_size"), num_layers=get_int(hf, "num_hidden_layers"),
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

BERT = Family("bert", BERT_ROWS, bert_to_model, bert_to_hf, strip="bert.",
              renames=((r"LayerNorm\.gamma$", "LayerNorm.weight"), (r"LayerNorm\.beta$", "LayerNorm.bias")),
              ignore=(r"^embeddings\.position_ids$",), drop=(r"^pooler\.", r"^cls\."), auto_class="AutoModel")
