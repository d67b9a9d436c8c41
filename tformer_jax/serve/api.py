"""The OpenAI wire format: request validation (one-line errors naming the field), chat rendering,
incremental detokenisation with stop strings, and the response / stream-chunk bodies."""
from __future__ import annotations

import json
import pathlib
import secrets
import time
from typing import Any, Sequence

from tformer_jax.interop import hf

COMMON = {"model", "max_tokens", "temperature", "top_p", "stop", "seed", "stream", "stream_options", "n",
          "user", "presence_penalty", "frequency_penalty", "logprobs", "logit_bias"}
COMPLETION_FIELDS = COMMON | {"prompt", "echo", "suffix", "best_of"}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "top_logprobs", "response_format", "tools",
                        "tool_choice", "parallel_tool_calls", "store", "metadata", "modalities"}
DEFAULT_MAX_TOKENS = 16   # /v1/completions without max_tokens (OpenAI's default); chat: the rest of max_len


SHOWN_CHARS = 80   # a rejected value is quoted in the error up to this many characters


def shown(value: Any) -> str:
  """repr(value) for an error message, cut to SHOWN_CHARS (a rejected 1 MB field is not echoed back)."""
  text = repr(value)
  return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}... ({len(text):,} characters)"


class RequestError(ValueError):
  """A bad request: `status` (4xx), OpenAI error `type`, and `param` (the field), if any."""

  def __init__(self, message: str, param: str | None = None, status: int = 400,
               kind: str = "invalid_request_error"):
    super().__init__(message)
    self.param, self.status, self.kind = param, status, kind

  def body(self) -> dict[str, Any]:
    return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": None}}


def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
  v = body.get(name, default)
  v = default if v is None else v
  if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
    raise RequestError(f"{name} must be a number in [{lo}, {hi}], got {shown(v)}", name)
  return float(v)


def parse_sampling(body: dict, known: set[str], served_model: str) -> dict[str, Any]:
  """The settings shared by both endpoints (checked, with OpenAI's defaults)."""
  unknown = sorted(set(body) - known)
  if unknown:
    raise RequestError(f"unknown field {shown(unknown[0])} (this server accepts {sorted(known)})", unknown[0])
  model = body.get("model")
  if not isinstance(model, str):
    raise RequestError("model is required: a string (GET /v1/models lists the served one)", "model")
  if model != served_model:
    raise RequestError(f"the model {shown(model)} does not exist; this server serves {served_model!r}", "model",
                       status=404, kind="not_found_error")
  if body.get("n", 1) not in (1, None):
    raise RequestError(f"n must be 1 (one choice per request), got {shown(body['n'])}", "n")
  for name in ("presence_penalty", "frequency_penalty"):
    if body.get(name) not in (None, 0, 0.0):
      raise RequestError(f"{name} is not supported (only 0)", name)
  max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))   # None: the endpoint's default
  if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                 or max_tokens < 1):
    raise RequestError(f"max_tokens must be an integer >= 1, got {shown(max_tokens)}", "max_tokens")
  stop = body.get("stop")
  stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
  if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
    raise RequestError(f"stop must be a non-empty string or a list of at most 4, got {shown(body.get('stop'))}",
                       "stop")
  seed = body.get("seed")
  if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
    raise RequestError(f"seed must be an integer, got {shown(seed)}", "seed")
  stream = body.get("stream", False)
  if not isinstance(stream, bool):
    raise RequestError(f"stream must be a boolean, got {shown(stream)}", "stream")
  opts = body.get("stream_options") or {}
  if not isinstance(opts, dict):
    raise RequestError("stream_options must be an object", "stream_options")
  return dict(max_tokens=max_tokens, temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
              top_p=_number(body, "top_p", 1.0, 0.0, 1.0) or 1e-6, stop=stop,
              seed=secrets.randbits(31) if seed is None else seed, stream=stream,
              include_usage=bool(opts.get("include_usage", False)))


def parse_json(raw: bytes) -> dict:
  try:
    body = json.loads(raw)
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise RequestError(f"the request body is not valid JSON: {e}") from None
  if not isinstance(body, dict):
    raise RequestError("the request body must be a JSON object")
  return body


def completion_prompt(body: dict, tokenizer: Any) -> list[int]:
  prompt = body.get("prompt")
  if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
    prompt = prompt[0]
  if isinstance(prompt, str):
    ids = [int(t) for t in tokenizer.encode(prompt)]
  elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                   for t in prompt):
    ids = list(prompt)
  else:
    raise RequestError("prompt must be a string, or a list of token ids (one prompt per request)", "prompt")
  if not ids:
    raise RequestError("the prompt encodes to no tokens", "prompt")
  return ids


