"""Generate text with the KV cache, streaming to stdout.

  tformer-generate --workdir=runs/gpt2_tiny --prompt="ROMEO:" --max_new_tokens=200
  tformer-generate --hf=path/to/hf_model --prompt="Hello" --config.decode.temperature=0.7 --top_p=0.9
  tformer-generate --random_init --config=gpt2_tiny --prompt="To be"   # smoke test

One source of weights: --workdir (its config.json; --config.a.b=v overrides apply to it), --hf (the
default config with train.init_from=hf:DIR, or --config's; overrides apply), or --random_init with
--config=FILE (and overrides). Sampling comes from the config's decode section (`--config.decode.*`);
--temperature, --top_k, --top_p and --repetition_penalty, when given, override it.
Prompt i samples with seed --seed + i (its own random stream: different prompts do not share one, and
a prompt's text does not depend on what else is batched with it).

Several --prompt (or --prompts_file, one prompt per line; outputs are labelled FILE:LINE) run as one
left-padded batch; a single prompt streams chunk by chunk. Sampling flags out of range, a prompt longer
than a learned-position model holds, a --stop token past the model's vocabulary and an empty prompts file are
one-line errors. --stop strings end a
row (the text is cut before the stop string).

--chat: an interactive conversation on one `decode.Session` (the KV cache is kept across turns, only
the new turn is prefilled): one user turn per stdin line, the reply printed on one line. With an HF
tokenizer that has a chat template, the template renders the conversation; otherwise plain turns
('User: ...' / 'Assistant: ...', a reply ends at a newline). '/reset' starts a new conversation.
"""
from __future__ import annotations

import sys
from typing import Any, Sequence

import jax
import numpy as np
from absl import flags

from tformer_jax import backends, cli_common, config as config_lib, decode, model_loading
from tformer_jax.checkpoint import CheckpointError, restore_params
from tformer_jax.serve import api as chat_api


def define_flags(fv: flags.FlagValues) -> None:
  flags.DEFINE_string("workdir", None, "training workdir (config.json + checkpoints/)", flag_values=fv)
  flags.DEFINE_string("hf", None, "Hugging Face model directory", flag_values=fv)
  flags.DEFINE_bool("random_init", False, "random weights from --config", flag_values=fv)
  flags.DEFINE_multi_string("prompt", [], "a prompt", flag_values=fv)
  flags.DEFINE_string("prompts_file", None, "a file with one prompt per line", flag_values=fv)
  flags.DEFINE_integer("max_new_tokens", 200, "tokens generated per prompt", flag_values=fv)
  flags.DEFINE_float("temperature", None, "sampling temperature (0: greedy); default config.decode's",
                     flag_values=fv)
  flags.DEFINE_integer("top_k", None, "sample from the k most likely tokens (0: all); default config.decode's",
                       flag_values=fv)
  flags.DEFINE_float("top_p", None, "nucleus sampling mass; default config.decode's", flag_values=fv)
  flags.DEFINE_float("repetition_penalty", None, "penalty of already generated tokens; default "
                     "config.decode's", flag_values=fv)
  flags.DEFINE_integer("seed", 0, "sampling (and random-init) seed: prompt i samples with seed + i", flag_values=fv)
  flags.DEFINE_multi_string("stop", [], "a stop string", flag_values=fv)
  flags.DEFINE_integer("chunk_size", 16, "tokens per streamed chunk", flag_values=fv)
  flags.DEFINE_bool("scan_layers", None, "decode with scanned layers (compiles one layer body); "
                    "--noscan_layers: unrolled (faster per token on CPU, slower to compile); default: the "
                    "runtime's choice for the platform (runtime.decode_layout)", flag_values=fv)
  flags.DEFINE_bool("chat", False, "interactive conversation: one user turn per stdin line", flag_values=fv)
  flags.DEFINE_integer("max_len", 0, "--chat: tokens the conversation may hold (0: the model's max_len)",
                       flag_values=fv)


def parse_args(argv: Sequence[str] | None) -> Any:
  args = cli_common.parse(argv, define_flags, doc=__doc__, prog="tformer-generate", config=True,
                          from_workdir=True, from_hf=True)
  cli_common.check_model_source(args)
  decode_cfg = (args.config if args.config is not None else config_lib.default_config()).get(
      "decode", config_lib.default_config().decode)
  for name in SAMPLING:                  # the flags override config.decode; unset, they are its values
    if getattr(args, name) is None:
      setattr(args, name, decode_cfg[name])
  _check_sampling(args)
  if args.max_len < 0:
    cli_common.fail(f"--max_len: must be >= 0 (0: the model's max_len), got {args.max_len}")
  if args.config is not None:      # --chat's conversation: no position past a learned table
    try:
      model_loading.check_max_len(args.config, args.max_len)
    except config_lib.ConfigError as e:
      cli_common.fail(str(e))
  return args


SAMPLING = ("temperature", "top_k", "top_p", "repetition_penalty")


