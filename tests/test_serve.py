"""The OpenAI-compatible server through real HTTP on 127.0.0.1 with the official `openai` client:
greedy == tformer-generate, 16 concurrent requests == one at a time (continuous batching, one compiled
step), streaming == non-streaming, 4xx JSON errors, a disconnecting client frees its slot."""
import concurrent.futures
import http.client
import json
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("aiohttp")

from tformer_jax import backends, cli_common, decode, model_loading  # noqa: E402
from tformer_jax.cli import generate as generate_cli  # noqa: E402
from tformer_jax.serve import Engine, EngineError, Job  # noqa: E402
from tformer_jax.serve.http import BackgroundServer, Service  # noqa: E402

CONFIG = """from tformer_jax.config import default_config
def get_config():
  c = default_config()
  c.model.update(dict(d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, max_len=64, position='rope'))
  return c
"""
NAME = "tiny"
SLOTS = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
  cfg_file = tmp_path_factory.mktemp("serve") / "tiny_cfg.py"
  cfg_file.write_text(CONFIG)
  cfg = cli_common.load_named_config(str(cfg_file))
  model, params, tok = model_loading.random_init(cfg, 0)
  runtime = backends.resolve_runtime(cfg, model=model.cfg, quiet=True)   # what tformer-generate runs
  with backends.use(runtime.backend):
    engine = Engine(model, params, num_slots=SLOTS, max_len=64, max_queue=32)
    engine.warmup()
    engine.start()
  srv = BackgroundServer(Service(engine, tok, NAME))
  client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
  yield dict(url=srv.url, client=client, engine=engine, cfg_file=cfg_file, tok=tok, model=model, params=params)
  srv.close()
  engine.close()


def _complete(client, prompt, max_tokens, **kw):
  r = client.completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens, **kw)
  return r.choices[0].text, r.choices[0].finish_reason, r.usage


def test_greedy_completion_equals_tformer_generate(server, capsys):
  text, finish, usage = _complete(server["client"], "ROMEO:", 12, temperature=0)
  generate_cli.main(["--random_init", f"--config={server['cfg_file']}", "--prompt=ROMEO:", "--temperature=0",
                     "--max_new_tokens=12"])
  out = capsys.readouterr().out
  assert out.startswith("ROMEO:") and text == out[len("ROMEO:"):-1]
  assert finish == "length" and (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (6, 12, 18)
  health = json.loads(urllib.request.urlopen(server["url"] + "/health").read())
  assert health["status"] == "ok" and health["slots"] == SLOTS and health["busy"] == 0


def test_16_concurrent_requests_equal_one_at_a_time(server):
  client, engine = server["client"], server["engine"]
  rng = np.random.default_rng(0)
  reqs = [dict(prompt="".join(chr(c) for c in rng.integers(97, 123, 1 + 3 * i)), max_tokens=int(4 + (7 * i) % 13),
               temperature=0.0 if i % 3 else 0.9, seed=i) for i in range(16)]
  alone = [_complete(client, **r) for r in reqs]
  compiles = [n for n, _ in decode.COMPILE_LOG if n == "slot_step"]
  steps_before = engine.stats()["steps"]
  with concurrent.futures.ThreadPoolExecutor(16) as pool:
    together = list(pool.map(lambda r: _complete(client, **r), reqs))
  assert together == alone
  assert [n for n, _ in decode.COMPILE_LOG if n == "slot_step"] == compiles      # no compile per request
  assert len(compiles) == len(decode.slot_buckets(SLOTS)) == 3                     # warmup: 1, 2, 4 slots
  tokens = sum(r["max_tokens"] for r in reqs)
  assert engine.stats()["steps"] - steps_before < tokens / 2      # requests shared steps (4 slots)


def test_streaming_yields_the_non_streaming_text(server):
  client = server["client"]
  text, _, usage = _complete(client, "To be, or not", 20, temperature=0.7, seed=5, stop=["zz"])
  chunks = list(client.completions.create(model=NAME, prompt="To be, or not", max_tokens=20, temperature=0.7,
                                          seed=5, stop=["zz"], stream=True, stream_options={"include_usage": True}))
  assert "".join(c.choices[0].text for c in chunks if c.choices) == text
  assert chunks[-1].usage.completion_tokens == usage.completion_tokens and len(chunks) > 3
  msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
  whole = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=10, temperature=0)
  parts = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=10, temperature=0, stream=True)
  assert "".join(c.choices[0].delta.content or "" for c in parts) == whole.choices[0].message.content
  # plain turns (the byte tokenizer has no chat template): the prompt ends with 'Assistant:'
  assert whole.usage.prompt_tokens == len("System: Be brief.\nUser: Hello\nAssistant:")


def test_stop_string_cuts_the_text(server):
  client = server["client"]
  full, _, _ = _complete(client, "abc", 16, temperature=0)
  stop = full[3:5]
  cut, finish, _ = _complete(client, "abc", 16, temperature=0, stop=[stop])
  assert cut == full[:full.index(stop)] and finish == "stop"


def _post(url, body: bytes):
  req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
  try:
    urllib.request.urlopen(req)
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read())["error"]
  raise AssertionError("expected an HTTP error")


