"""The allowed values of every enum field, the capability table of the attention implementations, and the field
groups other modules read (NON_ARCHITECTURE_FIELDS, ROPE_SCALING_FIELDS, LEGACY_RUNTIME_FIELDS)."""
from __future__ import annotations

ATTENTIONS = ("softmax", "linear")
ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu", "swiglu", "geglu", "geglu_tanh")
GLU_ACTIVATIONS = ("swiglu", "geglu", "geglu_tanh")
NORMS = ("layernorm", "rmsnorm")
NORM_POSITIONS = ("pre", "post", "sandwich", "reordered")
QK_NORMS = ("none", "head", "proj")
LAYER_KINDS = ("L", "G")   # model.layer_pattern: local (the window) | global
POSITIONS = ("none", "sinusoidal", "learned", "rope", "alibi", "t5")
ROPE_LAYOUTS = ("half", "interleaved")
ROPE_SCALINGS = ("none", "linear", "ntk", "dynamic", "yarn", "llama3")
# model.remat -> what a remat'd block saves: a jax.checkpoint_policies member's name, a tuple of the
# activation names nn/ tags with checkpoint_name (REMAT_NAMES; jax.checkpoint_policies.save_only_these_names),
# or None (nothing: the whole block is recomputed; 'none' is no remat at all). nn/transformer.py applies it.
# 'save_qkvo' is MaxText's 'save_dot_except_mlp' (its names too): q, k, v and the attention's output projection
# are kept, the FFN is recomputed; 'save_mlp_in' keeps the FFN's up (and gate) outputs instead.
REMAT_NAMES = ("query_proj", "key_proj", "value_proj", "out_proj", "mlp_in", "mlp_gate")
REMAT_POLICIES = {"none": None, "full": None, "dots": "checkpoint_dots",
                  "dots_no_batch": "checkpoint_dots_with_no_batch_dims",
                  "save_qkvo": ("query_proj", "key_proj", "value_proj", "out_proj"),
                  "save_mlp_in": ("mlp_in", "mlp_gate")}
DTYPES = ("float32", "bfloat16", "float16")
MOE_DISPATCH = ("dropless", "capacity")
MOE_ROUTERS = ("softmax", "sigmoid", "softmax_topk")   # model.moe.router (ops/moe.py route_by)
RUNTIME_BACKENDS = ("auto", "reference", "xla_cpu")
# Which model features each runtime.attention implementation lacks: the one table that config validation
# (`supports`), resolve_runtime's 'auto' and the backend's per-call choice (backends/base.py) read.
# 'reference' (one dense softmax) serves every feature.
_TILED_LACKS = frozenset({"dropout", "dense_bias", "global_tokens", "random_blocks"})
_FUSED_LACKS = frozenset({"dropout", "softcap", "sinks"})   # jax.nn.dot_product_attention
ATTENTION_LACKS = {"reference": frozenset(), "chunked": _TILED_LACKS, "blockwise": _TILED_LACKS,
                   "xla": _FUSED_LACKS, "cudnn": _FUSED_LACKS,
                   "splash": _TILED_LACKS | {"alibi"}}
RUNTIME_ATTENTION = ("auto", *ATTENTION_LACKS)
CONTEXT_STRATEGIES = ("all_gather", "ring")   # mesh.context_strategy (ops/context_parallel.py)
AUTO_ON_OFF = ("auto", "on", "off")
RUNTIME_CPU_MATMUL = ("auto", "weight_grads", "all")
RUNTIME_CPU_BLAS = ("auto", "openblas", "mkl", "onednn")
DECODE_LAYOUTS = ("auto", "scanned", "unrolled")   # runtime.decode_layout (backends/runtime.py)
RUNTIME_MOE_EXCHANGE = ("auto", "global", "all_to_all", "ragged")   # backends/moe.py
RUNTIME_MOE_GMM = ("auto", "ragged_dot", "megablox")
# The values of the other sections, as the modules that read them spell them (tests/test_config_errors.py
# checks that they agree): tformer_jax.data (corpora, tokenizers, pipeline), train.optim, train.precision,
# parallel.rules.
CORPORA = ("shakespeare", "kjv")
CORPUS_PREFIXES = ("text:", "prepared:", "synthetic:")
CORPUS_SHOWN = ("text:PATH", "prepared:DIR", "synthetic:TASK")
TOKENIZERS = ("byte", "bpe")
TOKENIZER_PREFIXES = ("spm:", "hf:")
SAMPLINGS = ("random", "packed")     # data.sampling and data.packing: owned here, tformer_jax.data imports them
PACKINGS = ("packed", "document")
OPTIMIZERS = ("adamw", "adafactor", "lion", "sgd", "muon")
LOGGERS = ("jsonl", "tensorboard", "wandb")
SCHEDULES = ("cosine", "rsqrt", "constant", "wsd")
DECAY_SHAPES = ("linear", "cosine", "1-sqrt")   # optim.decay_shape: the wsd schedule's cooldown
PRECISIONS = ("float32", "bf16", "fp16")
PARALLELISMS = ("jit", "pmap")
RULE_PRESETS = ("dp", "fsdp", "tp", "fsdp_tp", "fsdp+tp")

# ModelConfig fields that change neither the function the model computes at inference nor what its
# parameters mean: training-time regularisation and initialisation, dtypes, how layers are traced
# (scan/remat), mlp_ratio (a default for d_ff, compared resolved) and mask_token_id (an encoder's masked-LM
# training input). The architecture signature (HF export, `interop.hf`) leaves them out.
NON_ARCHITECTURE_FIELDS = ("embed_dropout", "attn_dropout", "resid_dropout", "init_std",
                           "scale_residual_init", "dtype", "param_dtype", "scan_layers", "remat",
                           "mlp_ratio", "mask_token_id")
# The RopeScaling fields each scaling type reads (the others do not change the model).
ROPE_SCALING_FIELDS = {"none": (), "linear": ("factor",), "ntk": ("factor",),
                       "dynamic": ("factor", "original_max_len"),
                       "yarn": ("factor", "original_max_len", "beta_fast", "beta_slow", "attention_factor",
                                "truncate"),
                       "llama3": ("factor", "original_max_len", "low_freq_factor", "high_freq_factor")}
# Execution fields that older versions kept in `model` (still found in saved config.json files);
# now in the runtime section, and dropped when such a file is read.
LEGACY_RUNTIME_FIELDS = ("attention_impl", "attention_block_q", "attention_block_k",
                         "residual_grad_barrier", "weight_grad_impl")
