"""Measurements the doctor's checks are built on, each through the model's real code path.

Injection points (the defaults are the real code):
  attention_fn  replaces the backend's attention (`tformer_jax.backends.Backend.attention`, same
                signature: (q, k, v, vis, *, bias_BxHxLxS, alibi_slopes_H, scale, dropout_rate,
                dropout_rng, want_weights) -> (out, weights or None)) while a probe runs, so the
                model's own Attention module builds q/k/v, the visibility and the scale and calls it.
                Without one, probes run the reference backend (the one that returns weights).
  apply_fn      (model, params, tokens, **kwargs) -> logits, instead of `model.apply`.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tformer_jax import backends
from tformer_jax.config import ModelConfig, RopeScaling
from tformer_jax.decode import init_cache
from tformer_jax.nn.attention import Attention
from tformer_jax.nn.transformer import sown_per_layer
from tformer_jax.ops import attention as attn_ops

AttentionFn = Callable[..., Any]
ApplyFn = Callable[..., jax.Array]


@dataclasses.dataclass(frozen=True)
class ProbeBackend(backends.Backend):
  """The reference backend whose attention is `fn` (a planted fault, or any other attention)."""
  fn: AttentionFn | None = None

  def attention(self, q_BxLxHxD, k_BxSxKxD, v_BxSxKxD, vis, **kw):
    return self.fn(q_BxLxHxD, k_BxSxKxD, v_BxSxKxD, vis, **kw)


@contextlib.contextmanager
def attention_override(fn: AttentionFn | None) -> Iterator[None]:
  """Within the block the model runs on the reference backend, its Attention modules calling `fn`
  instead of the backend's attention when given. Trace (jit) inside the block."""
  with backends.use(backends.Backend() if fn is None else ProbeBackend(fn=fn)):
    yield


def default_apply(model: nn.Module, params: Any, tokens: jax.Array, **kw: Any) -> jax.Array:
  return model.apply({"params": params}, tokens, **kw)


def random_tokens(m: ModelConfig, batch: int, length: int, seed: int = 0) -> jax.Array:
  return jax.random.randint(jax.random.PRNGKey(seed), (batch, length), 0, m.vocab_size, jnp.int32)


# ----------------------------------------------------------------------------------- softmax scale


def _probe_config(m: ModelConfig) -> ModelConfig:
  """A bare attention layer of the model: same heads, head_dim and scale; no positions, no mask
  beyond padding, float32; d_model = heads x head_dim so identity projections expose q and k."""
  return dataclasses.replace(
      m, d_model=m.num_heads * m.hd, position="none", rope_scaling=RopeScaling(), causal=False, window=0,
      num_global_tokens=0, qkv_bias=False, out_bias=False, dtype="float32", param_dtype="float32",
      attn_dropout=0.0)


