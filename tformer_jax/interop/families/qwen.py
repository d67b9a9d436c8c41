"""Qwen2, Qwen3 and Qwen3-MoE: Llama's layout with q/k/v biases (Qwen2) or per-head QK-norm (Qwen3), sliding
windows on the layers config.json names, and Qwen3-MoE's softmax-routed experts."""
from __future__ import annotations

from tformer_jax.config import ModelConfig
from tformer_jax.interop.families.fields import (
  HFConfigError,
  get_bool,
  get_int,
  global_rope_only,
  layer_attention,
  layer_kinds,
  layer_types_back,
  moe_common,
  one_attention_bias,
)
from tformer_jax.interop.families.llama import HEAD_QK_NORM, LLAMA_ROWS, E, decoder_config, glu_experts, llama_like_back
from tformer_jax.interop.families.table import Rule, decoder

_M = "model.layers.{i}"
QWEN3_ROWS = LLAMA_ROWS + HEAD_QK_NORM
QWEN3_MOE_ROWS = QWEN3_ROWS + (glu_experts((Rule(f"{_M}.mlp.gate.weight", f"{E}/router", "e d", "d e"),)),)


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
  out = decoder_config(hf, 10000.0, bias=False)
  out.update(qkv_bias=True, **_qwen_windows(hf, out))            # q/k/v biases always; none on o_proj
  return out


def qwen2_to_hf(cfg: ModelConfig) -> dict:
  global_rope_only(cfg, "qwen2")
  out = llama_like_back(cfg, "qwen2", "Qwen2ForCausalLM", window=False)
  out.update(_qwen_windows_back(cfg))
  return out


def qwen3_to_model(hf: dict) -> dict:
  out = decoder_config(hf, 10000.0)
  out.update(qk_norm="head", **_qwen_windows(hf, out))
  return out


def qwen3_to_hf(cfg: ModelConfig) -> dict:
  one_attention_bias(cfg, "qwen3")
  global_rope_only(cfg, "qwen3")
  out = llama_like_back(cfg, "qwen3", "Qwen3ForCausalLM", window=False)
  out.update(attention_bias=cfg.qkv_bias, **_qwen_windows_back(cfg))
  return out


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
  out = decoder_config(hf, 10000.0)
  out.update(qk_norm="head", **_one_window(hf, out))
  n = out["num_layers"]
  if get_int(hf, "num_experts", "num_local_experts", default=0):
    out["moe"] = dict(moe_common(hf, "num_experts", "moe_intermediate_size"), router="softmax",
                      renormalize=get_bool(hf, "norm_topk_prob", default=False),
                      every=get_int(hf, "decoder_sparse_step", default=1, minimum=1),
                      first_k_dense=_first_dense(hf, n, "mlp_only_layers"))
  return out


def qwen3_moe_to_hf(cfg: ModelConfig) -> dict:
  one_attention_bias(cfg, "qwen3_moe")
  if cfg.layer_pattern:
    raise HFConfigError(f"qwen3_moe cannot represent model.layer_pattern={cfg.layer_pattern!r} (one window on "
                        "every layer)", "layer_pattern", {"layer_pattern": ""})
  m = cfg.moe
  out = llama_like_back(cfg, "qwen3_moe", "Qwen3MoeForCausalLM", window=False)
  out.update(attention_bias=cfg.qkv_bias, use_sliding_window=bool(cfg.window), sliding_window=cfg.window or None,
             num_experts=m.num_experts, num_experts_per_tok=m.top_k, moe_intermediate_size=m.d_ff or cfg.ff,
             norm_topk_prob=m.renormalize, decoder_sparse_step=m.every,
             mlp_only_layers=list(range(m.first_k_dense)), router_aux_loss_coef=m.aux_loss_coef,
             output_router_logits=False)
  return out


QWEN2 = decoder("qwen2", LLAMA_ROWS, qwen2_to_model, qwen2_to_hf)
QWEN3 = decoder("qwen3", QWEN3_ROWS, qwen3_to_model, qwen3_to_hf)
QWEN3_MOE = decoder("qwen3_moe", QWEN3_MOE_ROWS, qwen3_moe_to_model, qwen3_moe_to_hf)
