"""`python -m tformer_jax.doctor`: the articles' troubleshooting checklists as automatic checks."""
from tformer_jax.doctor.checks import CHECKS, CheckResult, Context, make_context, run_checks  # noqa: F401
