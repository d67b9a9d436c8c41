"""`validate_model`: every rule of the model section, as named checks."""
from __future__ import annotations

from tformer_jax.config.enums import (
  ACTIVATIONS,
  ATTENTIONS,
  DTYPES,
  LAYER_KINDS,
  MOE_DISPATCH,
  MOE_ROUTERS,
  NORM_POSITIONS,
  NORMS,
  POSITIONS,
  QK_NORMS,
  REMAT_POLICIES,
  ROPE_LAYOUTS,
  ROPE_SCALINGS,
)
from tformer_jax.config.errors import _check_choice, _fail
from tformer_jax.config.schema import ModelConfig


def validate_model(m: ModelConfig, prefix: str = "model") -> None:
  """Every model rule, on a ModelConfig. Raises ConfigError('<field>: <rule>')."""
  p = prefix + "."
  _check_sizes(m, p)
  _check_choices(m, p)
  _check_positions(m, p)
  _check_sparsity(m, p)
  _check_linear(m, p)
  _check_layout(m, p)
  _check_layer_pattern(m, p)
  _check_logits(m, p)
  _check_moe(m, p)
  _check_mla(m, p)


def _check_sizes(m: ModelConfig, p: str) -> None:
  """Sizes: positive, non-negative, and the head counts dividing each other."""
  if m.vocab_size == 0:
    _fail(p + "vocab_size", "is 0 (= the data tokenizer's vocabulary) and nothing resolved it: set it, or pass the "
          "whole config through tformer_jax.config.resolved(cfg)")
  for name in ("vocab_size", "d_model", "num_layers", "num_heads", "max_len"):
    if getattr(m, name) <= 0:
      _fail(p + name, f"must be a positive integer, got {getattr(m, name)}")
  for name in ("num_kv_heads", "head_dim", "d_ff", "window", "num_global_tokens", "type_vocab_size"):
    if getattr(m, name) < 0:
      _fail(p + name, f"must be >= 0, got {getattr(m, name)}")
  if not m.head_dim and m.d_model % m.num_heads:
    _fail(p + "d_model", f"d_model={m.d_model} must be divisible by num_heads={m.num_heads} "
          "(or set head_dim explicitly)")
  if m.num_heads % m.kv_heads:
    _fail(p + "num_kv_heads", f"num_heads={m.num_heads} must be divisible by num_kv_heads={m.kv_heads}")
  if m.mlp_ratio <= 0:
    _fail(p + "mlp_ratio", f"must be > 0, got {m.mlp_ratio}")


def _check_choices(m: ModelConfig, p: str) -> None:
  """Enum fields, eps, dropout rates and init scales."""
  choices = dict(attention=ATTENTIONS, activation=ACTIVATIONS, norm=NORMS, norm_position=NORM_POSITIONS,
                 qk_norm=QK_NORMS,
                 position=POSITIONS, rope_layout=ROPE_LAYOUTS, remat=REMAT_POLICIES, dtype=DTYPES, param_dtype=DTYPES)
  for name, allowed in choices.items():
    _check_choice(p + name, getattr(m, name), allowed)
  if m.norm_eps <= 0:
    _fail(p + "norm_eps", f"must be > 0, got {m.norm_eps}")
  for name in ("embed_dropout", "attn_dropout", "resid_dropout"):
    v = getattr(m, name)
    if not 0.0 <= v < 1.0:
      _fail(p + name, f"dropout must be in [0, 1), got {v}")
  if m.init_std <= 0:
    _fail(p + "init_std", f"must be > 0, got {m.init_std}")
  if m.attention_scale < 0:
    _fail(p + "attention_scale", f"must be >= 0 (0 = 1/sqrt(head_dim)), got {m.attention_scale}")