# ------------------------------------------------------------------------------------ chat


def chat_template(tokenizer: Any) -> str | None:
  """The Jinja chat template of the HF directory of a tokenizer.json, if any (`interop.hf.chat_template`:
  chat_template.jinja, chat_template.json or tokenizer_config.json)."""
  path = getattr(tokenizer, "path", None)
  if path is None:
    return None
  path = pathlib.Path(path)
  return hf.chat_template(path if path.is_dir() else path.parent)


def check_messages(messages: Any) -> list[dict[str, str]]:
  if not isinstance(messages, list) or not messages:
    raise RequestError("messages must be a non-empty list of {role, content}", "messages")
  out = []
  for i, m in enumerate(messages):
    if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer"):
      raise RequestError(f"messages[{i}] needs a role of system | user | assistant", "messages")
    content = m.get("content")
    if isinstance(content, list):   # [{type: text, text: ...}] parts
      content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    if not isinstance(content, str):
      raise RequestError(f"messages[{i}].content must be a string", "messages")
    out.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
  return out


def render_chat(messages: Sequence[dict[str, str]], tokenizer: Any, template: str | None) -> str:
  """The prompt text of a conversation: the tokenizer's HF chat template (with the generation
  prompt), else plain turns ('User: ...' / 'Assistant: ...', ending with 'Assistant:')."""
  if template:
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: PLC0415 (only for HF chat templates)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(msg: str) -> None:
      raise RequestError(f"the chat template refused the messages: {msg}", "messages")
    env.globals["raise_exception"] = raise_exception
    specials = {}
    for name, attr in (("bos_token", "bos_id"), ("eos_token", "eos_id")):
      i = getattr(tokenizer, attr, None)
      specials[name] = tokenizer.decode([i]) if i is not None else ""
    return env.from_string(template).render(messages=list(messages), add_generation_prompt=True, **specials)
  names = {"system": "System", "user": "User", "assistant": "Assistant"}
  return "".join(f"{names[m['role']]}: {m['content']}\n" for m in messages) + "Assistant:"


# ----------------------------------------------------------------------------------- text


class TextStream:
  """Generated ids -> text, cut at the first stop string; `delta()` is the new text safe to send
  (holds back a partial UTF-8 character and a possible stop-string prefix until the end)."""

  def __init__(self, tokenizer: Any, stops: Sequence[str]):
    self.tok, self.stops, self.ids = tokenizer, list(stops), []
    self.text, self.sent, self.stopped = "", 0, False

  def add(self, tok: int) -> None:
    if self.stopped:
      return
    self.ids.append(int(tok))
    text = self.tok.decode(self.ids)
    cuts = [text.find(s) for s in self.stops if s in text]
    if cuts:
      text, self.stopped = text[:min(cuts)], True
    self.text = text

  def delta(self, final: bool = False) -> str:
    end = len(self.text)
    if not (final or self.stopped):
      end -= max((len(s) - 1 for s in self.stops), default=0)
      while end > self.sent and self.text[end - 1] == "\ufffd":
        end -= 1
    out = self.text[self.sent:max(end, self.sent)]
    self.sent = max(end, self.sent)
    return out


# ------------------------------------------------------------------------------ responses


def new_id(chat: bool) -> str:
  return ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
  return dict(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
              total_tokens=prompt_tokens + completion_tokens)


def response(chat: bool, rid: str, model: str, text: str, finish: str, use: dict[str, int]) -> dict:
  choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
  if chat:
    choice["message"] = {"role": "assistant", "content": text}
  else:
    choice["text"] = text
  return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
          "model": model, "choices": [choice], "usage": use}


def chunk(chat: bool, rid: str, model: str, text: str | None, finish: str | None, first: bool = False,
          use: dict[str, int] | None = None) -> dict:
  """One streamed event; text=None with `use` is the final usage-only chunk (no choices)."""
  out: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                         "created": int(time.time()), "model": model, "choices": []}
  if text is not None:
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
    if chat:
      choice["delta"] = ({"role": "assistant", "content": text} if first else
                         {"content": text} if text or finish is None else {})
    else:
      choice["text"] = text
    out["choices"] = [choice]
  if use is not None:
    out["usage"] = use
  return out


def finish_reason(job_reason: str | None, stopped_by_text: bool) -> str:
  return "stop" if stopped_by_text or job_reason == "stop" else "length"