def test_bad_requests_get_a_4xx_json_error(server):
  client, url = server["client"], server["url"]
  code, err = _post(url, b'{"model": "tiny", "prompt": ')
  assert code == 400 and "not valid JSON" in err["message"]
  with pytest.raises(openai.BadRequestError, match="unknown field 'frobnicate'"):
    client.completions.create(model=NAME, prompt="x", max_tokens=2, extra_body={"frobnicate": 1})
  with pytest.raises(openai.BadRequestError, match="exceeds the server's max_len of 64"):
    client.completions.create(model=NAME, prompt="x" * 70, max_tokens=2)
  with pytest.raises(openai.BadRequestError, match="max_tokens must be an integer >= 1"):
    client.completions.create(model=NAME, prompt="x", max_tokens=-3)
  with pytest.raises(openai.NotFoundError, match="does not exist"):
    client.completions.create(model="gpt-9", prompt="x", max_tokens=2)
  with pytest.raises(openai.BadRequestError, match="temperature"):
    client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], temperature=-1)
  with pytest.raises(openai.BadRequestError, match="messages"):
    client.chat.completions.create(model=NAME, messages=[{"role": "wizard", "content": "x"}])
  code, err = _post(url.replace("/v1", "") + "/nope", b"{}")
  assert code == 404 and err["type"] == "not_found_error"
  assert json.loads(urllib.request.urlopen(url + "/health").read())["busy"] == 0   # still serving


def test_a_disconnecting_client_frees_its_slot(server):
  engine = server["engine"]
  before = engine.stats()["cancelled"]
  host, port = server["url"][len("http://"):].split(":")
  conn = http.client.HTTPConnection(host, int(port), timeout=60)
  conn.request("POST", "/v1/completions", json.dumps(dict(model=NAME, prompt="a", max_tokens=60, stream=True)),
               {"Content-Type": "application/json"})
  resp = conn.getresponse()
  assert resp.status == 200 and resp.readline().startswith(b"data: ")
  conn.sock.close()                                              # the client goes away mid-stream
  conn.close()
  deadline = time.time() + 60
  while time.time() < deadline and engine.stats()["cancelled"] == before:
    time.sleep(0.05)
  stats = engine.stats()
  assert stats["cancelled"] == before + 1 and stats["busy"] == 0


def test_engine_bounds_its_queue_and_prompt_length(server):
  # not started: the jobs stay queued
  engine = Engine(server["model"], server["params"], num_slots=1, max_len=32, max_queue=2)
  for _ in range(2):
    engine.submit(Job(prompt=[1, 2], max_tokens=4))
  with pytest.raises(EngineError, match="queue is full"):
    engine.submit(Job(prompt=[1, 2], max_tokens=4))
  with pytest.raises(EngineError, match="max_len of 32"):
    engine.check([1] * 30, 3)
  with pytest.raises(EngineError, match="empty"):
    engine.check([], 3)


def test_chat_template_from_tokenizer_config(tmp_path):
  from tformer_jax.serve import api
  template = ("{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
              "{% if add_generation_prompt %}<|assistant|>{% endif %}")
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))

  class Tok:   # the attributes the server reads from an HF tokenizer
    path, bos_id, eos_id = tmp_path / "tokenizer.json", 1, None

    def decode(self, ids):
      return "<s>" if list(ids) == [1] else "?"
  tok = Tok()
  assert api.chat_template(tok) == template
  msgs = api.check_messages([{"role": "developer", "content": "Be brief."},
                             {"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
  assert api.render_chat(msgs, tok, template) == "<s><|system|>Be brief.\n<|user|>Hi\n<|assistant|>"
  assert api.render_chat(msgs, tok, None) == "System: Be brief.\nUser: Hi\nAssistant:"
  with pytest.raises(api.RequestError, match="refused"):
    api.render_chat(msgs, tok, "{{ raise_exception('no system role') }}")


def test_a_body_over_the_limit_is_413_and_a_rejected_stop_list_is_not_echoed(server):
  """A 10 MB body is aiohttp's 413 as JSON (was a 500: the handler's catch-all took aiohttp's own error); a 1 MB
  `stop` list that is refused is quoted in at most a line, not sent back whole."""
  from tformer_jax.serve.http import MAX_BODY_BYTES
  url = server["url"]
  big = json.dumps(dict(model=NAME, prompt="x" * (10 * 1024 * 1024), max_tokens=1)).encode()
  host, port = url[len("http://"):].split(":")
  conn = http.client.HTTPConnection(host, int(port), timeout=60)
  try:
    conn.request("POST", "/v1/completions", big, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    status, err = resp.status, json.loads(resp.read())["error"]
  except (BrokenPipeError, ConnectionResetError):
    pytest.fail("the server closed the connection instead of answering 413")
  finally:
    conn.close()
  assert status == 413 and err["type"] == "invalid_request_error", (status, err)
  assert len(big) > MAX_BODY_BYTES
  stops = ["ab" * 1000] * 500                                    # 1 MB of stop strings, over the limit of 4
  code, err = _post(url, json.dumps(dict(model=NAME, prompt="x", max_tokens=1, stop=stops)).encode())
  assert code == 400 and err["param"] == "stop" and len(err["message"]) < 300, len(err["message"])
  assert "stop must be a non-empty string or a list of at most 4" in err["message"]
  assert json.loads(urllib.request.urlopen(url + "/health").read())["busy"] == 0   # still serving
