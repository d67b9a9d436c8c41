"""The articles' troubleshooting checklists as automatic checks: PASS / WARN / FAIL (or SKIP).

Every check takes a `Context` (config, model, parameters) plus the pieces it tests as keyword
arguments whose defaults are the real code, so planted faults (tformer_jax/doctor/faults.py) can be
injected: `attention_fn` (the attention core the model's Attention calls), `apply_fn` (the forward),
`batch_fn` (the data pipeline), `params`. A failing check carries the article's suggested action.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from tformer_jax import config as config_lib
from tformer_jax.data import pipeline
from tformer_jax.doctor import probes
from tformer_jax.model_loading import tokenizer_from_config
from tformer_jax.nn import Transformer
from tformer_jax.train import optim, precision, state as state_lib, step as step_lib

PASS, WARN, FAIL, SKIP = "PASS", "WARN", "FAIL", "SKIP"

# The articles' suggested actions (article 1: core algorithms + checklist; article 2: build + fault tables).
ACTIONS = {
    "data": "Print a batch: labels must be the inputs shifted by one. Misaligned labels keep the loss stuck "
            "a little below chance whatever you tune (article 2, 5.1: check the data pipeline first).",
    "scale": "Divide QK^T by sqrt(d_k), not d_k (trains, but slowly) and not 1 (d_k=64: loss oscillates, "
             "softmax saturates) (article 1, 2.1 and 7.1).",
    "padding": "Fill masked scores with a large negative (-1e9), never 0, and check the mask's direction: "
               "padding keys must get zero weight (article 1, 7.1; article 2, 2.1).",
    "causal": "The causal mask is reversed or missing: query i may only see keys j <= i (article 2, 5.1: "
              "'mask direction reversed' fails silently).",
    "rows": "Softmax over the key axis; each weight row must sum to 1. All-zero rows mean the mask hides "
            "valid keys (article 2, 3.2).",
    "kv_cache": "Compare a full forward with step-by-step cached decoding and find where they diverge: "
                "cache update and position offset (article 2, 4.3 and 5.4).",
    "order": "Make sure the position encoding is added to the input and its gradient is not ~0; a model "
             "without positions cannot learn order (article 2, 5.3; article 1, 8).",
    "activations": "Initialise with std 0.02 and scale residual output projections by 1/sqrt(2 n_layers); "
                   "print each layer's activation mean/std: growth layer by layer is a bug (article 2, 3.4).",
    "lr": "Warm up over 1-5% of the steps, then decay; peak lr about 1e-4..3e-4 (small models a bit more). "
          "Loss oscillating: add warmup, lower the lr (article 2, 4.2; article 1, 7.1).",
    "head_dim": "Keep head_dim around 64: below 32 each head lacks capacity (d_model 256 with 16 heads trained "
                "but validated poorly, article 1, 3.2; article 2, 2.2).",
    "overfit": "A model that cannot overfit one tiny batch has a bug in the model or the training setup: "
               "test each sub-module against a reference before tuning (article 2, 3.3 and 5.1).",
}


@dataclasses.dataclass
class CheckResult:
  name: str
  status: str
  detail: str
  seconds: float = 0.0

  @property
  def action(self) -> str:
    return ACTIONS.get(self.name, "") if self.status in (WARN, FAIL) else ""

  def to_dict(self) -> dict[str, Any]:
    return {"name": self.name, "status": self.status, "detail": self.detail, "action": self.action,
            "seconds": round(self.seconds, 2)}


@dataclasses.dataclass
class Context:
  cfg: ml_collections.ConfigDict
  model: Transformer
  params: Any                 # checkpoint parameters, or a fresh init
  init_params: Any            # always a fresh init (activation and overfit checks are about init)
  seed: int = 0

  @property
  def m(self) -> config_lib.ModelConfig:
    return self.model.cfg

  @property
  def probe_len(self) -> int:
    return max(4, min(12, self.m.max_len))


def make_context(cfg: ml_collections.ConfigDict, params: Any = None, seed: int = 0) -> Context:
  """Validate `cfg`, build the model and a fresh init (params default to it)."""
  m = config_lib.validate(cfg)
  model = Transformer(m)
  tokens = jnp.zeros((1, min(8, m.max_len)), jnp.int32)
  init = nn.unbox(jax.jit(model.init)(jax.random.PRNGKey(seed), tokens)["params"])
  return Context(cfg, model, init if params is None else nn.unbox(params), init, seed)


def _r(name: str, status: str, detail: str) -> CheckResult:
  return CheckResult(name, status, detail)


def default_batch_fn(cfg: ml_collections.ConfigDict, rows: int | None = None) -> Callable[[], dict]:
  """The first training batch of the real data pipeline (optionally only `rows` rows)."""
  def fn() -> dict:
    ds = pipeline.build_dataset(cfg.data)
    batch = next(pipeline.train_iterator(ds, cfg.data))
    batch = {k: np.asarray(v) for k, v in batch.items()}
    return {k: v[:rows] for k, v in batch.items()} if rows else batch
  return fn


# ------------------------------------------------------------------------------------------ checks


def check_data(ctx: Context, *, batch_fn: Callable[[], dict] | None = None, tokenizer: Any = None) -> CheckResult:
  """A decoded batch: targets must be the inputs shifted by one, ids inside the vocabulary."""
  batch = (batch_fn or default_batch_fn(ctx.cfg))()
  x, y = np.asarray(batch["inputs"]), np.asarray(batch["targets"])
  if x.shape != y.shape or x.ndim != 2:
    return _r("data", FAIL, f"inputs {x.shape} and targets {y.shape} must both be (batch, seq_len)")
  if tokenizer is None:
    tokenizer = pipeline.build_dataset(ctx.cfg.data).tokenizer if "data" in ctx.cfg else tokenizer_from_config(ctx.cfg)
  hi = max(int(x.max()), int(y.max()))
  if min(int(x.min()), int(y.min())) < 0 or hi >= ctx.m.vocab_size:
    return _r("data", FAIL, f"token id {hi} outside the model vocabulary [0, {ctx.m.vocab_size})")
  show = lambda ids: repr(tokenizer.decode(ids[:40]))[:60]  # noqa: E731
  text = f"inputs {show(x[0])} / targets {show(y[0])}"
  shifted = float(np.mean(x[:, 1:] == y[:, :-1]))
  same = float(np.mean(x == y))
  mask = batch.get("loss_mask")
  if mask is not None and float(np.sum(mask)) <= 0:
    return _r("data", FAIL, f"loss_mask is all zero: nothing is trained; {text}")
  if shifted == 1.0:
    return _r("data", PASS, f"targets = inputs shifted by one on all {x.shape[0]} rows; {text}")
  if same == 1.0:
    return _r("data", FAIL, f"targets equal the inputs (not shifted by one): the model learns to copy; {text}")
  return _r("data", FAIL, f"targets match the inputs shifted by one at only {shifted:.1%} of positions; {text}")


def check_scale(ctx: Context, *, attention_fn: probes.AttentionFn | None = None) -> CheckResult:
  """The effective softmax scale of the model's attention, measured, equals 1/sqrt(head_dim)."""
  r = probes.measure_scale(ctx.m, attention_fn)
  s, want, hd = r["scale"], r["expected"], r["head_dim"]
  if not np.isfinite(s) or s <= 0:
    return _r("scale", FAIL, f"no usable attention weights on an unmasked probe (all rows zero?): the mask "
              f"hides every key; measured scale {s:.3g}")
  detail = (f"measured scale {s:.5g} = 1/{1 / s:.4g} (1/sqrt(d_k) = 1/{math.sqrt(hd):.4g}); weights vs "
            f"reference at 1/sqrt(d_k): max diff {r['max_diff_vs_reference']:.1e}")
  if abs(s / want - 1.0) < 1e-3:
    return _r("scale", PASS, detail)
  for name, v in (("1/d_k", 1.0 / hd), ("1 (no scaling)", 1.0)):
    if abs(s / v - 1.0) < 1e-3:
      return _r("scale", FAIL, f"softmax scale is {name}, not 1/sqrt(d_k): {detail}")
  return _r("scale", FAIL, f"softmax scale is not 1/sqrt(d_k): {detail}")


