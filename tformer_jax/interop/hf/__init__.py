"""Hugging Face interop: import and export weights of gpt2, llama, mistral, mixtral, qwen2, qwen3, olmo2, gemma2,
gemma3_text, qwen3_moe, gpt_oss, deepseek_v3, bloom, gpt_neox, bert.

  model, params = load_hf("path/to/hf_dir")        # or load_hf(transformers_model)
  logits = model.apply({"params": params}, tokens)  # == transformers' logits
  save_hf(model, params, "out_dir")                 # config.json + model.safetensors for from_pretrained

Reading never touches the network and never runs code from the directory: config.json is parsed as
JSON, weights come from *.safetensors (plain or sharded via model.safetensors.index.json) or, only
if there are none, pytorch_model*.bin through `torch.load(..., weights_only=True)` (a file holding
pickled objects is refused, never unpickled). Every size read is bounded before it is used (file and
header lengths, tensor offsets, then config.json's sizes against the tensors present), so a corrupt or
hostile directory gives one HFConfigError / HFWeightsError line naming the file, never a huge
allocation or a long wait. Each family's tensor mapping (as data) and config translation are one module
of `interop/families/`, listed in its registry.
Encoder checkpoints (bert) come without an LM head: apply() returns the final hidden states, equal
to transformers' `last_hidden_state` when the padding mask is passed as `attention_mask_BxL`.
"""
from __future__ import annotations

from tformer_jax.interop import axes
from tformer_jax.interop.families import HFConfigError, get_family
from tformer_jax.interop.hf.common import (
    HFWeightsError,
    log,
)
from tformer_jax.interop.hf.family import (
    arch_signature,
    hf_config_from_model,
    infer_family,
    model_config,
    model_config_from_hf,
)
from tformer_jax.interop.hf.files import (
    read_hf,
    read_hf_config,
    read_safetensors,
)
from tformer_jax.interop.hf.model_io import (
    EXPORT_FORMAT,
    EXPORT_MARKER,
    check_target,
    load_hf,
    owned_dir,
    save_hf,
    write_dir_atomically,
)
from tformer_jax.interop.hf.tokenizer import (
    TOKENIZER_FILES,
    byte_tokenizer_files,
    chat_template,
    load_hf_tokenizer,
    special_token_ids,
    tokenizer_files,
)
from tformer_jax.interop.hf.weights import (
    _sizes,
    check_weights,
    expected_shapes,
    export_tensors,
    flatten,
    import_tensors,
    mixtral_to_params,
    unflatten,
)
from tformer_jax.nn import Transformer

__all__ = [
    "HFWeightsError",
    "log",
    "read_hf",
    "read_hf_config",
    "read_safetensors",
    "arch_signature",
    "hf_config_from_model",
    "infer_family",
    "model_config",
    "model_config_from_hf",
    "_sizes",
    "check_weights",
    "expected_shapes",
    "export_tensors",
    "flatten",
    "import_tensors",
    "mixtral_to_params",
    "unflatten",
    "check_target",
    "EXPORT_FORMAT",
    "EXPORT_MARKER",
    "load_hf",
    "owned_dir",
    "save_hf",
    "write_dir_atomically",
    "byte_tokenizer_files",
    "chat_template",
    "load_hf_tokenizer",
    "special_token_ids",
    "TOKENIZER_FILES",
    "tokenizer_files",
    "axes",
    "get_family",
    "HFConfigError",
    "Transformer",
]
