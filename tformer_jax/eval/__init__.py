"""Evaluation on EleutherAI's lm-evaluation-harness (the optional `eval` extra).

`harness` holds the `tformer` model class (it imports lm_eval: import it only when the extra is
installed); `tasks/` the shipped local tasks, whose data `shakespeare_tasks` builds.
"""