def check_padding(ctx: Context, *, attention_fn: probes.AttentionFn | None = None, params: Any = None
                  ) -> CheckResult:
  """Padding keys get exactly zero weight from every real query, in every layer and head."""
  tokens, mask = probes.padded_batch(ctx.m, ctx.probe_len, ctx.seed)
  weights = probes.model_attention(ctx.model, params or ctx.params, tokens, mask, attention_fn)
  m = np.asarray(mask)
  real_query_pad_key = m[:, None, :, None] & ~m[:, None, None, :]          # (B, 1, L, S)
  worst = max(float(np.max(np.where(real_query_pad_key, w, 0.0))) for w in weights)
  detail = f"largest weight a real query gives a padding key: {worst:.2e} (over {len(weights)} layers)"
  if worst <= 1e-6:
    return _r("padding", PASS, detail)
  return _r("padding", FAIL, detail)


def check_causal(ctx: Context, *, attention_fn: probes.AttentionFn | None = None,
                 apply_fn: probes.ApplyFn | None = None, params: Any = None) -> CheckResult:
  """No future leakage: the gradient of position t's logits w.r.t. inputs after t is zero."""
  if not ctx.m.causal:
    return _r("causal", SKIP, "bidirectional encoder (causal=False): every position may see every other")
  r = probes.causal_leak(ctx.model, params or ctx.params, ctx.probe_len, attention_fn, apply_fn, ctx.seed)
  detail = f"|d logits_t / d x_j|, j > t: max {r['future_max']:.2e} ({r['ratio']:.1e} of the largest past gradient)"
  return _r("causal", PASS if r["ratio"] <= 1e-6 else FAIL, detail)