def measure_scale(m: ModelConfig, attention_fn: AttentionFn | None = None, length: int = 12,
                  seed: int = 0) -> dict[str, float]:
  """Fit the softmax scale the model's Attention actually applies.

  Identity projections make q = x[:, :, h] and k = x[:, :, g(h)]; then for every row
  log w_ij - mean_j log w_ij = s * (q_i.k_j - mean_j q_i.k_j), and s is the least-squares slope.
  Also returns the largest difference from `dot_product_attention` at 1/sqrt(head_dim).
  """
  pm = _probe_config(m)
  h, kh, hd, d = pm.num_heads, pm.kv_heads, pm.hd, pm.d_model
  eye = jnp.eye(d, dtype=jnp.float32)
  params = {"wq": eye.reshape(d, h, hd), "wk": eye[:, :kh * hd].reshape(d, kh, hd),
            "wv": eye[:, :kh * hd].reshape(d, kh, hd), "wo": eye.reshape(h, hd, d)}
  x_1xLxD = 0.5 * jax.random.normal(jax.random.PRNGKey(seed), (1, length, d), jnp.float32)
  pos = jnp.arange(length)[None]
  valid = jnp.ones((1, length), bool)
  with attention_override(attention_fn):
    _, mut = Attention(pm).apply({"params": params}, x_1xLxD, pos, valid, mutable=["intermediates"])
  w_HxLxS = np.asarray(mut["intermediates"]["attention_weights"][0][0], np.float64)
  q_LxHxD = np.asarray(x_1xLxD[0]).reshape(length, h, hd)
  k_LxKxD = np.asarray(x_1xLxD[0, :, :kh * hd]).reshape(length, kh, hd)
  k_LxHxD = np.repeat(k_LxKxD, h // kh, axis=1)
  logits_HxLxS = np.einsum("lhd,shd->hls", q_LxHxD, k_LxHxD)
  ok = w_HxLxS > 1e-30
  logw = np.log(np.where(ok, w_HxLxS, 1.0))
  y = logw - np.sum(logw * ok, -1, keepdims=True) / np.maximum(ok.sum(-1, keepdims=True), 1)
  z = logits_HxLxS - np.sum(logits_HxLxS * ok, -1, keepdims=True) / np.maximum(ok.sum(-1, keepdims=True), 1)
  scale = float(np.sum(y * z * ok) / max(np.sum(z * z * ok), 1e-30))
  ref = np.asarray(attn_ops.attention_weights(jnp.asarray(q_LxHxD[None], jnp.float32),
                                              jnp.asarray(k_LxKxD[None], jnp.float32))[0])
  return {"scale": scale, "expected": float(1.0 / np.sqrt(hd)), "head_dim": float(hd),
          "max_diff_vs_reference": float(np.max(np.abs(w_HxLxS - ref)))}


# ------------------------------------------------------------------------- masks through the model


def padded_batch(m: ModelConfig, length: int = 12, seed: int = 0) -> tuple[jax.Array, jax.Array]:
  """(tokens (2, L), mask (2, L)): row 0 left-padded by 4, row 1 right-padded by 3."""
  tokens = random_tokens(m, 2, length, seed)
  mask = np.ones((2, length), bool)
  mask[0, :4] = False
  mask[1, length - 3:] = False
  return tokens, jnp.asarray(mask)


def sown(model: nn.Module, params: Any, tokens_BxL: jax.Array, name: str, **apply_kwargs: Any
         ) -> tuple[jax.Array, list[jax.Array]]:
  """(model output, the per-layer values sown under `name` in 'intermediates')."""
  out, mut = model.apply({"params": params}, tokens_BxL, mutable=["intermediates"], **apply_kwargs)
  return out, sown_per_layer(mut.get("intermediates", {}), name)


def model_attention(model: nn.Module, params: Any, tokens: jax.Array, mask: jax.Array | None = None,
                    attention_fn: AttentionFn | None = None) -> list[np.ndarray]:
  """Per-layer weights (B, H, L, S) of the whole model (sown by its Attention modules), optionally
  with an injected attention fn."""
  kw = {} if mask is None else {"attention_mask_BxL": mask}
  with attention_override(attention_fn):   # traced (fresh) inside the override
    _, weights = jax.jit(lambda p, t, k: sown(model, p, t, "attention_weights", **k))(
        nn.unbox(params), tokens, kw)
  if not weights:
    raise ValueError("no attention weights were sown: the attention returned none")
  return [np.asarray(w) for w in weights]


def causal_leak(model: nn.Module, params: Any, length: int = 12, attention_fn: AttentionFn | None = None,
                apply_fn: ApplyFn | None = None, seed: int = 0) -> dict[str, float]:
  """Gradient test: d logits[t] / d input embedding[j] for j > t must be exactly zero.

  One VJP per position t (vmapped) through the model with inputs_embeds; returns the largest
  future-gradient norm relative to the largest past-gradient norm.
  """
  params = nn.unbox(params)
  apply_fn = apply_fn or default_apply
  tokens = random_tokens(model.cfg, 1, length, seed)
  emb_1xLxD = jnp.take(params["embed"], tokens, axis=0).astype(jnp.float32)

  def f(e):
    return apply_fn(model, params, tokens, inputs_embeds_BxLxD=e)

  @jax.jit
  def grads(e):
    logits, vjp = jax.vjp(f, e)
    r_V = jax.random.normal(jax.random.PRNGKey(seed + 1), (logits.shape[-1],), jnp.float32)
    cot_LxBxLxV = jnp.eye(length, dtype=jnp.float32)[:, None, :, None] * r_V
    (g_LxBxLxD,) = jax.vmap(vjp)(cot_LxBxLxV)
    return jnp.linalg.norm(g_LxBxLxD[:, 0], axis=-1)               # (t, j)

  with attention_override(attention_fn):
    g = np.asarray(grads(emb_1xLxD))
  future = np.triu(np.ones((length, length), bool), k=1)
  past = max(float(np.max(g[~future])), 1e-30)
  return {"future_max": float(np.max(g[future])), "past_max": past,
          "ratio": float(np.max(g[future])) / past}


def order_sensitivity(model: nn.Module, params: Any, length: int = 12, apply_fn: ApplyFn | None = None,
                      seed: int = 0) -> float:
  """Relative change of the outputs under a permutation of the tokens, in encoder mode.

  The model is run with causal=False (same parameters): attention alone is then permutation
  equivariant, so outputs(permuted tokens) == permuted outputs exactly unless positions enter.
  (A causal mask by itself leaks order after the first layer, so the test isolates the positions.)
  """
  enc = model.clone(cfg=dataclasses.replace(model.cfg, causal=False, window=0, num_global_tokens=0))
  fn = apply_fn or default_apply
  run = jax.jit(lambda p, t: fn(enc, p, t))
  params = nn.unbox(params)
  tokens = random_tokens(model.cfg, 1, length, seed)
  perm = np.random.default_rng(seed).permutation(length)
  a = np.asarray(run(params, tokens)[:, perm], np.float64)
  b = np.asarray(run(params, tokens[:, perm]), np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(a - a.mean()), 1e-30))


