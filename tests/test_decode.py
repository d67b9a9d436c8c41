"""KV-cache generation: cached logits == full forward, padding, sampling limits, isolation, errors, CLI."""
import dataclasses
import functools
import importlib.util
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tformer_jax import decode
from tformer_jax.config import ModelConfig, MoEConfig, RopeScaling
from tformer_jax.nn import Transformer

ATOL = 1e-5            # float32 cached vs full-forward logits
PROMPTS = [[5, 9, 11, 3, 7], [40, 2]]          # left-padded batch: lengths 5 and 2
N_NEW = 8              # most tests share one shape (B=2, P=5, S=13): compiled functions are reused


def _has(module: str) -> bool:
  return importlib.util.find_spec(module) is not None


def tiny(**kw) -> ModelConfig:
  base = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=4, max_len=32, position="rope")
  base.update(kw)
  return ModelConfig(**base)


_MODELS: dict = {}


def build(cfg: ModelConfig):
  if cfg not in _MODELS:
    model = Transformer(cfg)
    params = nn.unbox(jax.jit(model.init)(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))["params"])
    _MODELS[cfg] = (model, params)
  return _MODELS[cfg]


# Every position scheme, each with a head layout; plus a sliding window and scanned layers.
CASES = {
    "none-mha": tiny(position="none"),
    "sinusoidal-gqa": tiny(position="sinusoidal", num_kv_heads=2),
    "learned-mqa": tiny(position="learned", num_kv_heads=1),
    "rope-gqa": tiny(num_kv_heads=2),
    "alibi-gqa": tiny(position="alibi", num_kv_heads=2),
    "window4-rope-gqa": tiny(num_kv_heads=2, window=4),
    "window4-alibi-mqa": tiny(position="alibi", num_kv_heads=1, window=4),
    "rope-mha-scan": tiny(scan_layers=True),
}
if _has("tformer_jax.ops.rope_scaling"):
  CASES["rope-yarn-mqa"] = tiny(num_kv_heads=1, rope_scaling=RopeScaling("yarn", 2.0, original_max_len=16))
if _has("tformer_jax.ops.relative_bias"):
  CASES["t5-gqa"] = tiny(position="t5", num_kv_heads=2)


@pytest.mark.parametrize("name", list(CASES))
def test_cached_logits_equal_full_forward_at_every_step(name):
  cfg = CASES[name]
  model, params = build(cfg)
  n = N_NEW                                            # 2 + 8 > window 4: decodes past the window
  req = decode.make_request(model, PROMPTS, max_new_tokens=n, temperature=0.0)
  st = req.prefill(params)
  logits, toks = [np.asarray(st.logits_BxV)], []
  for _ in range(n - 1):                               # one token per call; compiled once (chunk=1)
    st, out = req.steps(params, st, 1, 1, True)
    toks.append(np.asarray(out)[:, 0])
    logits.append(np.asarray(st.logits_BxV))
  toks_BxN = np.stack(toks, axis=1)
  p = req.tokens_BxP.shape[1]
  full_tokens = np.concatenate([req.tokens_BxP, toks_BxN], axis=1)
  full_mask = np.concatenate([req.mask_BxP, np.ones_like(toks_BxN, bool)], axis=1)
  full = np.asarray(jax.jit(model.apply)({"params": params}, full_tokens, attention_mask_BxL=full_mask))
  for i, step_logits in enumerate(logits):             # causal: full[:, t] sees exactly the prefix
    np.testing.assert_allclose(step_logits, full[:, p - 1 + i], atol=ATOL, rtol=0,
                               err_msg=f"{name}: step {i}")
  # The one-call while-loop gives the same greedy tokens as stepping.
  if name == "learned-mqa":
    got = decode.generate(model, params, PROMPTS, max_new_tokens=n, temperature=0.0)
    np.testing.assert_array_equal(got[:, :n - 1], toks_BxN)


@pytest.mark.parametrize("cfg,cache_dtype", [
    (tiny(num_layers=4, num_kv_heads=2, moe=MoEConfig(num_experts=4, top_k=2, every=2)), "int8"),
    (tiny(num_layers=3, position="learned", norm="layernorm", tie_embeddings=True), "")],
    ids=["moe-every-2-int8", "learned-tied-layernorm"])
