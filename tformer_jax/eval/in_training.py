"""train.eval_tasks: lm-evaluation-harness tasks at each evaluation of the training loop.

`HarnessEval(cfg, model, tokenizer)` checks the task names once, before the first step (an unknown
one is a ConfigError); calling it with the current host params runs `lm_eval.simple_evaluate` with
one `harness.TformerLM` kept for the whole run (its compiled steps are reused from one evaluation to
the next) and returns {'harness/<task>/<metric>': value}, the numbers the loop logs with the loss.
"""
from __future__ import annotations

import logging
from typing import Any

import flax.linen as nn

from tformer_jax import config as config_lib

log = logging.getLogger(__name__)


def task_names(text: str) -> list[str]:
  return [t.strip() for t in str(text or "").split(",") if t.strip()]


class HarnessEval:
  """The harness tasks of cfg.train.eval_tasks on the training model (module docstring)."""

  def __init__(self, cfg: Any, model: Any, tokenizer: Any):
    from tformer_jax.eval import harness  # noqa: PLC0415 (imports lm_eval: only for a run that asks for it)
    self.names = task_names(cfg.train.get("eval_tasks", ""))
    self.manager, unknown = harness.task_manager_for(self.names)
    if unknown:
      raise config_lib.ConfigError(f"train.eval_tasks: unknown harness task {unknown[0]!r} (the shipped ones: "
                                   f"{', '.join(harness.shipped_tasks())})")
    self.limit = int(cfg.train.get("eval_tasks_limit", 0)) or None
    logging.getLogger("lm_eval").setLevel(logging.WARNING)    # its INFO lines would drown the loop's
    self.lm = harness.TformerLM(model=model, params={}, tokenizer=tokenizer, config=cfg,
                                batch_size=int(cfg.data.batch_size))

  def __call__(self, params: Any) -> dict[str, float]:
    import lm_eval  # noqa: PLC0415 (the optional eval extra)
    self.lm.params = nn.unbox(params)
    res = lm_eval.simple_evaluate(model=self.lm, tasks=self.names, limit=self.limit, task_manager=self.manager,
                                  log_samples=False, bootstrap_iters=0)
    out = {}
    for task, metrics in res["results"].items():
      for key, value in metrics.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and "stderr" not in key:
          out[f"harness/{task}/{key.split(',')[0]}"] = float(value)
    return out
