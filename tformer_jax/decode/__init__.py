"""Fast generation: KV-cache decoding with one prefill call and a compiled fixed-shape step loop.

`generate(model, params, prompts, max_new_tokens=...)` left-pads the prompts to a common length P
(attention mask + positions counted over real tokens only), runs ONE prefill (compiled; per layer
for an unrolled stack) over the padded prompts into a fresh zero cache of S = max_len slots (default
P + max_new_tokens), then ONE jit-compiled `lax.while_loop` that samples a token, writes it to the
cache and computes the next logits, exiting early once every row has produced a stop token. Every
request starts from a fresh zero cache, so consecutive requests never see each other's keys
("conversations bleeding together").

What keeps compilation short:
- the layers are scanned or unrolled for decoding whatever the training layout, as the runtime
  decides per platform (`decode_layout`: scanned compiles one layer body, unrolled runs faster per
  token on XLA:CPU; params are converted once and the result reused), and never remat'd;
- an unrolled stack's prefill runs one layer at a time from the host (`layer_prefill`: one compiled
  block for every layer), and the functions compile on threads as they are lowered;
- P is rounded up to a prompt bucket (a power of two, at least 16: `prompt_bucket`), so a prompt of
  another length in the same bucket reuses the executables (the extra left padding is masked);
- the CLIs enable JAX's persistent compilation cache (`backends.enable_compilation_cache`).
Compiled executables are cached per (model, batch, bucketed prompt length, slots, static sampling
choices); every compile is logged in `COMPILE_LOG`. `generate_recompute` is the no-cache baseline
(a full forward over the whole fixed-size buffer every step, exact prompt length) with the same
sampling and rng stream, so both give the same tokens.
Output: (B, max_new_tokens) int32 numpy; after a row's stop token (which is kept) come `pad_id`s.
`return_lengths=True` also returns the number of generated tokens per row (stop token included).

Modules: `request` (validation, prompt buckets, sampling spec and step), `cache` (KV-cache shapes,
dtype, bytes), `layout` (scanned / unrolled layers), `generation` (prefill + step loop, streaming, the
recompute baseline), `layer_prefill` (the prefill per layer), `session` (continuing a cache:
`append_tokens`, `Session`), `score` (teacher-forced log-probs through the cache), `slots`
(continuous batching), `compiled` (the executable cache).
"""
from tformer_jax.decode.cache import cache_bytes, init_cache, with_cache_dtype
from tformer_jax.decode.compiled import COMPILE_LOG
from tformer_jax.decode.generation import Request, generate, generate_recompute, generate_stream, make_request
from tformer_jax.decode.layout import decode_layout, stack_layers, unstack_layers
from tformer_jax.decode.request import MIN_PROMPT_BUCKET, DecodeState, SamplingSpec, _cfg, pad_prompts, prompt_bucket
from tformer_jax.decode.score import cache_logprobs
from tformer_jax.decode.session import Session, append_tokens
from tformer_jax.decode.slots import set_slot, slot_buckets, slot_caches, slot_step

__all__ = ["COMPILE_LOG", "MIN_PROMPT_BUCKET", "DecodeState", "Request", "SamplingSpec", "Session", "_cfg",
           "append_tokens", "cache_bytes", "cache_logprobs", "decode_layout", "generate", "generate_recompute",
           "generate_stream", "init_cache", "make_request", "pad_prompts", "prompt_bucket", "set_slot",
           "slot_buckets", "slot_caches", "slot_step", "stack_layers", "unstack_layers", "with_cache_dtype"]