def _check_positions(m: ModelConfig, p: str) -> None:
  """RoPE, sinusoidal and T5 position settings (and the RoPE scaling rule)."""
  if m.position == "rope":
    if not 0.0 < m.rotary_fraction <= 1.0:
      _fail(p + "rotary_fraction", f"must be in (0, 1], got {m.rotary_fraction}")
    rot = m.hd * m.rotary_fraction
    if rot != int(rot) or int(rot) % 2:
      _fail(p + "rotary_fraction", f"rotary dims head_dim*rotary_fraction={rot} must be an even integer")
    if m.rope_theta <= 0:
      _fail(p + "rope_theta", f"must be > 0, got {m.rope_theta}")
  if m.position == "sinusoidal" and m.d_model % 2:
    _fail(p + "d_model", f"sinusoidal positions need an even d_model, got {m.d_model}")
  _check_rope_scaling(m, p)
  if m.position == "t5":
    if m.t5_num_buckets <= 0 or m.t5_max_distance <= 0:
      _fail(p + "t5_num_buckets", "t5_num_buckets and t5_max_distance must be positive")
    exact = (m.t5_num_buckets // (1 if m.causal else 2)) // 2    # ops/relative_bias.py: exact buckets
    if exact < 1:
      _fail(p + "t5_num_buckets", f"must be >= {2 if m.causal else 4} (causal={m.causal}), got {m.t5_num_buckets}")
    if m.t5_max_distance <= exact:
      _fail(p + "t5_max_distance", f"must exceed the {exact} exact buckets (log-spaced buckets reach it), "
            f"got {m.t5_max_distance}")


def _check_rope_scaling(m: ModelConfig, p: str) -> None:
  """model.rope_scaling: its type, factor and per-type parameters."""
  rs = m.rope_scaling
  _check_choice(p + "rope_scaling.type", rs.type, ROPE_SCALINGS)
  if rs.original_max_len < 0:
    _fail(p + "rope_scaling.original_max_len", f"must be >= 0 (0 = model.max_len), got {rs.original_max_len}")
  if rs.type != "none":
    if m.position != "rope":
      _fail(p + "rope_scaling.type", f"{rs.type!r} needs position='rope', got {m.position!r}")
    if rs.factor < 1.0:
      _fail(p + "rope_scaling.factor", f"must be >= 1, got {rs.factor}")
  if rs.type == "llama3" and not 0 < rs.low_freq_factor < rs.high_freq_factor:
    _fail(p + "rope_scaling.high_freq_factor", f"llama3 needs 0 < low_freq_factor < high_freq_factor, got "
          f"low_freq_factor={rs.low_freq_factor}, high_freq_factor={rs.high_freq_factor}")
  if rs.type == "yarn":
    if not 0 < rs.beta_slow < rs.beta_fast:
      _fail(p + "rope_scaling.beta_fast", f"yarn needs 0 < beta_slow < beta_fast, got beta_slow={rs.beta_slow}, "
            f"beta_fast={rs.beta_fast}")
    if rs.attention_factor < 0:
      _fail(p + "rope_scaling.attention_factor", f"must be >= 0 (0 = 0.1 ln(factor) + 1), got "
            f"{rs.attention_factor}")


def _check_sparsity(m: ModelConfig, p: str) -> None:
  """The sliding window, global tokens and BigBird random blocks."""
  if m.window > m.max_len:
    _fail(p + "window", f"window={m.window} > max_len={m.max_len} is the same as no window (every query "
          f"already sees all its keys); use window=0 for full attention, or a window <= {m.max_len}")
  if m.num_global_tokens and not m.window:
    _fail(p + "num_global_tokens", "global tokens only matter with a window > 0")
  if m.num_global_tokens >= m.max_len:
    _fail(p + "num_global_tokens", f"must be < max_len={m.max_len}, got {m.num_global_tokens}")
  if m.random_blocks < 0 or m.random_block_size < 1 or m.random_block_seed < 0:
    _fail(p + "random_blocks", f"random_blocks >= 0, random_block_size >= 1 and random_block_seed >= 0, got "
          f"{m.random_blocks}, {m.random_block_size}, {m.random_block_seed}")
  if m.random_blocks and not m.window:
    _fail(p + "random_blocks", "random blocks widen a sliding window (BigBird = window + global + random); "
          "set model.window > 0 (without one every key is already visible)")
  n_blocks = -(-m.max_len // m.random_block_size)
  if m.random_blocks >= n_blocks:
    _fail(p + "random_blocks", f"{m.random_blocks} random blocks of {m.random_block_size} cover all {n_blocks} "
          f"blocks of max_len={m.max_len}: use fewer (or window=0 for full attention)")


def _check_linear(m: ModelConfig, p: str) -> None:
  """What linear attention has no use for (sparsity, logit biases, softmax scale/dropout)."""
  if m.attention == "linear":
    sparse = [f"{k}={getattr(m, k)}" for k in ("window", "num_global_tokens", "random_blocks") if getattr(m, k)]
    if sparse:
      _fail(p + "attention", f"'linear' sums over all (earlier) keys: it has no {', '.join(sparse)}")
    if m.position in ("alibi", "t5"):
      _fail(p + "attention", f"'linear' has no attention logits to bias: position={m.position!r} needs "
            "'softmax' (use rope, learned or sinusoidal positions)")
    for name in ("attn_dropout", "attention_scale"):
      if getattr(m, name):
        _fail(p + name, "'linear' attention has no softmax weights to scale or drop; set it to 0")


def _check_layout(m: ModelConfig, p: str) -> None:
  """The mask token id and the residual layout."""
  if not -1 <= m.mask_token_id < m.vocab_size:
    _fail(p + "mask_token_id", f"must be -1 (= vocab_size - 1) or an id in [0, {m.vocab_size}), got {m.mask_token_id}")
  if m.norm_position != "pre" and m.parallel_residual:
    _fail(p + "parallel_residual", "parallel residual is a Pre-LN layout; set norm_position='pre'")
  if m.norm_unit_offset and m.norm != "rmsnorm":
    _fail(p + "norm_unit_offset", "the (1 + w) scale is Gemma's RMSNorm; set norm='rmsnorm'")


def _check_layer_pattern(m: ModelConfig, p: str) -> None:
  """Per-layer attention types: L (the window) and G (full), repeated."""
  pattern = m.layer_pattern
  if pattern:
    bad = sorted(set(pattern) - set(LAYER_KINDS))
    if bad:
      _fail(p + "layer_pattern", f"letters are L (local: the sliding window) and G (global), got {bad[0]!r} in "
            f"{pattern!r} (Gemma 3: 'LLLLLG')")
    if "L" in pattern and not m.window:
      _fail(p + "layer_pattern", f"{pattern!r} has local layers: set model.window > 0 (their sliding window)")
    if "L" not in pattern:
      _fail(p + "layer_pattern", f"{pattern!r} has no local layer; use layer_pattern='' for all-global layers")
    if m.num_global_tokens or m.random_blocks:
      _fail(p + "layer_pattern", "global tokens and random blocks widen every layer's window; they do not combine "
            "with local/global layers")
  if m.local_rope_theta < 0:
    _fail(p + "local_rope_theta", f"must be >= 0 (0 = rope_theta), got {m.local_rope_theta}")
  if m.local_rope_theta > 0 and (m.position != "rope" or not pattern):
    _fail(p + "local_rope_theta", "is the RoPE base of a layer_pattern model's local layers: it needs "
          "position='rope' and a layer_pattern")


def _check_logits(m: ModelConfig, p: str) -> None:
  """QK-norm, soft caps and sinks: softmax attention's."""
  for name in ("attn_softcap", "final_logit_softcap"):
    if getattr(m, name) < 0:
      _fail(p + name, f"must be >= 0 (0 = no cap), got {getattr(m, name)}")
  if m.attention == "linear":
    on = [f"{k}={getattr(m, k)!r}" for k in ("attn_softcap", "attention_sinks") if getattr(m, k)]
    if on:
      _fail(p + "attention", f"'linear' has no softmax to cap or sink: {', '.join(on)} needs 'softmax'")
  if m.final_logit_softcap and not m.lm_head:
    _fail(p + "final_logit_softcap", "caps the LM head's logits; the model has no head (lm_head=False)")


def _check_mla(m: ModelConfig, p: str) -> None:
  """Multi-head Latent Attention (model.mla) and multi-token prediction (model.mtp_depth)."""
  a, q = m.mla, p + "mla."
  for name in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "mscale_all_dim"):
    if getattr(a, name) < 0:
      _fail(q + name, f"must be >= 0, got {getattr(a, name)}")
  if not m.use_mla:
    on = [n for n in ("q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "mscale_all_dim")
          if getattr(a, n)]
    if on:
      _fail(q + on[0], "is an MLA size: set model.mla.kv_lora_rank > 0 (the latent width) to turn MLA on")
  else:
    _check_mla_on(m, p)
  if m.mtp_depth < 0:
    _fail(p + "mtp_depth", f"must be >= 0 (0 = no multi-token prediction), got {m.mtp_depth}")
  if m.mtp_depth and (not m.causal or not m.lm_head):
    _fail(p + "mtp_depth", "multi-token prediction predicts later tokens of a causal LM: needs causal=True and "
          "lm_head=True")


def _check_mla_on(m: ModelConfig, p: str) -> None:
  """An MLA model's sizes, and what MLA does not combine with."""
  a, q = m.mla, p + "mla."
  for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
    if getattr(a, name) <= 0:
      _fail(q + name, f"MLA (kv_lora_rank={a.kv_lora_rank}) needs it > 0, got {getattr(a, name)}")
  if a.qk_rope_head_dim % 2:
    _fail(q + "qk_rope_head_dim", f"rotated in pairs: must be even, got {a.qk_rope_head_dim}")
  if m.position != "rope":
    _fail(p + "position", f"MLA's decoupled key is a RoPE key: needs position='rope', got {m.position!r}")
  if m.rotary_fraction != 1.0:
    _fail(p + "rotary_fraction", "MLA rotates exactly mla.qk_rope_head_dim dims of each head: leave it at 1")
  if m.num_kv_heads not in (0, m.num_heads):
    _fail(p + "num_kv_heads", f"MLA up-projects K and V for every query head: leave it 0, got {m.num_kv_heads}")
  if m.attention != "softmax" or m.qk_norm != "none":
    _fail(p + ("attention" if m.attention != "softmax" else "qk_norm"),
          "MLA is softmax attention without QK-norm (DeepSeek norms the latents: mla.*_lora_rank)")
  if m.window or m.layer_pattern:
    _fail(p + ("window" if m.window else "layer_pattern"), "MLA has no sliding window (a ring cache of latents is "
          "not built): use window=0 and no layer_pattern")
  if a.mscale_all_dim and m.rope_scaling.type == "none":
    _fail(q + "mscale_all_dim", "scales attention for a RoPE scaling: set model.rope_scaling (DeepSeek: yarn)")


def _check_moe(m: ModelConfig, p: str) -> None:
  """The mixture-of-experts sub-config."""
  moe = m.moe
  for name in ("num_experts", "d_ff"):
    if getattr(moe, name) < 0:
      _fail(p + "moe." + name, f"must be >= 0, got {getattr(moe, name)}")
  if moe.num_experts and not 1 <= moe.top_k <= moe.num_experts:
    _fail(p + "moe.top_k", f"must be in [1, num_experts={moe.num_experts}], got {moe.top_k}")
  if moe.every < 1:
    _fail(p + "moe.every", f"must be >= 1, got {moe.every}")
  _check_choice(p + "moe.dispatch", moe.dispatch, MOE_DISPATCH)
  if moe.ep_buffer_factor < 0:
    _fail(p + "moe.ep_buffer_factor", f"must be >= 0 (0 = the worst case, never drops), got {moe.ep_buffer_factor}")
  if moe.capacity_factor <= 0:
    _fail(p + "moe.capacity_factor", f"must be > 0, got {moe.capacity_factor}")
  if not 0.0 <= moe.jitter < 1.0:
    _fail(p + "moe.jitter", f"must be in [0, 1) (router inputs times U(1 - jitter, 1 + jitter)), got {moe.jitter}")
  for name in ("aux_loss_coef", "z_loss_coef"):
    if getattr(moe, name) < 0:
      _fail(p + "moe." + name, f"loss coefficients must be >= 0, got {getattr(moe, name)}")
  if moe.num_experts and m.scan_layers and moe.every != 1:
    _fail(p + "moe.every", "scan_layers needs identical layers: use moe.every=1 or scan_layers=False")
  _check_moe_variants(m, p)


def _check_moe_variants(m: ModelConfig, p: str) -> None:
  """Routers, shared experts, dense first layers and GPT-OSS's expert extras."""
  moe, q = m.moe, p + "moe."
  _check_choice(q + "router", moe.router, MOE_ROUTERS)
  for name in ("n_group", "topk_group", "num_shared_experts", "shared_d_ff", "first_k_dense"):
    if getattr(moe, name) < 0:
      _fail(q + name, f"must be >= 0, got {getattr(moe, name)}")
  if moe.shared_expert and moe.num_shared_experts not in (0, 1):
    _fail(q + "shared_expert", f"is num_shared_experts=1; it contradicts num_shared_experts={moe.num_shared_experts} "
          "(set only num_shared_experts)")
  if moe.n_group > 1 or moe.topk_group:
    if moe.router != "sigmoid":
      _fail(q + "n_group", f"group-limited routing is the sigmoid router's (router={moe.router!r})")
    if moe.n_group < 2 or moe.num_experts % moe.n_group or moe.num_experts // moe.n_group < 2:
      _fail(q + "n_group", f"must divide num_experts={moe.num_experts} into groups of at least 2 experts, "
            f"got {moe.n_group}")
    if not 1 <= moe.topk_group <= moe.n_group:
      _fail(q + "topk_group", f"must be in [1, n_group={moe.n_group}], got {moe.topk_group}")
    if moe.topk_group * (moe.num_experts // moe.n_group) < moe.top_k:
      _fail(q + "topk_group", f"topk_group={moe.topk_group} groups of {moe.num_experts // moe.n_group} experts "
            f"hold fewer than top_k={moe.top_k}")
  if moe.routed_scaling_factor <= 0:
    _fail(q + "routed_scaling_factor", f"must be > 0, got {moe.routed_scaling_factor}")
  if moe.bias_update_rate < 0:
    _fail(q + "bias_update_rate", f"must be >= 0, got {moe.bias_update_rate}")
  if moe.bias_update_rate and moe.router != "sigmoid":
    _fail(q + "bias_update_rate", f"the correction bias is the sigmoid router's (router={moe.router!r})")
  _check_moe_layers(m, p)


def _check_moe_layers(m: ModelConfig, p: str) -> None:
  """Dense first layers and the experts' clamped SwiGLU."""
  moe, q = m.moe, p + "moe."
  if moe.first_k_dense:
    if not moe.num_experts:
      _fail(q + "first_k_dense", "needs moe.num_experts > 0")
    if moe.first_k_dense >= m.num_layers:
      _fail(q + "first_k_dense", f"must be below num_layers={m.num_layers} (some layers must be MoE), "
            f"got {moe.first_k_dense}")
    if m.scan_layers and moe.first_k_dense % m.cycle:
      _fail(q + "first_k_dense", f"scan_layers: must be a multiple of the layer_pattern's {m.cycle} layers, "
            f"got {moe.first_k_dense}")
  if moe.swiglu_limit < 0:
    _fail(q + "swiglu_limit", f"must be >= 0 (0 = off), got {moe.swiglu_limit}")
  if moe.swiglu_limit and m.activation != "swiglu":
    _fail(q + "swiglu_limit", f"clamps SwiGLU experts; model.activation is {m.activation!r}")