def test_prefill_one_layer_at_a_time_equals_the_whole_program(cfg, cache_dtype):
  # an unrolled stack's prefill runs one compiled block per layer kind (decode/layer_prefill.py); its
  # state (every layer's cache, the logits, positions) equals the one-program prefill's
  from tformer_jax.decode import generation
  model, params = build(cfg)
  model = decode.with_cache_dtype(model, cache_dtype)
  req = decode.make_request(model, PROMPTS, max_new_tokens=N_NEW, temperature=0.0)
  logged = len(decode.COMPILE_LOG)
  req.compile(params, N_NEW, False)
  blocks = [name for name, _ in decode.COMPILE_LOG[logged:] if name == "prefill_block"]
  assert len(blocks) == len({cfg.is_moe_layer(i) for i in range(cfg.num_layers)})   # not one per layer
  layered = req.prefill(params)
  whole = jax.jit(generation._prefill_fn(model, req.slots))(params, req.tokens_BxP, req.mask_BxP,
                                                             req.lengths_B, req.rng)
  assert jax.tree.structure(layered.cache) == jax.tree.structure(whole.cache)
  for a, b in zip(jax.tree.leaves(layered._replace(rng=None)), jax.tree.leaves(whole._replace(rng=None))):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=1e-6)
  # and the step loop continues either state to the same tokens
  np.testing.assert_array_equal(req.steps(params, layered, N_NEW, N_NEW, False)[1],
                                req.steps(params, whole, N_NEW, N_NEW, False)[1])


def test_decode_default_positions_count_real_tokens_not_slots():
  """model.apply(decode=True) without explicit positions, on a left-padded batch (a fixed bug)."""
  model, params = build(CASES["learned-mqa"])
  tok = np.array([[5, 9, 11, 3, 7, 1, 8], [0, 0, 0, 40, 2, 1, 8]])
  mask = np.ones_like(tok, bool)
  mask[1, :3] = False
  full = np.asarray(jax.jit(model.apply)({"params": params}, tok, attention_mask_BxL=mask))
  step = jax.jit(functools.partial(model.apply, decode=True, mutable=["cache"]))
  cache = decode.init_cache(model, params, 2, 8)
  logits, upd = step({"params": params, "cache": cache}, tok[:, :5], attention_mask_BxL=mask[:, :5])
  np.testing.assert_allclose(np.asarray(logits), full[:, :5], atol=ATOL, rtol=0)
  for t in (5, 6):
    logits, upd = step({"params": params, "cache": upd["cache"]}, tok[:, t:t + 1])
    np.testing.assert_allclose(np.asarray(logits[:, 0]), full[:, t], atol=ATOL, rtol=0, err_msg=f"t={t}")


def test_left_padded_batch_equals_each_prompt_alone():
  model, params = build(CASES["learned-mqa"])          # absolute positions: the strictest case
  batch = decode.generate(model, params, PROMPTS, max_new_tokens=N_NEW, temperature=0.0)
  for i, p in enumerate(PROMPTS):
    alone = decode.generate(model, params, [p], max_new_tokens=N_NEW, temperature=0.0, max_len=13)
    np.testing.assert_array_equal(batch[i], alone[0], err_msg=f"prompt {i}")


def test_cached_equals_recompute_with_sampling_and_penalty():
  model, params = build(CASES["rope-gqa"])
  kw = dict(max_new_tokens=N_NEW, temperature=0.8, top_k=20, top_p=0.9, repetition_penalty=1.3, rng=7)
  cached = decode.generate(model, params, PROMPTS, **kw)
  np.testing.assert_array_equal(cached, decode.generate_recompute(model, params, PROMPTS, **kw))
  greedy = dict(max_new_tokens=N_NEW, temperature=0.0)
  np.testing.assert_array_equal(decode.generate(model, params, PROMPTS, **greedy),
                                decode.generate_recompute(model, params, PROMPTS, **greedy))


