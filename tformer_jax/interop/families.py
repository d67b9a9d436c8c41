"""The Hugging Face family tables: which HF tensor is which of our parameters, as data.

A `Rule` maps one HF tensor name (a template: `{i}` = layer, `{e}` = expert) to one or more of our
parameter paths ('/'-separated, `{i}` = layer) with an `axes.rearrange` layout on each side:

  Rule("model.layers.{i}.self_attn.q_proj.weight", "layers_{i}/attn/wq", "(h k) d", "d h k")

is torch's Linear (out, in) = (heads * head_dim, d_model) becoming our (d_model, heads, head_dim).
Several of our paths split a fused tensor along the HF-only literal axis ('(h 3 k) d' -> q, k, v);
`{e}` stacks one HF tensor per expert into our 'e' axis. Every rule has layouts on both sides (a
plain copy is 'v d' -> 'v d'), so the shape each HF tensor must have follows from config.json alone
and is checked before any model is built. Axis sizes: d d_model, h heads, g kv heads, k head_dim,
f FFN hidden, v vocab, e experts, x expert hidden, p max_len, t type_vocab_size.

A rule applies exactly when our model has its parameter(s) (biases, an untied head, MoE layers),
so the tables need no conditions. `OneOf` lists equivalent layouts of the same weights (Mixtral's
per-expert files vs transformers 5's fused modules): imports take the first whose tensors are
present, exports write the first. `renames` (regex, replacement) normalise alternative spellings
before matching (in-memory module names, legacy 'gamma'/'beta').
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from tformer_jax.config import ModelConfig
from tformer_jax.interop import hf_config as C


@dataclasses.dataclass(frozen=True)
class Rule:
  hf: str
  ours: str | tuple[str, ...]
  hf_axes: str = ""
  ours_axes: str = ""

  @property
  def targets(self) -> tuple[str, ...]:
    return (self.ours,) if isinstance(self.ours, str) else tuple(self.ours)


@dataclasses.dataclass(frozen=True)
class OneOf:
  options: tuple[tuple[Rule, ...], ...]


@dataclasses.dataclass(frozen=True)
class Family:
  model_type: str
  rules: tuple[Rule | OneOf, ...]
  to_model: Callable[[dict], dict]          # config.json dict -> ModelConfig kwargs
  to_hf: Callable[[ModelConfig], dict]      # ModelConfig -> config.json dict
  prefix: str = ""                          # base-model prefix, added when a headless checkpoint lacks it
  strip: str = ""                           # a wrapper prefix removed when present ('bert.')
  renames: tuple[tuple[str, str], ...] = ()
  ignore: tuple[str, ...] = ()              # regexes of non-weight buffers, skipped silently
  ignore_tied: tuple[str, ...] = ()         # head tensors skipped when the embeddings are tied
  drop: tuple[str, ...] = ()                # real weights we have no place for: skipped with a warning
  auto_class: str = "AutoModelForCausalLM"
  # Multi-token prediction modules (DeepSeek-V3): per-layer rules at HF layer {i} = num_layers + k, which is
  # our 'mtp_<k>' (read as a virtual layers_{i}: the block's parameters under layers_{i}/..., these rules' beside
  # them); an import keeps as many modules as the files hold (model.mtp_depth), an export writes them.
  mtp: tuple[Rule, ...] = ()
  mtp_copies: tuple[Rule, ...] = ()         # shared tensors each MTP layer repeats: written, ignored on reading


def norm(hf: str, ours: str, bias: bool = True, weight: str = "weight") -> tuple[Rule, ...]:
  """A LayerNorm/RMSNorm: HF `<hf>.weight` (+ `.bias`) -> our `<ours>/scale` (+ `/bias`)."""
  rules = (Rule(f"{hf}.{weight}", f"{ours}/scale", "d", "d"),)
  return rules + ((Rule(f"{hf}.bias", f"{ours}/bias", "d", "d"),) if bias else ())


def linear(hf: str, ours: str, hf_axes: str, ours_axes: str, bias: str = "", bias_axes: str = "",
           ours_bias: str = "") -> tuple[Rule, ...]:
  """torch Linear/Conv1D `<hf>.weight` (+ `<hf>.bias` -> `ours_bias`) with the given layouts (the
  bias layout `bias` on both sides unless `bias_axes` gives ours)."""
  rules = (Rule(f"{hf}.weight", ours, hf_axes, ours_axes),)
  if ours_bias:
    rules += (Rule(f"{hf}.bias", ours_bias, bias, bias_axes or bias),)
  return rules


def qkv(hf: str, layer: str, w_axes: str, b_axes: str) -> tuple[Rule, ...]:
  """A fused q/k/v projection split into our wq, wk, wv (and bq, bk, bv)."""
  a = f"{layer}/attn"
  return (Rule(f"{hf}.weight", (f"{a}/wq", f"{a}/wk", f"{a}/wv"), w_axes, "d h k"),
          Rule(f"{hf}.bias", (f"{a}/bq", f"{a}/bk", f"{a}/bv"), b_axes, "h k"))


L = "layers_{i}"
HEAD = Rule("lm_head.weight", "head", "v d", "d v")

# -- gpt2 -----------------------------------------------------------------------------------
_G = "transformer.h.{i}"
GPT2 = (
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

# -- llama / mistral / mixtral -----------------------------------------------------------------
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
LLAMA = LLAMA_OUTER + LLAMA_ATTN + GLU_MLP

# -- qwen2 (Llama's rows: its q/k/v biases are the bias rows), qwen3, olmo2, gemma2, gemma3_text --------
# QK-norm scales: one per head dimension (Qwen3, Gemma 3: 'head') or over the whole projection (OLMo 2:
# 'proj', H*Dh for q and K*Dh for k), flat on both sides.
HEAD_QK_NORM = (Rule(f"{_M}.self_attn.q_norm.weight", f"{L}/attn/q_norm/scale", "k", "k"),
                Rule(f"{_M}.self_attn.k_norm.weight", f"{L}/attn/k_norm/scale", "k", "k"))
PROJ_QK_NORM = (Rule(f"{_M}.self_attn.q_norm.weight", f"{L}/attn/q_norm/scale", "(h k)", "(h k)"),
                Rule(f"{_M}.self_attn.k_norm.weight", f"{L}/attn/k_norm/scale", "(g k)", "(g k)"))
QWEN3 = LLAMA + HEAD_QK_NORM
# OLMo 2 normalises each sublayer's output before its residual add (norm_position 'reordered').
OLMO2 = LLAMA_OUTER + LLAMA_PROJ + PROJ_QK_NORM + GLU_MLP + (
    *norm(f"{_M}.post_attention_layernorm", f"{L}/post_attn_norm", bias=False),
    *norm(f"{_M}.post_feedforward_layernorm", f"{L}/post_ffn_norm", bias=False),
)
# Gemma's sandwich: a norm before and after each sublayer; its RMSNorm is (1 + w) and w is stored as is.
GEMMA2 = LLAMA_OUTER + LLAMA_PROJ + GLU_MLP + (
    *norm(f"{_M}.input_layernorm", f"{L}/ln1", bias=False),
    *norm(f"{_M}.post_attention_layernorm", f"{L}/post_attn_norm", bias=False),
    *norm(f"{_M}.pre_feedforward_layernorm", f"{L}/ln2", bias=False),
    *norm(f"{_M}.post_feedforward_layernorm", f"{L}/post_ffn_norm", bias=False),
)
GEMMA3 = GEMMA2 + HEAD_QK_NORM
_E = f"{L}/moe"
MIXTRAL = LLAMA_OUTER + LLAMA_ATTN + (OneOf((
    # What save_pretrained writes (and every Mixtral checkpoint on the hub): one tensor per expert.
    (Rule(f"{_M}.block_sparse_moe.gate.weight", f"{_E}/router", "e d", "d e"),
     Rule(f"{_M}.block_sparse_moe.experts.{{e}}.w1.weight", f"{_E}/w_gate", "x d", "e d x"),
     Rule(f"{_M}.block_sparse_moe.experts.{{e}}.w3.weight", f"{_E}/w_up", "x d", "e d x"),
     Rule(f"{_M}.block_sparse_moe.experts.{{e}}.w2.weight", f"{_E}/w_down", "d x", "e x d")),
    # transformers 5 modules (the in-memory state_dict): experts fused, gate rows before up rows.
    (Rule(f"{_M}.mlp.gate.weight", f"{_E}/router", "e d", "d e"),
     Rule(f"{_M}.mlp.experts.gate_up_proj", (f"{_E}/w_gate", f"{_E}/w_up"), "e (2 x) d", "e d x"),
     Rule(f"{_M}.mlp.experts.down_proj", f"{_E}/w_down", "e d x", "e x d")),
)),)

# -- qwen3_moe, gpt_oss, deepseek_v3 ---------------------------------------------------------------
# Qwen3-MoE's (and DeepSeek-V3's) experts: one tensor per expert in the files (gate_proj/up_proj/down_proj),
# fused in transformers 5's modules (gate rows before up rows), as Mixtral's.
def _glu_experts(router: tuple[Rule, ...]) -> OneOf:
  return OneOf((
      router + (Rule(f"{_M}.mlp.experts.{{e}}.gate_proj.weight", f"{_E}/w_gate", "x d", "e d x"),
                Rule(f"{_M}.mlp.experts.{{e}}.up_proj.weight", f"{_E}/w_up", "x d", "e d x"),
                Rule(f"{_M}.mlp.experts.{{e}}.down_proj.weight", f"{_E}/w_down", "d x", "e x d")),
      router + (Rule(f"{_M}.mlp.experts.gate_up_proj", (f"{_E}/w_gate", f"{_E}/w_up"), "e (2 x) d", "e d x"),
                Rule(f"{_M}.mlp.experts.down_proj", f"{_E}/w_down", "e d x", "e x d")),
  ))


QWEN3_MOE = LLAMA + HEAD_QK_NORM + (_glu_experts((Rule(f"{_M}.mlp.gate.weight", f"{_E}/router", "e d", "d e"),)),)

# GPT-OSS: attention biases and sinks; a router with a bias; the experts fused on disk too, gate and up
# interleaved along the last axis (gate = [..., ::2], up = [..., 1::2]), with biases.
GPT_OSS = LLAMA_OUTER + LLAMA_ATTN + (
    Rule(f"{_M}.self_attn.sinks", f"{L}/attn/sinks", "h", "h"),
    Rule(f"{_M}.mlp.router.weight", f"{_E}/router", "e d", "d e"),
    Rule(f"{_M}.mlp.router.bias", f"{_E}/router_bias", "e", "e"),
    Rule(f"{_M}.mlp.experts.gate_up_proj", (f"{_E}/w_gate", f"{_E}/w_up"), "e d (x 2)", "e d x"),
    Rule(f"{_M}.mlp.experts.gate_up_proj_bias", (f"{_E}/b_gate", f"{_E}/b_up"), "e (x 2)", "e x"),
    Rule(f"{_M}.mlp.experts.down_proj", f"{_E}/w_down", "e x d", "e x d"),
    Rule(f"{_M}.mlp.experts.down_proj_bias", f"{_E}/b_down", "e d", "e d"),
)

# DeepSeek-V3: MLA (q directly or through its normed bottleneck, the joint K/V latent with the shared RoPE
# key, kv_b's per-head key then value dims), dense first layers (Llama's mlp rows), a sigmoid router with
# its correction bias (a buffer), shared experts as one MLP of n_shared_experts x moe_intermediate_size.
_A = f"{L}/attn"
_SA = f"{_M}.self_attn"
_SH = f"{_M}.mlp.shared_experts"
DEEPSEEK_V3 = LLAMA_OUTER + GLU_MLP + (
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
    Rule(f"{_SH}.gate_proj.weight", f"{_E}/shared_w_gate", "s d", "d s"),
    Rule(f"{_SH}.up_proj.weight", f"{_E}/shared_w_up", "s d", "d s"),
    Rule(f"{_SH}.down_proj.weight", f"{_E}/shared_w_down", "d s", "s d"),
    _glu_experts((Rule(f"{_M}.mlp.gate.weight", f"{_E}/router", "e d", "d e"),
                  Rule(f"{_M}.mlp.gate.e_score_correction_bias", f"{_E}/correction_bias", "e", "e"))),
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

# -- bloom ---------------------------------------------------------------------------------------
_B = "transformer.h.{i}"
BLOOM = (
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

# -- gpt_neox ------------------------------------------------------------------------------------
_N = "gpt_neox.layers.{i}"
GPT_NEOX = (
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

# -- bert (BertModel, no pooler) -------------------------------------------------------------------
_T = "encoder.layer.{i}"
BERT = (
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

_ROTARY = r"\.rotary_emb\.(\w+_)?inv_freq$"   # Gemma 3: one per layer type


def _decoder(model_type: str, rules: tuple, to_model: Callable, to_hf: Callable, ignore: tuple[str, ...] = (),
             **kw) -> Family:
  """A decoder laid out as Llama's: base prefix 'model.', RoPE buffers skipped, lm_head skipped when tied."""
  return Family(model_type, rules, to_model, to_hf, prefix="model.", ignore=(_ROTARY, *ignore),
                ignore_tied=(r"^lm_head\.weight$",), **kw)


FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("gpt2", GPT2, C.gpt2_to_model, C.gpt2_to_hf, prefix="transformer.",
           ignore=(r"\.attn\.(masked_)?bias$",), ignore_tied=(r"^lm_head\.weight$",)),
    _decoder("llama", LLAMA, C.llama_to_model, C.llama_to_hf),
    _decoder("mistral", LLAMA, C.mistral_to_model, C.mistral_to_hf),
    _decoder("mixtral", MIXTRAL, C.mixtral_to_model, C.mixtral_to_hf),
    _decoder("qwen2", LLAMA, C.qwen2_to_model, C.qwen2_to_hf),
    _decoder("qwen3", QWEN3, C.qwen3_to_model, C.qwen3_to_hf),
    _decoder("olmo2", OLMO2, C.olmo2_to_model, C.olmo2_to_hf),
    _decoder("gemma2", GEMMA2, C.gemma2_to_model, C.gemma2_to_hf),
    _decoder("gemma3_text", GEMMA3, C.gemma3_text_to_model, C.gemma3_text_to_hf),
    _decoder("qwen3_moe", QWEN3_MOE, C.qwen3_moe_to_model, C.qwen3_moe_to_hf),
    _decoder("gpt_oss", GPT_OSS, C.gpt_oss_to_model, C.gpt_oss_to_hf),
    _decoder("deepseek_v3", DEEPSEEK_V3, C.deepseek_v3_to_model, C.deepseek_v3_to_hf,
             ignore=(r"^model\.layers\.\d+\.(embed_tokens|shared_head\.head)\.weight$",), mtp=DEEPSEEK_V3_MTP,
             mtp_copies=DEEPSEEK_V3_MTP_COPIES),
    Family("bloom", BLOOM, C.bloom_to_model, C.bloom_to_hf, prefix="transformer.",
           ignore_tied=(r"^lm_head\.weight$",)),
    Family("gpt_neox", GPT_NEOX, C.gpt_neox_to_model, C.gpt_neox_to_hf, prefix="gpt_neox.",
           renames=((r"^lm_head\.weight$", "embed_out.weight"),),
           ignore=(_ROTARY, r"\.attention\.(masked_)?bias$"), ignore_tied=(r"^embed_out\.weight$",)),
    Family("bert", BERT, C.bert_to_model, C.bert_to_hf, strip="bert.",
           renames=((r"LayerNorm\.gamma$", "LayerNorm.weight"), (r"LayerNorm\.beta$", "LayerNorm.bias")),
           ignore=(r"^embeddings\.position_ids$",), drop=(r"^pooler\.", r"^cls\."), auto_class="AutoModel"),
)}


def get_family(model_type: str | None) -> Family:
  if not isinstance(model_type, str) or model_type not in FAMILIES:
    raise C.HFConfigError(f"unknown model family (model_type) {model_type!r}; supported: {sorted(FAMILIES)}")
  return FAMILIES[model_type]
