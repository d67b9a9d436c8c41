"""Linen modules: parameters with logical axis names, computation delegated to `tformer_jax.ops`."""
from tformer_jax.nn.transformer import Transformer  # noqa: F401
