"""Serve a model over HTTP in the OpenAI format (/v1/completions, /v1/chat/completions, /health).

  tformer-serve --workdir=runs/gpt2_tiny --port=8000
  tformer-serve --hf=path/to/hf_model --slots=16 --max_len=2048 --cache_dtype=int8
  tformer-serve --random_init --config=gpt2_tiny                       # smoke test

--hf=DIR is the default config (or --config's) with train.init_from=hf:DIR: --config.decode.* and
--config.runtime.* overrides apply. Requests are continuously batched over --slots cache slots of
--max_len tokens (default the model's max_len); at most --max_queue requests wait, beyond that the
server answers 429.
"""
from __future__ import annotations

import errno
import socket
from typing import Any, Sequence

from absl import flags

from tformer_jax import backends, cli_common, config as config_lib, model_loading
from tformer_jax.checkpoint import CheckpointError, restore_params
from tformer_jax.ops import kv_quant


def define_flags(fv: flags.FlagValues) -> None:
  flags.DEFINE_string("workdir", None, "training workdir (config.json + checkpoints/)", flag_values=fv)
  flags.DEFINE_string("hf", None, "Hugging Face model directory", flag_values=fv)
  flags.DEFINE_bool("random_init", False, "random weights from --config", flag_values=fv)
  flags.DEFINE_integer("seed", 0, "random-init seed", flag_values=fv)
  flags.DEFINE_string("host", "127.0.0.1", "interface to listen on", flag_values=fv)
  flags.DEFINE_integer("port", 8000, "port (0: any free one, printed)", flag_values=fv)
  flags.DEFINE_string("model_name", "tformer", "the model id clients name in requests", flag_values=fv)
  flags.DEFINE_integer("slots", 8, "sequences decoded together (cache slots)", flag_values=fv)
  flags.DEFINE_integer("max_len", 0, "tokens per slot, prompt + completion (0: the model's max_len)",
                       flag_values=fv)
  flags.DEFINE_integer("max_queue", 64, "requests allowed to wait for a slot", flag_values=fv)
  flags.DEFINE_string("cache_dtype", None, "KV cache storage: '' (model dtype) | bfloat16 | int8 "
                      "(default: the config's decode.cache_dtype)", flag_values=fv)
  flags.DEFINE_bool("scan_layers", None, "decode with scanned (or --noscan_layers unrolled) layers; "
                    "default: the runtime's choice (runtime.decode_layout)", flag_values=fv)


def parse_args(argv: Sequence[str] | None) -> Any:
  args = cli_common.parse(argv, define_flags, doc=__doc__, prog="tformer-serve", config=True,
                          from_workdir=True, from_hf=True)
  cli_common.check_model_source(args)
  if args.slots < 1 or args.max_queue < 0 or args.max_len < 0:
    cli_common.fail("--slots must be >= 1, --max_queue and --max_len >= 0")
  if args.cache_dtype is not None and args.cache_dtype not in kv_quant.CACHE_DTYPES:
    cli_common.fail(f"--cache_dtype: one of {kv_quant.CACHE_DTYPES[1:]} or '', got {args.cache_dtype!r}")
  if args.config is not None:      # before any weights are read: a table the model does not have
    try:
      model_loading.check_max_len(args.config, args.max_len)
    except config_lib.ConfigError as e:
      cli_common.fail(str(e))
  return args


def check_address(host: str, port: int) -> None:
  """A usage error (one line) unless `host`:`port` can be listened on now: a port out of range, a host that
  does not resolve to a local interface, a port in use. Checked before the model is loaded."""
  if not 0 <= port <= 65535:
    cli_common.fail(f"--port={port}: must be in 0..65535 (0: any free port)")
  try:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
  except (OSError, UnicodeError) as e:
    cli_common.fail(f"--host={host}: cannot be resolved ({getattr(e, 'strerror', None) or e})")
  family, kind, proto, _, address = infos[0]
  try:
    with socket.socket(family, kind, proto) as s:
      s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)     # as aiohttp binds: a TIME_WAIT port is free
      s.bind(address)
  except OSError as e:
    what = "is in use (another server listens there)" if e.errno == errno.EADDRINUSE else "cannot be listened on"
    cli_common.fail(f"--host={host} --port={port}: {what} ({e.strerror or e}); pass another --port (0: any free "
                    "one) or --host")


def load(args: Any) -> tuple[Any, Any, Any]:
  if args.random_init:
    return model_loading.random_init(args.config, args.seed)
  if args.hf:
    return model_loading.load_hf(args.hf)
  _, params = restore_params(args.workdir)
  model = model_loading.model_from_config(args.config)
  tokenizer = model_loading.tokenizer_from_config(args.config)
  return model, model_loading.check_params(model, params, args.workdir), tokenizer


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  cli_common.require_extra("tformer-serve", "serve")     # aiohttp, before any model is loaded
  check_address(args.host, args.port)
  try:
    model, params, tok = load(args)
  except (CheckpointError, config_lib.ConfigError) as e:
    cli_common.fail(str(e))
  from tformer_jax.serve import Engine, http  # noqa: PLC0415 (aiohttp: the 'serve' extra)
  cfg = args.config if args.config is not None else config_lib.default_config()
  cache_dtype = args.cache_dtype if args.cache_dtype is not None else cfg.decode.get("cache_dtype", "")
  runtime = backends.resolve_runtime(cfg, model=model.cfg, quiet=True)
  backends.enable_compilation_cache(cfg.data.get("cache_dir", "") if "data" in cfg else "")
  with backends.use(runtime.backend):
    engine = Engine(model, params, num_slots=args.slots, max_len=args.max_len or None,
                    max_queue=args.max_queue, scan_layers=args.scan_layers, cache_dtype=cache_dtype)
    engine.warmup()
    engine.start()
    try:
      http.serve_forever(http.Service(engine, tok, args.model_name), args.host, args.port)
    except OSError as e:      # the address taken while the model loaded
      cli_common.fail(f"--host={args.host} --port={args.port}: cannot be listened on ({e.strerror or e})")
    finally:
      engine.close()
  return 0


def entry() -> None:
  """The `tformer-serve` console command."""
  cli_common.exit_process(cli_common.run_main(main))   # bounded: no thread left behind holds the exit


if __name__ == "__main__":
  entry()