def row_seeds(seed: int, n: int) -> np.ndarray:
  """(n, 2) raw keys, row i's from seed + i: each prompt its own random stream."""
  return np.stack([np.asarray(jax.random.PRNGKey(seed + i)) for i in range(n)])


def _check_sampling(args: Any) -> None:
  """Sampling flags out of range: one line each, before any model is loaded."""
  rules = [("temperature", args.temperature >= 0, "must be >= 0 (0: greedy)"),
           ("top_p", 0 < args.top_p <= 1, "must be in (0, 1]"),
           ("top_k", args.top_k >= 0, "must be >= 0 (0: all tokens)"),
           ("max_new_tokens", args.max_new_tokens >= 1, "must be >= 1"),
           ("repetition_penalty", args.repetition_penalty > 0, "must be > 0 (1: off)")]
  for name, ok, rule in rules:
    if not ok:
      cli_common.fail(f"--{name}: {rule}, got {getattr(args, name)}")


def load(args: Any) -> tuple[Any, Any, Any, str]:
  """(model, params, tokenizer, default prompt)."""
  cfg = args.config
  if args.random_init:
    model, params, tok = model_loading.random_init(cfg, args.seed)
    return model, params, tok, (cfg.train.sample_prompt if "train" in cfg else "") or "\n"
  if args.hf:
    return (*model_loading.load_hf(args.hf), "Hello")
  _, params = restore_params(args.workdir)
  model = model_loading.model_from_config(cfg)
  return model, model_loading.check_params(model, params, args.workdir), model_loading.tokenizer_from_config(cfg), "\n"


class RowText:
  """The decoded continuation of one row, cut at the first stop string."""

  def __init__(self, tokenizer: Any, stops: Sequence[str]):
    self.tok, self.stops, self.ids, self.finished = tokenizer, [s for s in stops if s], [], False
    self.text, self.shown = "", 0

  def add(self, ids: np.ndarray, n_real: int) -> None:
    if self.finished:
      return
    self.ids.extend(int(i) for i in ids[:n_real])
    text = self.tok.decode(self.ids)
    cuts = [text.find(s) for s in self.stops if s in text]
    if cuts:
      text, self.finished = text[:min(cuts)], True
    self.text = text

  def ready(self, final: bool) -> str:
    """New text safe to print: holds back a possibly partial character or stop-string prefix."""
    end = len(self.text)
    if not (final or self.finished):
      end -= max((len(s) - 1 for s in self.stops), default=0)
      while end > self.shown and self.text[end - 1] == "\ufffd":
        end -= 1
    out = self.text[self.shown:max(end, self.shown)]
    self.shown = max(end, self.shown)
    return out


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  try:
    model, params, tok, default_prompt = load(args)
  except (CheckpointError, config_lib.ConfigError) as e:
    cli_common.fail(str(e))
  cfg = args.config if args.config is not None else config_lib.default_config()
  runtime = backends.resolve_runtime(cfg, model=model.cfg, quiet=True)
  backends.enable_compilation_cache(cfg.data.get("cache_dir", "") if "data" in cfg else "")
  with backends.use(runtime.backend):   # traced lazily, inside the stream
    if args.chat:
      return chat(args, model, params, tok)
    return generate(args, model, params, tok, default_prompt)


def stop_tokens(tok: Any, stops: Sequence[str], vocab_size: int) -> list[int]:
  """The token ids of the stop strings that are one token (the others end a row by text); a stop token the
  model cannot emit (the tokenizer's id past the model's vocabulary) is a one-line error."""
  ids = {}
  for s in stops:
    encoded = tok.encode(s)
    if len(encoded) == 1:
      ids[int(encoded[0])] = s
  for t, s in sorted(ids.items()):
    if not 0 <= t < vocab_size:
      cli_common.fail(f"--stop={s!r} is token {t}, outside this model's vocabulary of {vocab_size} tokens "
                      f"(0..{vocab_size - 1}): the tokenizer does not match the model")
  return sorted(ids)


def _turn_tokens(session: decode.Session, messages: list, tok: Any, template: str | None) -> list[int]:
  """The tokens to append for the last user message (resetting the session if the template's
  rendering of the conversation no longer starts with what the cache holds)."""
  if template is None:
    held = session.tokens
    sep = "\n" if held and not tok.decode(held[-1:]).endswith("\n") else ""   # a reply cut by the length
    text = f"{sep}User: {messages[-1]['content']}\nAssistant:"
    return [int(t) for t in tok.encode(text)]
  ids = [int(t) for t in tok.encode(chat_api.render_chat(messages, tok, template))]
  held = session.tokens
  if ids[:len(held)] != held:
    session.reset()
    held = []
  return ids[len(held):]


