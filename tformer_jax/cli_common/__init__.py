"""The one command-line syntax of every tool: absl flags, and the experiment config as
`--config=FILE --config.a.b=v` (ml_collections' config_flags), as scripts/train.py spells it.

A command defines its flags in a function and parses its argv with `parse`:

    def define_flags(fv):
      flags.DEFINE_integer("steps", 20, "timed steps", flag_values=fv)

    def main(argv=None):
      args = cli_common.parse(argv, define_flags, doc=__doc__, prog="python -m ...", config="required")
      args.config            # the ConfigDict, overrides applied;  args.steps, args.json, ...

Overrides may stand anywhere on the line, before or after `--config=FILE`; a field's text is parsed by
the field's type (`--config.model.remat=full`, `--config.optim.peak_lr=1e-3`,
`--config.model.scan_layers=false`, `--config.mesh.shape='(2, 2)'`). Where a command takes a
training run (`--workdir=RUN`, `from_workdir=True`) and no `--config`, the config is the run's
config.json over `default_config()`. Every parse uses fresh `FlagValues`, so tests can call several
commands' `main(argv)` in one process. Any usage error, an unknown flag or config field included, is
one line `error: ...` on stderr and exit status 2; an unknown field names the closest valid ones
(`error: model.num_layer: unknown field; did you mean model.num_layers?`).

A command's `__main__` runs under `run_main`, the one map from exceptions to exit statuses: the errors
a user can cause (`ANTICIPATED`: a config rule, data, checkpoints, Orbax/TensorStore storage, HF
conversion, distributed start-up, a stopped run) are one line `error: ...` and status 2; anything
else keeps its traceback:

    if __name__ == "__main__":
      sys.exit(cli_common.run_main(main))      # scripts/train.py: cli_common.exit_process(...)

The package, one job a module: `parsing` (parse, --help, did-you-mean for unknown flags, shared flag
checks), `loading` (config files, a run's config.json, overrides, init_from), `describe`
(--print_config's field descriptions), `errors` (UsageError, run_main's exit statuses), `extras` (a missing
optional extra in one line: `require_extra`).
"""
from tformer_jax.cli_common.describe import describe_config, enum_doc, enum_fields, field_docs
from tformer_jax.cli_common.errors import (
  ANTICIPATED,
  STORAGE_PACKAGES,
  UsageError,
  error_message,
  exit_process,
  fail,
  one_line,
  run_main,
  setup_logging,
)
from tformer_jax.cli_common.extras import EXTRAS, extra_message, missing_module, require_extra
from tformer_jax.cli_common.loading import (
  CONFIG_HINT,
  REPO,
  check_overrides,
  config_dirs,
  find_config_file,
  load_config,
  load_named_config,
  override,
  resolve_source,
  shipped_configs,
  workdir_config,
)
from tformer_jax.cli_common.parsing import HELP_FLAGS, check_model_source, choices, help_text, parse, unknown_flag_hint

__all__ = [
    "ANTICIPATED", "CONFIG_HINT", "EXTRAS", "HELP_FLAGS", "REPO", "STORAGE_PACKAGES", "UsageError",
    "check_model_source", "check_overrides", "choices", "config_dirs", "describe_config", "enum_doc", "enum_fields",
    "error_message", "exit_process", "extra_message", "fail", "field_docs", "find_config_file", "help_text",
    "load_config", "load_named_config", "missing_module", "one_line", "override", "parse", "require_extra",
    "resolve_source", "run_main", "setup_logging", "shipped_configs", "unknown_flag_hint", "workdir_config",
]
