"""What the parts of the HF interop share: HFWeightsError, the logger, the listing limit."""
from __future__ import annotations

import logging

log = logging.getLogger("tformer_jax.interop.hf")   # one logger for the package
_MAX_LISTED = 20


class HFWeightsError(ValueError):
  """Weights that cannot be imported: a malformed or unsafe file, or tensors that are missing, unexpected,
  mis-shaped or disagree with config.json (one line naming the file and the tensor or field)."""