def chat(args: Any, model: Any, params: Any, tok: Any) -> int:
  """The --chat loop: read a turn, append it to the session, generate and print the reply."""
  template = chat_api.chat_template(tok)
  session = decode.Session(model, params, max_len=args.max_len or model.cfg.max_len,
                           scan_layers=args.scan_layers)
  eos = getattr(tok, "eos_id", None)
  stops = list(args.stop) + ([] if template else ["\n"])
  stop_ids = sorted(set(stop_tokens(tok, stops, model.cfg.vocab_size)) | ({eos} - {None}))
  messages: list[dict[str, str]] = []
  interactive = sys.stdin.isatty()
  while True:
    if interactive:
      sys.stdout.write("> ")
      sys.stdout.flush()
    line = sys.stdin.readline()
    if not line:
      return 0
    line = line.rstrip("\n")
    if line.strip() == "/reset":
      session.reset()
      messages = []
      print("(new conversation)", flush=True)
      continue
    if not line.strip():
      continue
    messages.append({"role": "user", "content": line})
    new = _turn_tokens(session, messages, tok, template)
    room = session.max_len - len(session.tokens) - len(new)
    if room < 1:
      print(f"(the conversation is full: {session.max_len} tokens; /reset to start again)", flush=True)
      messages.pop()
      continue
    session.append(new)
    before = len(session.tokens)
    ids = session.generate(min(args.max_new_tokens, room), temperature=args.temperature, top_k=args.top_k,
                           top_p=args.top_p, repetition_penalty=args.repetition_penalty,
                           stop_tokens=stop_ids, rng=args.seed + len(messages))
    text = chat_api.TextStream(tok, stops)
    kept = 0
    for t in ids:
      if eos is not None and int(t) == eos:
        kept += 1
        break
      text.add(int(t))
      kept += 1
      if text.stopped:
        break
    session.rewind(before + kept)          # the reply ends at the stop string (kept in the cache)
    reply = text.delta(final=True).strip()
    messages.append({"role": "assistant", "content": reply})
    print(reply, flush=True)


def _prompts(args: Any, default_prompt: str) -> tuple[list[str], list[str]]:
  """(prompts, their labels): --prompt i is 'i', a --prompts_file line 'FILE:LINE' (blank lines are
  skipped, not renumbered); a prompts file with no prompt is an error."""
  prompts, labels = list(args.prompt), [str(i) for i in range(len(args.prompt))]
  if args.prompts_file:
    try:
      with open(args.prompts_file, encoding="utf-8") as f:
        found = [(n, line.rstrip("\n")) for n, line in enumerate(f, 1) if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
      cli_common.fail(f"--prompts_file: {args.prompts_file}: {getattr(e, 'strerror', None) or e}")
    if not found:
      cli_common.fail(f"--prompts_file: {args.prompts_file} holds no prompt (it is empty or blank)")
    prompts += [line for _, line in found]
    labels += [f"{args.prompts_file}:{n}" for n, _ in found]
  return (prompts, labels) if prompts else ([default_prompt], ["0"])


def generate(args: Any, model: Any, params: Any, tok: Any, default_prompt: str) -> int:
  prompts, labels = _prompts(args, default_prompt)
  encoded = [tok.encode(p) for p in prompts]
  for p, ids in zip(prompts, encoded):
    if len(ids) == 0:
      cli_common.fail(f"prompt {p!r} encodes to no tokens")
  limit = model.cfg.max_len
  for label, ids in zip(labels, encoded):
    if model.cfg.position == "learned" and len(ids) + args.max_new_tokens > limit:
      cli_common.fail(f"prompt {label} is {len(ids)} tokens, + --max_new_tokens={args.max_new_tokens} exceeds "
                      f"this model's max_len={limit} (learned positions cannot extrapolate): shorten it or "
                      f"lower --max_new_tokens")
  stop_ids = stop_tokens(tok, args.stop, model.cfg.vocab_size)
  rows = [RowText(tok, args.stop) for _ in prompts]
  stream = decode.generate_stream(
      model, params, encoded, max_new_tokens=args.max_new_tokens, chunk_size=args.chunk_size,
      temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
      repetition_penalty=args.repetition_penalty, stop_tokens=stop_ids, rng=row_seeds(args.seed, len(prompts)),
      pad_id=-1,
      scan_layers=args.scan_layers)
  single = len(prompts) == 1
  if single:
    sys.stdout.write(prompts[0])
  for chunk in stream:
    for row, ids in zip(rows, chunk):
      row.add(ids, int(np.sum(ids >= 0)))      # pad_id=-1 follows a row's stop token
    if single:
      sys.stdout.write(rows[0].ready(final=False))
      sys.stdout.flush()
    if all(r.finished for r in rows):
      stream.close()
      break
  if single:
    sys.stdout.write(rows[0].ready(final=True) + "\n")
  else:
    for label, p, row in zip(labels, prompts, rows):
      sys.stdout.write(f"=== [{label}] ===\n{p}{row.text}\n")
  sys.stdout.flush()
  return 0



def entry() -> None:
  """The `tformer-generate` console command."""
  cli_common.exit_process(cli_common.run_main(main))   # bounded: no thread left behind holds the exit


if __name__ == "__main__":
  entry()