def test_temperature_to_zero_and_top_k_1_equal_greedy():
  model, params = build(CASES["rope-gqa"])
  sharp = dict(params, embed=params["embed"] * 50.0)   # tied head: logit gaps >> temperature
  greedy = decode.generate(model, sharp, PROMPTS, max_new_tokens=N_NEW, temperature=0.0)
  for t in (1e-6, 1e-3):                               # static greedy path, then the sampling path
    for seed in (0, 1):
      got = decode.generate(model, sharp, PROMPTS, max_new_tokens=N_NEW, temperature=t, rng=seed)
      np.testing.assert_array_equal(got, greedy, err_msg=f"temperature {t}, seed {seed}")
  greedy = decode.generate(model, params, PROMPTS, max_new_tokens=N_NEW, temperature=0.0)
  for seed in (0, 1, 2):
    got = decode.generate(model, params, PROMPTS, max_new_tokens=N_NEW, temperature=1.0, top_k=1, rng=seed)
    np.testing.assert_array_equal(got, greedy, err_msg=f"top_k=1, seed {seed}")
  # Plain sampling at temperature 1 does depend on the seed.
  outs = {decode.generate(model, params, PROMPTS, max_new_tokens=N_NEW, rng=s).tobytes() for s in range(3)}
  assert len(outs) > 1


def test_requests_are_independent_and_cache_starts_at_zero():
  model, params = build(CASES["rope-gqa"])
  a, b = [[1, 2, 3, 4, 5], [9, 8]], [[30, 31, 32, 33, 34], [60, 61, 62]]
  kw = dict(max_new_tokens=N_NEW, temperature=0.0)
  b_first = decode.generate(model, params, b, **kw)
  decode.generate(model, params, a, **kw)
  b_after = decode.generate(model, params, b, **kw)
  np.testing.assert_array_equal(b_after, b_first)
  compiled = len(decode.COMPILE_LOG)
  decode.generate(model, params, b, **kw)                # same shapes: nothing is compiled again
  assert len(decode.COMPILE_LOG) == compiled
  np.testing.assert_array_equal(b_after, decode.generate_recompute(model, params, b, **kw))
  cache = decode.init_cache(model, params, 2, 16)
  assert int(cache["index"]) == 0 and cache["kv_valid"].shape == (2, 16) and not cache["kv_valid"].any()
  k = cache["layers_0"]["attn"]["k"]
  assert k.shape == (2, 16, 2, 8) and not np.asarray(k).any()


def test_stop_tokens_pad_after_stop_and_streaming_matches():
  model, params = build(CASES["rope-gqa"])
  free = decode.generate(model, params, PROMPTS, max_new_tokens=N_NEW, temperature=0.0)
  stop = int(free[0, 2])                               # row 0 stops at step 2 (or earlier if repeated)
  first = [int(np.argmax(r == stop)) if (r == stop).any() else None for r in free]
  out, lengths = decode.generate(model, params, PROMPTS, max_new_tokens=N_NEW, temperature=0.0,
                                 stop_tokens=(stop,), pad_id=-1, return_lengths=True)
  for r, f in enumerate(first):
    n = N_NEW if f is None else f + 1
    assert lengths[r] == n
    np.testing.assert_array_equal(out[r, :n], free[r, :n])   # the stop token itself is kept
    assert (out[r, n:] == -1).all()
  chunks = list(decode.generate_stream(model, params, PROMPTS, max_new_tokens=N_NEW, chunk_size=3,
                                       temperature=0.0))
  assert [c.shape[1] for c in chunks] == [3, 3, 2]
  np.testing.assert_array_equal(np.concatenate(chunks, axis=1), free)


def test_repetition_penalty_uses_prompt_and_generated_tokens():
  model, params = build(CASES["rope-gqa"])
  out = decode.generate(model, params, PROMPTS, max_new_tokens=N_NEW, temperature=0.0, repetition_penalty=1e4)
  for p, row in zip(PROMPTS, out):
    assert len(set(row.tolist())) == len(row), f"repeated a generated token: {row}"
    assert not set(row.tolist()) & set(p), f"repeated a prompt token: {row}"