def position_rows_with_gradient(model: nn.Module, params: Any, length: int = 12,
                                apply_fn: ApplyFn | None = None, seed: int = 0) -> tuple[int, float]:
  """(rows of pos_embed among 0..L-1 with a nonzero LM-loss gradient, its gradient norm / the token
  embedding's). Every position used must get a gradient: a stuck row is a position not added."""
  apply_fn = apply_fn or default_apply
  params = nn.unbox(params)
  tokens = random_tokens(model.cfg, 2, length + 1, seed)

  def loss(p):
    logits = apply_fn(model, p, tokens[:, :-1])
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))

  g = jax.jit(jax.grad(loss))(params)
  rows = np.asarray(jnp.linalg.norm(g["pos_embed"][:length], axis=-1))
  ratio = float(jnp.linalg.norm(g["pos_embed"]) / jnp.maximum(jnp.linalg.norm(g["embed"]), 1e-30))
  return int(np.sum(rows > 0)), ratio


# ---------------------------------------------------------------------------- activations at init


def residual_stds(model: nn.Module, params: Any, tokens: jax.Array) -> tuple[float, list[float], list[float]]:
  """(std of the embedding output, std and RMS of every block's output) on `tokens`."""
  params = nn.unbox(params)
  m = model.cfg
  stem = model.clone(cfg=dataclasses.replace(m, num_layers=0, final_norm=False, lm_head=False,
                                             scan_layers=False))
  x0 = jax.jit(stem.apply)({"params": params}, tokens)
  _, outs = jax.jit(lambda p, t: sown(model, p, t, "block_out"))(params, tokens)
  outs = [np.asarray(o, np.float64) for o in outs]
  return (float(np.std(np.asarray(x0))), [float(np.std(o)) for o in outs],
          [float(np.sqrt(np.mean(o * o))) for o in outs])


# -------------------------------------------------------------------------------------- KV cache


def cached_logits(model: nn.Module, params: Any, tokens: jax.Array, prefill: int) -> jax.Array:
  """Logits of `tokens` computed as the decoder does: prefill, then one cached step per token."""
  params = nn.unbox(params)
  b, l = tokens.shape
  cache = init_cache(model, params, b, l)

  @jax.jit
  def run(c, t):
    out, mut = model.apply({"params": params, "cache": c}, t, decode=True, mutable=["cache"])
    return out, mut["cache"]

  first, cache = run(cache, tokens[:, :prefill])
  outs = [first]
  for i in range(prefill, l):
    step, cache = run(cache, tokens[:, i:i + 1])
    outs.append(step)
  return jnp.concatenate(outs, axis=1)