def check_rows(ctx: Context, *, attention_fn: probes.AttentionFn | None = None, params: Any = None
               ) -> CheckResult:
  """Each real query's weights sum to 1 (no all-zero rows, no NaN)."""
  tokens, mask = probes.padded_batch(ctx.m, ctx.probe_len, ctx.seed)
  weights = probes.model_attention(ctx.model, params or ctx.params, tokens, mask, attention_fn)
  real = np.asarray(mask)[:, None, :]
  errs = [np.abs(w.sum(-1) - 1.0)[np.broadcast_to(real, w.shape[:3])] for w in weights]
  worst = max(float(np.max(e)) for e in errs)
  zero_rows = sum(int(np.sum(e >= 1.0 - 1e-6)) for e in errs)
  if not np.isfinite(worst):
    return _r("rows", FAIL, "attention weights contain NaN/inf")
  detail = f"max |row sum - 1| = {worst:.1e} over real queries; {zero_rows} all-zero rows"
  return _r("rows", PASS if worst < 1e-4 else FAIL, detail)


def check_kv_cache(ctx: Context, *, decode_fn: Callable[..., Any] | None = None, params: Any = None
                   ) -> CheckResult:
  """Prefill + one cached step per token gives the logits of a full forward (tformer_jax.decode)."""
  if not ctx.m.causal:
    return _r("kv_cache", SKIP, "encoder: no autoregressive decoding")
  p = params or ctx.params
  l = ctx.probe_len
  tokens = probes.random_tokens(ctx.m, 2, l, ctx.seed)
  full = np.asarray(ctx.model.apply({"params": p}, tokens))
  cached = np.asarray((decode_fn or probes.cached_logits)(ctx.model, p, tokens, l // 2))
  diff = float(np.max(np.abs(full - cached)))
  rel = diff / max(float(np.max(np.abs(full))), 1e-30)
  tol = 1e-4 if ctx.m.dtype == "float32" else 3e-2
  detail = f"prefill {l // 2} + {l - l // 2} cached steps vs full forward: max |diff| {diff:.1e} ({rel:.1e} relative)"
  return _r("kv_cache", PASS if rel <= tol else FAIL, detail)


def check_order(ctx: Context, *, apply_fn: probes.ApplyFn | None = None, params: Any = None) -> CheckResult:
  """The output depends on token order (unless position='none'); learned positions get gradients."""
  p = params or ctx.params
  sens = probes.order_sensitivity(ctx.model, p, ctx.probe_len, apply_fn, ctx.seed)
  detail = f"permuting the tokens (encoder mode) changes the outputs by {sens:.2e} (relative)"
  if ctx.m.position == "none":
    extra = " (only the causal mask carries order)" if ctx.m.causal else ""
    return _r("order", WARN, f"position='none': no position information{extra}; {detail}")
  if ctx.m.position == "learned":
    rows, ratio = probes.position_rows_with_gradient(ctx.model, p, ctx.probe_len, apply_fn, ctx.seed)
    detail += f"; pos_embed rows with gradient {rows}/{ctx.probe_len}, grad norm {ratio:.2e} x embed's"
    if rows < ctx.probe_len:
      return _r("order", FAIL, f"positions are not added (rows without gradient): {detail}")
  if sens < 1e-5:
    return _r("order", FAIL, f"the model is blind to token order: {detail}")
  return _r("order", PASS if sens >= 1e-3 else WARN, detail)


def check_activations(ctx: Context, *, params: Any = None, tokens: Any = None) -> CheckResult:
  """At init, the residual stream's std stays O(1) and does not grow fast with depth."""
  p = params or ctx.init_params
  if tokens is None:
    tokens = probes.random_tokens(ctx.m, 2, min(32, ctx.m.max_len), ctx.seed)
  x0, stds, rms = probes.residual_stds(ctx.model, p, tokens)
  n = len(stds)
  ratio = stds[-1] / max(stds[0], 1e-30)
  growth = max(stds) / max(x0, 1e-30)
  detail = (f"block_out std {stds[0]:.3g} -> {stds[-1]:.3g} over {n} layers (last/first {ratio:.2f}); "
            f"embedding std {x0:.3g}; max RMS {max(rms):.3g}")
  if max(rms) > 10.0 or ratio > 2.0 * n + 1:
    return _r("activations", FAIL, "activations blow up at init: " + detail)
  if ratio > 2.0 * math.sqrt(n) + 1 or growth > 50:
    return _r("activations", WARN, detail)
  return _r("activations", PASS, detail)


def check_lr(ctx: Context) -> CheckResult:
  """Warmup 1-5% of the steps and a peak lr in a sane range (static: the schedule of the config)."""
  o, steps = ctx.cfg.optim, int(ctx.cfg.train.steps)
  warm = optim.warmup_steps(o, steps)
  lr = float(o.peak_lr)
  frac = warm / max(steps, 1)
  detail = f"peak_lr {lr:.1e}, warmup {warm} of {steps} steps ({frac:.1%}), schedule {o.schedule}"
  if warm == 0 and lr > 1e-3:
    return _r("lr", FAIL, "no warmup with a large learning rate: " + detail)
  if lr > 1e-2:
    return _r("lr", FAIL, "learning rate above 1e-2: " + detail)
  if warm == 0:
    return _r("lr", WARN, "no warmup: " + detail)
  if warm >= steps:
    return _r("lr", WARN, "the warmup never ends (warmup >= steps): " + detail)
  if not 0.01 <= frac <= 0.05 or lr > 3e-3 or lr < 1e-5:
    return _r("lr", WARN, "outside the articles' ranges (warmup 1-5%, peak 1e-4..3e-4, small models up to "
              "~3e-3): " + detail)
  return _r("lr", PASS, detail)


def check_head_dim(ctx: Context) -> CheckResult:
  hd = ctx.m.hd
  detail = f"head_dim {hd} ({ctx.m.num_heads} heads, d_model {ctx.m.d_model})"
  return _r("head_dim", WARN if hd < 32 else PASS, detail + (" < 32" if hd < 32 else ""))


def check_overfit(ctx: Context, *, batch_fn: Callable[[], dict] | None = None, steps: int = 40,
                  rows: int = 2, seq: int = 32, lr: float = 3e-3) -> CheckResult:
  """A few dozen steps of the real train step drive the loss on one tiny batch down."""
  batch = (batch_fn or default_batch_fn(ctx.cfg, rows))()
  batch = {k: jnp.asarray(np.asarray(v)[:rows, :seq]) for k, v in batch.items()}
  ocfg = ml_collections.ConfigDict(ctx.cfg.optim.to_dict())
  ocfg.peak_lr, ocfg.warmup_steps, ocfg.warmup_fraction = lr, 5, 0.0
  ocfg.schedule, ocfg.weight_decay, ocfg.grad_accum = "constant", 0.0, 1
  tx, schedule = optim.make_optimizer(ocfg, steps)
  state = state_lib.TrainState(
      step=jnp.zeros((), jnp.int32), params=ctx.init_params, opt_state=tx.init(ctx.init_params),
      loss_scale=precision.get_policy("float32").initial_loss_scale(), rng=jax.random.PRNGKey(ctx.seed),
      bad_steps=jnp.zeros((), jnp.int32), skipped=jnp.zeros((), jnp.int32))
  step = jax.jit(step_lib.make_train_step(ctx.model, tx, schedule, ocfg))
  losses = []
  for _ in range(steps):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  first, last = losses[0], losses[-1]
  detail = f"loss {first:.3f} -> {last:.3f} in {steps} steps on {rows}x{batch['inputs'].shape[1]} tokens (lr {lr:g})"
  if not np.isfinite(last) or last > 0.5 * first:
    return _r("overfit", FAIL, detail)
  return _r("overfit", PASS if last < 0.25 * first else WARN, detail)


CHECKS: dict[str, Callable[..., CheckResult]] = {
    "data": check_data, "scale": check_scale, "padding": check_padding, "causal": check_causal,
    "rows": check_rows, "kv_cache": check_kv_cache, "order": check_order,
    "activations": check_activations, "lr": check_lr, "head_dim": check_head_dim, "overfit": check_overfit,
}


def run_checks(ctx: Context, only: list[str] | None = None, inject: dict[str, dict[str, Any]] | None = None
               ) -> list[CheckResult]:
  """Run the checks (all, or `only`), each with its injected arguments; an error is a FAIL."""
  names = only or list(CHECKS)
  unknown = sorted(set(names) - set(CHECKS))
  if unknown:
    raise ValueError(f"unknown check(s) {unknown}; known: {', '.join(CHECKS)}")
  out = []
  for name in names:
    t0 = time.perf_counter()
    try:
      res = CHECKS[name](ctx, **(inject or {}).get(name, {}))
    except Exception as e:  # noqa: BLE001 - a crashing check is a failed check, reported, not raised
      res = CheckResult(name, FAIL, f"error: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    res.seconds = time.perf_counter() - t0
    out.append(res)
  return out


def format_table(results: list[CheckResult]) -> str:
  lines = [f"{'check':<12} {'status':<6} detail", "-" * 100]
  for r in results:
    lines.append(f"{r.name:<12} {r.status:<6} {r.detail}")
    if r.action:
      lines.append(f"{'':<12} {'':<6} -> {r.action}")
  counts = {s: sum(r.status == s for r in results) for s in (PASS, WARN, FAIL, SKIP)}
  lines.append("-" * 100)
  lines.append(" ".join(f"{k} {v}" for k, v in counts.items()))
  return "\n".join(lines)