def test_bad_input_raises_clear_value_errors():
  model, params = build(CASES["learned-mqa"])          # max_len 32, learned positions
  gen = lambda prompts, **kw: decode.generate(model, params, prompts, **{"max_new_tokens": 4, **kw})  # noqa
  with pytest.raises(ValueError, match="prompt 1 is empty"):
    gen([[1, 2], []])
  with pytest.raises(ValueError, match="empty prompt batch"):
    gen([])
  with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
    gen([[1, 2]], max_new_tokens=0)
  with pytest.raises(ValueError, match=r"= 34 exceeds the model's max_len=32 \(learned"):
    gen([[1, 2]], max_new_tokens=32)
  with pytest.raises(ValueError, match="exceeds max_len=8"):
    gen([[1, 2, 3, 4, 5]], max_len=8)
  with pytest.raises(ValueError, match=r"token id 64 outside the vocabulary \[0, 64\)"):
    gen([[1, 64]])
  with pytest.raises(ValueError, match="token id -1 outside"):
    gen(np.array([[1, -1]]))
  with pytest.raises(ValueError, match="stop token 99"):
    gen([[1]], stop_tokens=(99,))
  with pytest.raises(ValueError, match="top_p must be in"):
    gen([[1]], top_p=0.0)
  encoder = Transformer(dataclasses.replace(CASES["learned-mqa"], causal=False))
  with pytest.raises(ValueError, match="causal=False"):
    decode.generate(encoder, params, [[1, 2]], max_new_tokens=2)


def test_load_for_inference_round_trip(tmp_path):
  ckpt = pytest.importorskip("tformer_jax.checkpoint")
  from tformer_jax import model_loading
  from tformer_jax.config import default_config
  cfg = default_config()                               # the same model as CASES["rope-gqa"]
  cfg.model.update(dict(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, max_len=32,
                        position="rope"))
  model, params = build(CASES["rope-gqa"])
  (tmp_path / ckpt.CONFIG_FILE).write_text(json.dumps(cfg.to_dict()))
  saver = ckpt.Checkpointer(tmp_path / ckpt.CHECKPOINT_DIR, async_save=False)
  saver.save(5, {"params": params})
  saver.close()
  model2, params2, tok = model_loading.load_for_inference(tmp_path)
  assert model2.cfg == model.cfg and tok.vocab_size == 256        # byte tokenizer (the default)
  kw = dict(max_new_tokens=N_NEW, temperature=0.0)
  np.testing.assert_array_equal(decode.generate(model2, params2, PROMPTS, **kw),
                                decode.generate(model, params, PROMPTS, **kw))


def test_cli_random_init_prints_text(tmp_path, capsys):
  """tformer-generate --random_init streams the prompt and its continuation (in-process: the command's
  main; scripts/generate.py itself runs as a subprocess in test_train.py and test_workdir.py)."""
  from tformer_jax.cli import generate as cli
  cfg_file = tmp_path / "tiny_cfg.py"
  cfg_file.write_text(
      "from tformer_jax.config import default_config\n"
      "def get_config():\n"
      "  c = default_config()\n"
      "  c.model.update(dict(d_model=32, num_layers=2, num_heads=4, max_len=64, position='rope'))\n"
      "  return c\n")
  assert cli.main(["--random_init", f"--config={cfg_file}", "--prompt", "ROMEO:", "--max_new_tokens", "6",
                   "--chunk_size", "6", "--temperature", "0.7"]) == 0
  out = capsys.readouterr().out
  assert out.startswith("ROMEO:") and len(out.strip()) > len("ROMEO:")


def test_decode_benchmark_smoke(tmp_path):
  from tformer_jax.bench import decode as bench
  out = tmp_path / "bench.json"
  res = bench.main(["--d-model", "32", "--layers", "1", "--vocab", "64", "--prompt-len", "4",
                    "--new-tokens", "6", "--runs", "1", "--recompute-runs", "1", "--json", str(out)])
  assert res["tokens_match"] and res["new_tokens"] == 6 and res["speedup"] > 0
  assert json.loads(out.read_text()) == res


