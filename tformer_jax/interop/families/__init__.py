"""The Hugging Face families: one module per family group, each holding its weight table (`Rule` rows, as
data: table.py says how to read them) and its config mapping both ways (`<family>_to_model`, `<family>_to_hf`,
on the shared helpers of fields.py); this file is the registry.

Adding a family is one module (or a few lines in its group's) plus one line below. The order is the order in
which `interop.hf.infer_family` tries them for a model that names no family.
"""
from __future__ import annotations

from tformer_jax.interop.families import bert, deepseek, gemma, gpt2, gpt_oss, llama, olmo, qwen
from tformer_jax.interop.families.fields import HFConfigError
from tformer_jax.interop.families.table import Family, OneOf, Rule

__all__ = ["FAMILIES", "Family", "HFConfigError", "OneOf", "Rule", "get_family"]

FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    gpt2.GPT2,
    llama.LLAMA,
    llama.MISTRAL,
    llama.MIXTRAL,
    qwen.QWEN2,
    qwen.QWEN3,
    olmo.OLMO2,
    gemma.GEMMA2,
    gemma.GEMMA3_TEXT,
    qwen.QWEN3_MOE,
    gpt_oss.GPT_OSS,
    deepseek.DEEPSEEK_V3,
    gpt2.BLOOM,
    gpt2.GPT_NEOX,
    bert.BERT,
)}


def get_family(model_type: str | None) -> Family:
  """The family of a config.json's `model_type`; HFConfigError (one line, listing every family) otherwise."""
  if not isinstance(model_type, str) or model_type not in FAMILIES:
    raise HFConfigError(f"unknown model family (model_type) {model_type!r}; supported: {sorted(FAMILIES)}")
  return FAMILIES[model_type]
