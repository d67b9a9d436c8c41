"""Which attention implementation serves which model feature: `supports(impl, model)` (config validation),
`attention_unsupported` (resolve_runtime's 'auto', the backend's per-call choice)."""
from __future__ import annotations

from typing import Iterable

from tformer_jax.config.enums import ATTENTION_LACKS
from tformer_jax.config.errors import _either, _fail
from tformer_jax.config.schema import ModelConfig


def attention_features(m: ModelConfig) -> frozenset[str]:
  """The model's features that not every attention implementation has (keys of `_LACKS_RULE`)."""
  return frozenset(name for name, on in (
      ("dropout", m.attn_dropout > 0), ("dense_bias", m.position == "t5"),
      ("global_tokens", m.num_global_tokens > 0), ("random_blocks", m.random_blocks > 0),
      ("alibi", m.position == "alibi"), ("softcap", m.attn_softcap > 0), ("sinks", m.attention_sinks)) if on)


# The rule broken when an implementation lacks a feature ({impl}: it, {servers}: those that have it).
_LACKS_RULE = {
    "dropout": "model.attn_dropout > 0 is implemented by the {servers} attention only, got {impl!r}",
    "dense_bias": "{impl!r} takes no dense bias; T5 relative bias needs {servers}",
    "global_tokens": "{impl!r} has no global tokens; model.num_global_tokens needs {servers}",
    "random_blocks": "{impl!r} has no random blocks; model.random_blocks needs {servers}",
    "alibi": "{impl!r} takes no ALiBi bias; position='alibi' needs {servers}",
    "softcap": "{impl!r} has no attention soft cap; model.attn_softcap needs {servers}",
    "sinks": "{impl!r} has no attention sinks; model.attention_sinks needs {servers}",
}


def attention_unsupported(impl: str, features: Iterable[str]) -> str | None:
  """Why attention implementation `impl` cannot serve a model (or call) with these features, as the
  rule it breaks; None when it can."""
  for feature in _LACKS_RULE:   # one order, so the message is stable
    if feature in features and feature in ATTENTION_LACKS[impl]:
      servers = [repr(i) for i, lacks in ATTENTION_LACKS.items() if feature not in lacks]
      return _LACKS_RULE[feature].format(impl=impl, servers=_either(servers))
  return None


def supports(impl: str, m: ModelConfig) -> None:
  """Raises ConfigError('runtime.attention: ...') when attention implementation `impl` cannot serve
  model `m` (its dropout, T5 bias, global tokens, random blocks, ALiBi, soft cap or sinks)."""
  why = attention_unsupported(impl, attention_features(m))
  if why:
    _fail("runtime.attention", why)