def test_greedy_matches_transformers_generate(tmp_path):
  """A tiny random Llama (RoPE, GQA, SwiGLU) through the HF importer: same greedy tokens as HF."""
  transformers = pytest.importorskip("transformers")
  torch = pytest.importorskip("torch")
  hf_interop = pytest.importorskip("tformer_jax.interop.hf")
  torch.manual_seed(0)
  cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
  hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
  hf.save_pretrained(tmp_path)
  model, params = hf_interop.load_hf(tmp_path)
  ours = decode.generate(model, params, PROMPTS, max_new_tokens=N_NEW, temperature=0.0)
  for p, row in zip(PROMPTS, ours):                    # HF runs each prompt alone (no padding)
    ref = hf.generate(torch.tensor([p]), max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=False,
                      pad_token_id=63, eos_token_id=None)
    np.testing.assert_array_equal(ref[0, len(p):].numpy(), row)


def test_decode_layout_scans_unrolled_params_and_matches_the_unrolled_model():
  model, params = build(CASES["rope-gqa"])                 # trained unrolled: layers_0, layers_1
  dmodel, dparams = decode.decode_layout(model, params)
  assert dmodel.cfg.scan_layers and not model.cfg.scan_layers
  assert "layers" in dparams and "layers_0" not in dparams
  want = jax.eval_shape(dmodel.init, jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))["params"]
  assert jax.tree.map(jnp.shape, nn.unbox(want)) == jax.tree.map(jnp.shape, dparams)
  assert decode.decode_layout(model, params)[1] is dparams          # the conversion is reused
  tokens = jnp.array([[3, 1, 4, 1, 5, 9]])
  np.testing.assert_allclose(dmodel.apply({"params": dparams}, tokens), model.apply({"params": params}, tokens),
                             atol=ATOL)
  # the unrolled model's own cached decode (the Request API takes the model as given) gives the same tokens
  req = decode.make_request(model, PROMPTS, max_new_tokens=N_NEW, temperature=0.0)
  _, unrolled = req.steps(params, req.prefill(params), N_NEW, N_NEW, False)
  np.testing.assert_array_equal(decode.generate(model, params, PROMPTS, max_new_tokens=N_NEW, temperature=0.0),
                                np.asarray(unrolled))
  # MoE every other layer: the blocks differ, so the stack stays unrolled
  moe = dataclasses.replace(tiny(), moe=dataclasses.replace(tiny().moe, num_experts=2, top_k=1, every=2))
  assert not decode.decode_layout(Transformer(moe), {})[0].cfg.scan_layers
  with pytest.raises(ValueError, match="layers_1"):
    decode.stack_layers({"layers_0": {}}, 2)


def test_prompt_buckets_share_executables_and_keep_the_tokens():
  assert [decode.prompt_bucket(p) for p in (1, 16, 17, 100, 128, 129)] == [16, 16, 32, 128, 128, 256]
  model, params = build(CASES["rope-gqa"])
  kw = dict(max_new_tokens=4, temperature=0.0)
  first = decode.generate(model, params, [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]], **kw)
  compiled = len(decode.COMPILE_LOG)
  prompt = [[7, 3, 9, 1, 2, 5, 8, 6, 4, 2, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21]]       # 21 tokens: bucket 32
  got = decode.generate(model, params, prompt, **kw)
  assert len(decode.COMPILE_LOG) == compiled            # another length in the same bucket compiles nothing
  assert first.shape == got.shape == (1, 4)
  np.testing.assert_array_equal(got, decode.generate(model, params, prompt, bucket_prompts=False, **kw))
  req = decode.make_request(model, prompt, max_new_tokens=4, max_len=28)   # the cache leaves room for 24
  assert req.tokens_BxP.shape == (1, 24) and req.slots == 28


# ----------------------------------------------------------------------------------- sessions


SESSION_CASES = {"rope-gqa": CASES["rope-gqa"], "alibi-gqa": CASES["alibi-gqa"],
                 "rope-gqa-scan-int8": tiny(num_kv_heads=2, scan_layers=True)}


