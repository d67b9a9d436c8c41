"""A data section's field, or the schema's default for it (tformer_jax/config/schema.py `default_config().data`:
the one owner of the data defaults and choices)."""
from __future__ import annotations

import functools
from typing import Any

from tformer_jax import config as config_lib

PACKINGS = config_lib.PACKINGS
SAMPLINGS = config_lib.SAMPLINGS


@functools.cache
def _defaults() -> dict[str, Any]:
  return dict(config_lib.default_config().data)


def setting(data_cfg: Any, name: str) -> Any:
  """data_cfg[name], or its default when `data_cfg` (a ConfigDict, a dict) lacks it."""
  try:
    return data_cfg[name]
  except (KeyError, AttributeError):
    return _defaults()[name]
