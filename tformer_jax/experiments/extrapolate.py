"""Length extrapolation of position schemes: train at length L, evaluate at L, 2L, 4L, 8L.

For each scheme a small byte-level model is trained on Shakespeare at `train_len` (same data order,
same init seed, same optimizer), then evaluated on fixed validation windows of every length: the loss
is the mean next-token NLL over all positions of each window (so a longer window mixes in-distribution
early positions with unseen far ones, as in the ALiBi paper's evaluation).

Schemes: none (NoPE: causal attention alone), sinusoidal, learned, rope, rope_ntk (the *same* trained
RoPE parameters, evaluated with NTK-aware scaling, factor = eval_len / train_len), alibi, t5.
Learned absolute positions have no embedding past max_len = train_len: their longer lengths are
reported as 'n/a (cannot extrapolate)'. (The alternative, interpolating or tiling the table, is a
different method, not extrapolation.)
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tformer_jax.config import ModelConfig, RopeScaling, default_config, validate_model
from tformer_jax.data import pipeline
from tformer_jax.nn import Transformer
from tformer_jax.train import optim, precision, state as state_lib, step as step_lib

SCHEMES = ("none", "sinusoidal", "learned", "rope", "rope_ntk", "alibi", "t5")
NA = "n/a (cannot extrapolate)"


def model_config(scheme: str, *, train_len: int, d_model: int, layers: int, heads: int) -> ModelConfig:
  """The model trained for `scheme` (rope_ntk trains as rope; the scaling is applied at evaluation)."""
  position = "rope" if scheme == "rope_ntk" else scheme
  if position not in ("none", "sinusoidal", "learned", "rope", "alibi", "t5"):
    raise ValueError(f"unknown scheme {scheme!r}; expected one of {SCHEMES}")
  m = ModelConfig(vocab_size=256, d_model=d_model, num_layers=layers, num_heads=heads,
                  position=position, max_len=train_len, norm="rmsnorm", activation="gelu_tanh")
  validate_model(m)
  return m


def eval_config(m: ModelConfig, scheme: str, eval_len: int, train_len: int) -> ModelConfig:
  """The config used to evaluate at `eval_len` (NTK scaling for rope_ntk; learned stays at max_len)."""
  if scheme == "rope_ntk":
    factor = max(1.0, eval_len / train_len)
    return dataclasses.replace(m, rope_scaling=RopeScaling(type="ntk", factor=factor))
  return m


def windows(tokens: np.ndarray, length: int, count: int) -> np.ndarray:
  """`count` evenly spaced windows of length+1 tokens (inputs + shifted targets) over `tokens`."""
  last = len(tokens) - (length + 1)
  if last < 0:
    raise ValueError(f"validation split has {len(tokens)} tokens, fewer than {length + 1}")
  starts = np.linspace(0, last, count).round().astype(np.int64)
  return np.stack([tokens[s:s + length + 1] for s in starts]).astype(np.int32)


def train_model(m: ModelConfig, ds, *, train_len: int, steps: int, batch_size: int, lr: float,
                seed: int) -> tuple[Any, dict[str, float]]:
  """Train one model with the real train step; returns (params, {final_train_loss, train_s})."""
  c = default_config()
  c.optim.peak_lr, c.optim.warmup_steps = lr, max(1, min(100, steps // 10))
  model = Transformer(m)
  tx, schedule = optim.make_optimizer(c.optim, steps)
  init = state_lib.init_fn(model, tx, precision.get_policy("float32").initial_loss_scale(), train_len)
  state = jax.jit(lambda r: state_lib.unbox_plain(init(r)))(jax.random.PRNGKey(seed))
  step = jax.jit(step_lib.make_train_step(model, tx, schedule, c.optim), donate_argnums=(0,))
  data_cfg = dict(corpus="shakespeare", seq_len=train_len, batch_size=batch_size, seed=seed)
  it = pipeline.train_iterator(ds, data_cfg)
  t0 = time.perf_counter()
  losses = []
  for _ in range(steps):
    state, metrics = step(state, {k: jnp.asarray(v) for k, v in next(it).items()})
    losses.append(metrics["loss"])
  final = float(np.mean([float(x) for x in losses[-min(20, steps):]]))
  return state.params, {"train_loss": final, "train_s": time.perf_counter() - t0}


def evaluate(m: ModelConfig, params: Any, data: np.ndarray, batch_size: int) -> float:
  """Mean NLL over every position of every window in `data` (N, length+1)."""
  model = Transformer(m)

  @jax.jit
  def nll_sum(p, w):
    logits = model.apply({"params": p}, w[:, :-1])
    return jnp.sum(step_lib.cross_entropy(logits, w[:, 1:]))

  total = sum(float(nll_sum(params, jnp.asarray(data[i:i + batch_size])))
              for i in range(0, len(data), batch_size))
  return total / (data.shape[0] * (data.shape[1] - 1))


def run(*, schemes: Sequence[str] = SCHEMES, train_len: int = 64, steps: int = 300,
        d_model: int = 128, layers: int = 2, heads: int = 4, batch_size: int = 16, lr: float = 2e-3,
        eval_mults: Sequence[int] = (1, 2, 4, 8), eval_windows: int = 32, eval_batch: int = 8,
        seed: int = 0, out: str | pathlib.Path | None = None, log=print) -> dict[str, Any]:
  """Train every scheme, evaluate at every length; write extrapolation.{md,json,png} to `out`."""
  ds = pipeline.build_dataset(dict(corpus="shakespeare", seq_len=train_len * max(eval_mults)))
  evals = {k: windows(ds.val_tokens, k * train_len, eval_windows) for k in eval_mults}
  trained: dict[str, tuple[Any, dict[str, float]]] = {}
  rows = []
  for scheme in schemes:
    m = model_config(scheme, train_len=train_len, d_model=d_model, layers=layers, heads=heads)
    key = "rope" if scheme == "rope_ntk" else scheme
    if key not in trained:
      log(f"[{scheme}] training {steps} steps at length {train_len}")
      trained[key] = train_model(m, ds, train_len=train_len, steps=steps, batch_size=batch_size,
                                 lr=lr, seed=seed)
    params, info = trained[key]
    loss: dict[str, float | None] = {}
    for k in eval_mults:
      length = k * train_len
      if m.position == "learned" and length > m.max_len:
        loss[str(k)] = None
        continue
      loss[str(k)] = evaluate(eval_config(m, scheme, length, train_len), params, evals[k], eval_batch)
    log(f"[{scheme}] train loss {info['train_loss']:.3f}; eval " +
        ", ".join(f"{k}L={_fmt(v)}" for k, v in loss.items()))
    rows.append({"scheme": scheme, "loss": loss, **info})
  result = {"train_len": train_len, "eval_mults": list(eval_mults), "eval_windows": eval_windows,
            "steps": steps, "d_model": d_model, "layers": layers, "heads": heads,
            "batch_size": batch_size, "lr": lr, "seed": seed, "rows": rows}
  if out is not None:
    write_outputs(result, pathlib.Path(out))
  return result


def _fmt(v: float | None) -> str:
  return NA if v is None else f"{v:.3f}"


def markdown_table(result: dict[str, Any]) -> str:
  """Validation loss (nats/byte) per scheme and evaluation length."""
  lt = result["train_len"]
  heads = [f"{k}L = {k * lt}" if k > 1 else f"L = {lt}" for k in result["eval_mults"]]
  lines = ["| scheme | " + " | ".join(heads) + " | train loss | train s |",
           "|---" * (len(heads) + 3) + "|"]
  for r in result["rows"]:
    cells = [_fmt(r["loss"][str(k)]) for k in result["eval_mults"]]
    lines.append(f"| {r['scheme']} | " + " | ".join(cells) + f" | {r['train_loss']:.3f} | {r['train_s']:.0f} |")
  return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: pathlib.Path) -> None:
  import matplotlib  # noqa: PLC0415 (heavy; only the plot needs it)
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415 (after matplotlib.use("Agg"))
  fig, ax = plt.subplots(figsize=(6.4, 4.2))
  lt = result["train_len"]
  for r in result["rows"]:
    pts = [(k * lt, r["loss"][str(k)]) for k in result["eval_mults"] if r["loss"][str(k)] is not None]
    xs, ys = zip(*pts)
    ax.plot(xs, ys, marker="o", label=r["scheme"])
  ax.axvline(lt, color="gray", linestyle=":", linewidth=1)
  ax.set_xscale("log", base=2)
  ax.set_xlabel("evaluation length (tokens)")
  ax.set_ylabel("validation loss (nats/byte)")
  ax.set_title(f"Length extrapolation (trained at L={lt}, {result['steps']} steps)")
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def write_outputs(result: dict[str, Any], out: pathlib.Path) -> None:
  out.mkdir(parents=True, exist_ok=True)
  (out / "extrapolation.json").write_text(json.dumps(result, indent=2))
  r = result
  header = (f"Validation loss (nats/byte, mean over all positions of {r['eval_windows']} windows) after "
            f"{r['steps']} steps at L={r['train_len']}; d_model={r['d_model']}, layers={r['layers']}, "
            f"heads={r['heads']}, batch={r['batch_size']}, lr={r['lr']}, seed={r['seed']}.\n\n")
  (out / "extrapolation.md").write_text(header + markdown_table(result))
  plot(result, out / "extrapolation.png")

