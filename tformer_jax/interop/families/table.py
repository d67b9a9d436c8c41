"""The weight tables' vocabulary: which HF tensor is which of our parameters, as data.

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
ROTARY = r"\.rotary_emb\.(\w+_)?inv_freq$"   # RoPE buffers (Gemma 3: one per layer type)


def decoder(model_type: str, rules: tuple, to_model: Callable, to_hf: Callable, ignore: tuple[str, ...] = (),
            **kw) -> Family:
  """A decoder laid out as Llama's: base prefix 'model.', RoPE buffers skipped, lm_head skipped when tied."""
  return Family(model_type, rules, to_model, to_hf, prefix="model.", ignore=(ROTARY, *ignore),
                ignore_tied=(r"^lm_head\.weight$",), **kw)
