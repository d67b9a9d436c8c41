"""The HTTP server (aiohttp): /v1/completions, /v1/chat/completions (JSON or server-sent events),
/v1/models and /health, on an `engine.Engine`. Every error is an OpenAI-style JSON body with a 4xx
(5xx only for a failure of the engine itself); a client that disconnects cancels its job, which frees
its slot at the next step."""
from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

from aiohttp import web

from tformer_jax.serve import api
from tformer_jax.serve.engine import Engine, EngineError, Job

MAX_BODY_BYTES = 4 * 1024 * 1024


def _error(e: api.RequestError) -> web.Response:
  return web.json_response(e.body(), status=e.status)


@web.middleware
async def _json_errors(request: web.Request, handler: Any) -> web.StreamResponse:
  """aiohttp's own errors (404, 405, 413, ...) as OpenAI-style JSON too."""
  try:
    return await handler(request)
  except web.HTTPException as e:
    if e.status < 400:
      raise
    kind = "not_found_error" if e.status == 404 else "invalid_request_error"
    return _error(api.RequestError(f"{request.method} {request.path}: {e.reason}", status=e.status, kind=kind))


class Service:
  """The handlers: one engine, its tokenizer, the served model's name."""

  def __init__(self, engine: Engine, tokenizer: Any, model_name: str):
    self.engine, self.tok, self.name = engine, tokenizer, model_name
    self.template = api.chat_template(tokenizer)
    eos = getattr(tokenizer, "eos_id", None)
    self.stop_ids = () if eos is None else (int(eos),)
    self.started = int(time.time())

  def app(self) -> web.Application:
    app = web.Application(middlewares=[_json_errors], client_max_size=MAX_BODY_BYTES)
    app.router.add_get("/health", self.health)
    app.router.add_get("/v1/models", self.models)
    app.router.add_post("/v1/completions", self.completions)
    app.router.add_post("/v1/chat/completions", self.chat_completions)
    return app

  async def completions(self, request: web.Request) -> web.StreamResponse:
    return await self.generate(request, chat=False)

  async def chat_completions(self, request: web.Request) -> web.StreamResponse:
    return await self.generate(request, chat=True)

  async def health(self, request: web.Request) -> web.Response:
    return web.json_response({"status": "ok", "model": self.name, **self.engine.stats()})

  async def models(self, request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [
        {"id": self.name, "object": "model", "created": self.started, "owned_by": "tformer_jax"}]})

  def _prompt(self, body: dict, chat: bool) -> list[int]:
    if not chat:
      return api.completion_prompt(body, self.tok)
    text = api.render_chat(api.check_messages(body.get("messages")), self.tok, self.template)
    return [int(t) for t in self.tok.encode(text)]

  async def generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
    try:
      body = api.parse_json(await request.read())
      s = api.parse_sampling(body, api.CHAT_FIELDS if chat else api.COMPLETION_FIELDS, self.name)
      prompt = self._prompt(body, chat)
      if s["max_tokens"] is None:
        s["max_tokens"] = max(1, self.engine.max_len - len(prompt)) if chat else api.DEFAULT_MAX_TOKENS
      loop, queue = asyncio.get_running_loop(), asyncio.Queue()
      job = Job(prompt=prompt, max_tokens=s["max_tokens"], temperature=s["temperature"], top_p=s["top_p"],
                seed=s["seed"], stop_ids=self.stop_ids,
                on_token=lambda j, t: loop.call_soon_threadsafe(queue.put_nowait, t),
                on_done=lambda j: loop.call_soon_threadsafe(queue.put_nowait, None))
      self.engine.submit(job)
    except EngineError as e:
      status = 429 if "queue is full" in str(e) else 400
      return _error(api.RequestError(str(e), "prompt" if status == 400 else None, status=status))
    except api.RequestError as e:
      return _error(e)
    except web.HTTPException:   # aiohttp's own (a body over MAX_BODY_BYTES: 413), as JSON by the middleware
      raise
    except Exception as e:   # e.g. a chat template that fails to render
      return _error(api.RequestError(f"{type(e).__name__}: {e}", status=500, kind="server_error"))
    try:
      if s["stream"]:
        return await self._stream(request, chat, s, job, queue)
      return await self._whole(chat, s, job, queue)
    finally:
      if job.finish_reason is None:
        job.cancel()      # client gone (handler cancelled) or stopped by text: free the slot

  async def _tokens(self, job: Job, queue: asyncio.Queue, text: api.TextStream):
    """Yield after each generated token until the job ends or a stop string is hit."""
    n = 0
    while True:
      tok = await queue.get()
      if tok is None:
        break
      n += 1
      if tok not in self.stop_ids:
        text.add(tok)
      yield n
      if text.stopped:
        job.cancel()
        break

  async def _whole(self, chat: bool, s: dict, job: Job, queue: asyncio.Queue) -> web.Response:
    text, n = api.TextStream(self.tok, s["stop"]), 0
    async for n in self._tokens(job, queue, text):  # noqa: B007 (n: the tokens so far)
      pass
    if job.finish_reason == "error":
      return _error(api.RequestError(f"generation failed: {job.error}", status=500, kind="server_error"))
    finish = api.finish_reason(job.finish_reason, text.stopped)
    return web.json_response(api.response(chat, api.new_id(chat), self.name, text.delta(final=True), finish,
                                          api.usage(len(job.prompt), n)))

  async def _stream(self, request: web.Request, chat: bool, s: dict, job: Job,
                    queue: asyncio.Queue) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    rid, text, n = api.new_id(chat), api.TextStream(self.tok, s["stop"]), 0

    async def send(obj: Any) -> None:
      await resp.write(b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n")

    if chat:
      await send(api.chunk(chat, rid, self.name, "", None, first=True))
    async for n in self._tokens(job, queue, text):  # noqa: B007 (n: the tokens so far)
      delta = text.delta()
      if delta:
        await send(api.chunk(chat, rid, self.name, delta, None))
    finish = api.finish_reason(job.finish_reason, text.stopped)
    await send(api.chunk(chat, rid, self.name, text.delta(final=True), finish))
    if s["include_usage"]:
      await send(api.chunk(chat, rid, self.name, None, None, use=api.usage(len(job.prompt), n)))
    await send(b"[DONE]")
    await resp.write_eof()
    return resp


async def _start(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
  runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
  await runner.setup()
  site = web.TCPSite(runner, host, port)
  await site.start()
  return runner, site._server.sockets[0].getsockname()[1]


class BackgroundServer:
  """The server on its own thread and event loop (tests, benchmarks): `.url`, `.close()`."""

  def __init__(self, service: Service, host: str = "127.0.0.1", port: int = 0):
    self.loop = asyncio.new_event_loop()
    ready = threading.Event()
    self.error: BaseException | None = None

    def run() -> None:
      asyncio.set_event_loop(self.loop)
      try:
        self.runner, self.port = self.loop.run_until_complete(_start(service.app(), host, port))
      except BaseException as e:   # reported by the constructor
        self.error = e
        ready.set()
        return
      ready.set()
      self.loop.run_forever()

    self.thread = threading.Thread(target=run, name="tformer-serve-http", daemon=True)
    self.thread.start()
    ready.wait(timeout=60)
    if self.error is not None:
      raise self.error
    self.url = f"http://{host}:{self.port}"

  def close(self) -> None:
    fut = asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop)
    fut.result(timeout=30)
    self.loop.call_soon_threadsafe(self.loop.stop)
    self.thread.join(timeout=30)


def serve_forever(service: Service, host: str, port: int) -> None:
  """Run until interrupted (the CLI)."""
  async def main() -> None:
    runner, bound = await _start(service.app(), host, port)
    print(f"tformer-serve: {service.name} on http://{host}:{bound} ({service.engine.num_slots} slots of "
          f"{service.engine.max_len} tokens, queue {service.engine.max_queue})", flush=True)
    try:
      await asyncio.Event().wait()
    finally:
      await runner.cleanup()
  try:
    asyncio.run(main())
  except KeyboardInterrupt:
    pass
