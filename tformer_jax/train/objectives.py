"""The masked-LM objective of encoders (causal=False), applied to a batch inside the jitted step.

  batch = masked_lm_batch(batch, rng, model_cfg)   # inputs corrupted; targets, loss_mask: the chosen

BERT (Devlin et al., 2019): choose 15% of the real tokens; of those, 80% become [MASK], 10% a random
token and 10% stay as they are; the loss is the NLL of the original token at the chosen positions
only. A pure function of (tokens, rng): the data pipeline stays the one every model shares and a
resumed run draws the same masks (the rng is the train step's). Evaluation draws from a fixed key
(`eval_rng`), so every evaluation of a batch masks the same positions. The [MASK] id is
model.mask_token_id (-1: vocab_size - 1, an id the tokenizer must not use: `check_mask_token`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from tformer_jax.config import ConfigError, ModelConfig

MASK_RATE = 0.15       # share of the real tokens chosen for prediction
MASK_SPLIT = 0.8, 0.1  # of the chosen: [MASK], a random token; the rest (0.1) unchanged
EVAL_SEED = 0


def mask_token_id(cfg: ModelConfig) -> int:
  """The [MASK] id: model.mask_token_id, or vocab_size - 1 when it is -1."""
  return cfg.mask_token_id if cfg.mask_token_id >= 0 else cfg.vocab_size - 1


def check_mask_token(cfg: ModelConfig, tokenizer_vocab: int) -> None:
  """ConfigError when the default [MASK] id (vocab_size - 1) is one of the tokenizer's own ids."""
  if cfg.causal or cfg.mask_token_id >= 0 or cfg.vocab_size > tokenizer_vocab:
    return
  raise ConfigError(f"model.vocab_size: an encoder's masked-LM needs an id for [MASK]; vocab_size={cfg.vocab_size} "
                    f"leaves none beyond the tokenizer's {tokenizer_vocab} ids: set --config.model.vocab_size="
                    f"{tokenizer_vocab + 1} (the last id is [MASK]) or model.mask_token_id=<the tokenizer's [MASK] id>")


def bert_mask(tokens_BxL: jax.Array, real_BxL: jax.Array, rng: jax.Array, *, vocab_size: int, mask_id: int,
              rate: float = MASK_RATE) -> tuple[jax.Array, jax.Array]:
  """(inputs_BxL, chosen_BxL): each real token is chosen with probability `rate`; a chosen token
  becomes mask_id (80%), a uniformly random id other than mask_id (10%) or stays (10%)."""
  k_choose, k_kind, k_random = jax.random.split(rng, 3)
  chosen_BxL = jax.random.bernoulli(k_choose, rate, tokens_BxL.shape) & real_BxL.astype(bool)
  u_BxL = jax.random.uniform(k_kind, tokens_BxL.shape)
  random_BxL = jax.random.randint(k_random, tokens_BxL.shape, 0, vocab_size - 1, tokens_BxL.dtype)
  random_BxL = random_BxL + (random_BxL >= mask_id).astype(tokens_BxL.dtype)   # skip mask_id
  to_mask, to_random = MASK_SPLIT
  new_BxL = jnp.where(u_BxL < to_mask, jnp.asarray(mask_id, tokens_BxL.dtype),
                      jnp.where(u_BxL < to_mask + to_random, random_BxL, tokens_BxL))
  return jnp.where(chosen_BxL, new_BxL, tokens_BxL), chosen_BxL


def masked_lm_batch(batch: dict, rng: jax.Array, cfg: ModelConfig) -> dict:
  """The batch for an encoder: batch['inputs'] (the pipeline's token windows) masked by `bert_mask`;
  targets = the original tokens, loss_mask = the chosen positions. Real tokens: all, or with packed
  documents (segment_ids) those of segment != 0 (0 = padding)."""
  tokens_BxL = batch["inputs"]
  seg = batch.get("segment_ids")
  real_BxL = jnp.ones(tokens_BxL.shape, bool) if seg is None else seg != 0
  inputs_BxL, chosen_BxL = bert_mask(tokens_BxL, real_BxL, rng, vocab_size=cfg.vocab_size,
                                     mask_id=mask_token_id(cfg))
  return {**batch, "inputs": inputs_BxL, "targets": tokens_BxL, "loss_mask": chosen_BxL.astype(jnp.float32)}


def eval_rng(batch: dict) -> jax.Array:
  """The masking key of an evaluation batch: fixed (EVAL_SEED), folded with the batch's token sum so
  that different batches mask different positions and the same batch always the same ones."""
  total = jnp.sum(batch["inputs"].astype(jnp.uint32))
  return jax.random.fold_in(jax.random.PRNGKey(EVAL_SEED), total)