@pytest.mark.parametrize("name", ["rope-gqa", "alibi-gqa"])
def test_session_two_turns_equal_a_full_forward_over_the_conversation(name):
  """Positions follow the cache: turn 2 (after a generated reply) == a fresh forward over it all."""
  model, params = build(SESSION_CASES[name])
  s = decode.Session(model, params, max_len=32)
  first = s.append([5, 9, 11, 3, 7])
  reply = s.generate(6, temperature=0.0)
  second = s.append([40, 2, 17], all_logits=True)          # the pending reply token, then the turn
  conv = s.tokens
  assert conv == [5, 9, 11, 3, 7, *reply.tolist(), 40, 2, 17] and len(second) == 4
  full = np.asarray(jax.jit(model.apply)({"params": params}, np.asarray([conv])))[0]
  np.testing.assert_allclose(first, full[4], atol=ATOL, rtol=0)
  np.testing.assert_allclose(second, full[-4:], atol=ATOL, rtol=0)
  # the reply is the greedy continuation of turn 1, as one-shot generate gives it
  np.testing.assert_array_equal(reply, decode.generate(model, params, [[5, 9, 11, 3, 7]],
                                                      max_new_tokens=6, temperature=0.0)[0])


@pytest.mark.parametrize("name", ["rope-gqa", "alibi-gqa"])
def test_reset_session_equals_a_new_one_bitwise(name):
  """A second conversation does not taste of the first."""
  model, params = build(SESSION_CASES[name])
  s = decode.Session(model, params, max_len=32)
  s.append([1, 2, 3, 4, 5, 6, 7, 8, 9])
  s.generate(5, temperature=0.9, rng=3)
  s.reset()
  fresh = decode.Session(model, params, max_len=32)
  a, b = s.append([40, 2, 17]), fresh.append([40, 2, 17])
  np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(s.generate(6, temperature=0.8, rng=1), fresh.generate(6, temperature=0.8, rng=1))
  for x, y in zip(jax.tree.leaves(s.cache), jax.tree.leaves(fresh.cache)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_session_stop_token_limits_and_int8_cache():
  model, params = build(SESSION_CASES["rope-gqa-scan-int8"])
  s = decode.Session(model, params, max_len=24, cache_dtype="int8")
  assert s.cache["layers"]["attn"]["k"].dtype == jnp.int8
  s.append([5, 9, 11])
  free = s.generate(8, temperature=0.0)
  s.reset()
  s.append([5, 9, 11])
  first = free.tolist().index(int(free[-1]))                 # where the last token first appears
  stopped = s.generate(8, temperature=0.0, stop_tokens=[int(free[-1])])
  np.testing.assert_array_equal(stopped, free[:first + 1])   # the stop token is kept, then nothing
  assert len(s.tokens) == 3 + first + 1
  with pytest.raises(ValueError, match="max_len=24"):
    s.append(list(range(30)))
  with pytest.raises(ValueError, match="append tokens first"):
    decode.Session(model, params, max_len=8).generate(2)
  with pytest.raises(ValueError, match="vocabulary"):
    s.append([64])


def test_cli_chat_keeps_the_conversation_in_one_cache(tmp_path, monkeypatch, capsys):
  """tformer-generate --chat through stdin: plain turns; turn 2's reply is what a fresh generate over
  the whole conversation text gives (the cache was reused, positions continued)."""
  import io

  from tformer_jax import cli_common, model_loading
  from tformer_jax.cli import generate as cli
  cfg_file = tmp_path / "tiny_cfg.py"
  cfg_file.write_text(
      "from tformer_jax.config import default_config\n"
      "def get_config():\n"
      "  c = default_config()\n"
      "  c.model.update(dict(d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, max_len=96, position='rope'))\n"
      "  return c\n")
  monkeypatch.setattr("sys.stdin", io.StringIO("hello\n\nagain\n/reset\nhello\n"))
  assert cli.main(["--random_init", f"--config={cfg_file}", "--chat", "--temperature=0",
                   "--max_new_tokens=6"]) == 0
  lines = capsys.readouterr().out.split("\n")
  r1, r2, note, r3 = lines[:4]
  assert note == "(new conversation)" and r3 == r1             # reset: the first turn again, exactly
  model, params, tok = model_loading.random_init(cli_common.load_named_config(str(cfg_file)), 0)
  turn1 = tok.encode("User: hello\nAssistant:").tolist()
  first = decode.generate(model, params, [turn1], max_new_tokens=6, temperature=0.0)[0].tolist()
  newline = tok.encode("\n").tolist()
  kept = first[:first.index(newline[0]) + 1] if newline[0] in first else first + newline
  assert tok.decode(kept).strip() == r1
  conv = turn1 + kept + tok.encode("User: again\nAssistant:").tolist()
  second = decode.generate(model, params, [conv], max_new_tokens=6, temperature=0.0)[0]
  assert tok.decode(second).split("\n")[0].strip() == r2


def test_decode_layout_is_a_runtime_choice_per_platform():
  from tformer_jax import backends
  from tformer_jax.config import ConfigError, default_config
  cfg = default_config()
  cpu = backends.resolve_runtime(cfg, platform="cpu", quiet=True)
  assert cpu.backend.decode_layout == "unrolled" and any("decode unrolled" in r for r in cpu.reasons)
  for platform in ("gpu", "tpu"):
    assert backends.resolve_runtime(cfg, platform=platform, quiet=True).backend.decode_layout == "scanned"
  cfg.runtime.decode_layout = "scanned"
  assert backends.resolve_runtime(cfg, platform="cpu", quiet=True).backend.decode_layout == "scanned"
  cfg.runtime.decode_layout = "sideways"
  with pytest.raises(ConfigError, match="runtime.decode_layout"):
    backends.resolve_runtime(cfg, platform="cpu", quiet=True)
  # scanned params unrolled for decoding (and back) give the same tokens
  model, params = build(CASES["rope-mha-scan"])
  with backends.use(cpu.backend):
    umodel, uparams = decode.decode_layout(model, params)
    got = decode.generate(model, params, PROMPTS, max_new_tokens=N_NEW, temperature=0.0)
  assert not umodel.cfg.scan_layers and "layers_1" in uparams
  np.testing.assert_array_equal(got, decode.generate(model, params, PROMPTS, max_new_tokens=N_NEW,
                                                     temperature=0.0, scan_layers=True))


def test_every_decode_layout_gives_the_same_logits_and_tokens_and_the_choice_is_logged(caplog):
  """Scanned and unrolled decoding: teacher-forced logits through the cache within 1e-5 (float32),
  the same greedy tokens from generate and generate_stream; the prefill and the step loop compile
  together once; resolve_runtime records the layout with its reason (runtime.json)."""
  import logging

  from tformer_jax import backends
  from tformer_jax.config import default_config
  model, params = build(CASES["rope-gqa"])
  tokens = np.array([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]])
  logp = {scan: decode.cache_logprobs(model, params, tokens, scan_layers=scan) for scan in (True, False)}
  np.testing.assert_allclose(logp[True], logp[False], atol=ATOL)
  prompts, kw = [[7, 8, 9], [1]], dict(max_new_tokens=6, temperature=0.0)
  logged = len(decode.COMPILE_LOG)
  out = {scan: decode.generate(model, params, prompts, scan_layers=scan, **kw) for scan in (True, False)}
  names = [n for n, _ in decode.COMPILE_LOG[logged:]]
  # scanned: the prefill and the loop; unrolled: the loop and the prefill's pieces (one block for all layers)
  assert sorted(names) == ["decode_loop", "decode_loop", "prefill", "prefill_block", "prefill_embed", "prefill_head"]
  np.testing.assert_array_equal(out[True], out[False])
  stream = np.concatenate(list(decode.generate_stream(model, params, prompts, chunk_size=4, scan_layers=False,
                                                      **kw)), axis=1)
  np.testing.assert_array_equal(stream, out[False])
  logged = len(decode.COMPILE_LOG)
  decode.generate(model, params, prompts, scan_layers=False, **kw)
  assert len(decode.COMPILE_LOG) == logged                            # compiled once, reused
  with caplog.at_level(logging.INFO, logger="tformer_jax"):
    rt = backends.resolve_runtime(default_config(), platform="cpu")
  assert "why: runtime.json" in caplog.text                             # the one line points at the reasons
  assert any(r.startswith("decode unrolled: ") for r in rt.as_dict()["reasons"]), rt.reasons   # runtime.json's
