"""Diagnostics from the articles' checklists: attention maps (attention_maps, plots), training-time
statistics (stats), memory/FLOPs estimates next to XLA (estimate), step timing (timing), ablations
(ablate). The automatic checklist itself is `python -m tformer_jax.doctor`."""
