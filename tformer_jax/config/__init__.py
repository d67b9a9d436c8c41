"""The config schema: ml_collections ConfigDicts for experiments, frozen dataclasses for the model.

`default_config()` is the full schema with defaults; experiment files in `configs/` start from it and
override fields. `validate(cfg)` checks every field a user can set (an unknown name gets the closest
valid ones), before anything compiles or touches a workdir, and raises `ConfigError('<field>: <rule>')`.
`ModelConfig.from_config(cfg.model)` is what the linen modules receive.

Two kinds of settings: `model` is the architecture (the function the network computes: what
checkpoints and HF export care about); `runtime` is how this run executes it (backend, attention
implementation and tiles, C++ CPU kernels), resolved once per run by `backends.resolve_runtime`.
"""
from __future__ import annotations

from tformer_jax.config.attention import (
    attention_features,
    attention_unsupported,
    supports,
)
from tformer_jax.config.enums import (
    ACTIVATIONS,
    ATTENTION_LACKS,
    ATTENTIONS,
    AUTO_ON_OFF,
    CONTEXT_STRATEGIES,
    CORPORA,
    CORPUS_PREFIXES,
    CORPUS_SHOWN,
    DECODE_LAYOUTS,
    DTYPES,
    GLU_ACTIVATIONS,
    LEGACY_RUNTIME_FIELDS,
    LOGGERS,
    MOE_DISPATCH,
    MOE_ROUTERS,
    NON_ARCHITECTURE_FIELDS,
    NORM_POSITIONS,
    NORMS,
    OPTIMIZERS,
    PACKINGS,
    PARALLELISMS,
    POSITIONS,
    PRECISIONS,
    REMAT_NAMES,
    REMAT_POLICIES,
    ROPE_LAYOUTS,
    ROPE_SCALING_FIELDS,
    ROPE_SCALINGS,
    RULE_PRESETS,
    RUNTIME_ATTENTION,
    RUNTIME_BACKENDS,
    RUNTIME_CPU_BLAS,
    RUNTIME_CPU_MATMUL,
    RUNTIME_MOE_EXCHANGE,
    RUNTIME_MOE_GMM,
    SAMPLINGS,
    SCHEDULES,
    TOKENIZER_PREFIXES,
    TOKENIZERS,
)
from tformer_jax.config.errors import (
    ConfigError,
    unknown_field_error,
)
from tformer_jax.config.mixture import (
    parse_mixture,
)
from tformer_jax.config.model_rules import (
    validate_model,
)
from tformer_jax.config.schema import (
    ModelConfig,
    MoEConfig,
    RopeScaling,
    check_field_path,
    check_fields,
    default_config,
    load_config_file,
    to_configdict,
)
from tformer_jax.config.validate import (
    parse_loggers,
    validate,
    validate_runtime,
    warmup_note,
)
from tformer_jax.config.vocab import (
    resolved,
    tokenizer_vocab_size,
)

__all__ = [
    "ACTIVATIONS",
    "ATTENTION_LACKS",
    "ATTENTIONS",
    "AUTO_ON_OFF",
    "CONTEXT_STRATEGIES",
    "CORPORA",
    "CORPUS_PREFIXES",
    "CORPUS_SHOWN",
    "DECODE_LAYOUTS",
    "DTYPES",
    "GLU_ACTIVATIONS",
    "LEGACY_RUNTIME_FIELDS",
    "LOGGERS",
    "MOE_DISPATCH",
    "MOE_ROUTERS",
    "NON_ARCHITECTURE_FIELDS",
    "NORM_POSITIONS",
    "NORMS",
    "OPTIMIZERS",
    "PACKINGS",
    "PARALLELISMS",
    "POSITIONS",
    "PRECISIONS",
    "REMAT_NAMES",
    "REMAT_POLICIES",
    "ROPE_LAYOUTS",
    "ROPE_SCALING_FIELDS",
    "ROPE_SCALINGS",
    "RULE_PRESETS",
    "RUNTIME_ATTENTION",
    "RUNTIME_BACKENDS",
    "RUNTIME_CPU_BLAS",
    "RUNTIME_CPU_MATMUL",
    "RUNTIME_MOE_EXCHANGE",
    "RUNTIME_MOE_GMM",
    "SAMPLINGS",
    "SCHEDULES",
    "TOKENIZER_PREFIXES",
    "TOKENIZERS",
    "ConfigError",
    "unknown_field_error",
    "check_field_path",
    "check_fields",
    "default_config",
    "load_config_file",
    "ModelConfig",
    "MoEConfig",
    "RopeScaling",
    "to_configdict",
    "attention_features",
    "attention_unsupported",
    "supports",
    "validate_model",
    "parse_mixture",
    "resolved",
    "tokenizer_vocab_size",
    "parse_loggers",
    "validate",
    "validate_runtime",
    "warmup_note",
]
