"""Diagnostics from the articles' checklists: attention maps (attention_maps, plots), training-time
statistics (train/stats.py), step timing (timing), ablations (ablate); the memory/FLOP estimator is
tformer_jax/analysis/estimate (tformer-estimate). The automatic checklist itself is `python -m tformer_jax.doctor`."""
