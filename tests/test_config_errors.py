"""Bad values are one line `error: <field>: <rule>` with exit status 2, before anything compiles or
touches the workdir; unknown fields name the closest valid ones; the errors a user can cause later
(data, checkpoints, Orbax, HF, distributed start-up) are one line too; unexpected exceptions keep
their traceback."""
from __future__ import annotations

import os
import pathlib
import socket
import sys
import textwrap
import time

import ml_collections
import pytest

from tformer_jax import cli_common, config as config_lib
from tformer_jax.config import ConfigError, ModelConfig, check_field_path, default_config, validate

from train_utils import REPO, env, run, tiny_config, train_cmd

LLAMA3 = {"model.rope_scaling.type": "llama3", "model.rope_scaling.factor": 2.0}
YARN = {"model.rope_scaling.type": "yarn", "model.rope_scaling.factor": 2.0}
MOE = {"model.moe.num_experts": 4}

# (overrides of tiny_config(steps=20): RoPE, max_len 64, seq_len 32), the field the error names
BAD = [
    ({"decode.top_p": 2.0}, "decode.top_p"),
    ({"decode.top_p": 0.0}, "decode.top_p"),
    ({"decode.temperature": -1.0}, "decode.temperature"),
    ({"decode.top_k": -1}, "decode.top_k"),
    ({"decode.repetition_penalty": 0.0}, "decode.repetition_penalty"),
    ({"optim.name": "rmsprop"}, "optim.name"),
    ({"optim.eps": -1.0}, "optim.eps"),
    ({"optim.eps": 0.0}, "optim.eps"),
    ({"optim.warmup_fraction": 0.99}, "optim.warmup_fraction"),  # round(0.99 * 20) = 20 steps
    ({"optim.warmup_fraction": 1.5}, "optim.warmup_fraction"),
    ({"optim.warmup_steps": -1}, "optim.warmup_steps"),
    ({"optim.clip_norm": -1.0}, "optim.clip_norm"),
    ({"optim.b2": 1.0}, "optim.b2"),
    ({"optim.peak_lr": float("nan")}, "optim.peak_lr"),
    ({"optim.schedule": "cosin"}, "optim.schedule"),
    ({"data.worker_count": -1}, "data.worker_count"),
    ({"data.seed": -1}, "data.seed"),
    ({"data.seq_len": 128}, "data.seq_len"),                       # > max_len, RoPE
    ({"data.seq_len": 128, "model.position": "alibi"}, "data.seq_len"),
    ({"data.seq_len": 128, "model.position": "learned"}, "data.seq_len"),
    ({"data.bpe_vocab_size": 0}, "data.bpe_vocab_size"),
    ({"data.corpus": "shakspeare"}, "data.corpus"),
    ({"data.corpus": "text:"}, "data.corpus"),
    ({"data.corpus": "txt:/data/book.txt"}, "data.corpus"),
    ({"data.corpus": "text:/nonexistent/book.txt"}, "data.corpus"),
    ({"data.tokenizer": "bytes"}, "data.tokenizer"),
    ({"data.tokenizer": "hf:"}, "data.tokenizer"),
    ({"data.tokenizer": "spm:/nonexistent/m.model"}, "data.tokenizer"),
    ({"data.val_fraction": 0.6}, "data.val_fraction"),
    ({"data.sampling": "sequential"}, "data.sampling"),
    ({"model.window": 65}, "model.window"),                        # > max_len: the same as no window
    ({"model.window": 8, "model.num_global_tokens": 64}, "model.num_global_tokens"),
    ({"model.rope_scaling.original_max_len": -1}, "model.rope_scaling.original_max_len"),
    ({**YARN, "model.rope_scaling.factor": 0.5}, "model.rope_scaling.factor"),
    ({**LLAMA3, "model.rope_scaling.low_freq_factor": 4.0, "model.rope_scaling.high_freq_factor": 1.0},
     "model.rope_scaling.high_freq_factor"),
    ({**YARN, "model.rope_scaling.beta_fast": 1.0, "model.rope_scaling.beta_slow": 32.0},
     "model.rope_scaling.beta_fast"),
    ({**YARN, "model.rope_scaling.attention_factor": -1.0}, "model.rope_scaling.attention_factor"),
    ({"model.position": "t5", "model.t5_num_buckets": 1}, "model.t5_num_buckets"),
    ({"model.position": "t5", "model.t5_max_distance": 8}, "model.t5_max_distance"),  # <= 16 exact buckets
    ({**MOE, "model.moe.jitter": -0.5}, "model.moe.jitter"),
    ({**MOE, "model.moe.d_ff": -8}, "model.moe.d_ff"),
    ({**MOE, "model.moe.dispatch": "dropful"}, "model.moe.dispatch"),
    ({"model.moe.z_loss_coef": -1.0}, "model.moe.z_loss_coef"),
    ({"model.norm_eps": float("inf")}, "model.norm_eps"),
    ({"train.sample_tokens": -1}, "train.sample_tokens"),
    ({"train.stats_every": -1}, "train.stats_every"),
    ({"train.init_from": "/nonexistent/run"}, "train.init_from"),
    ({"mesh.axes": ("data", "data", "tensor")}, "mesh.axes"),
    ({"mesh.axes": ("data", "", "tensor")}, "mesh.axes"),
    ({"mesh.rules": "dpp"}, "mesh.rules"),
    ({"runtime.attention": "flsh"}, "runtime.attention"),
]


@pytest.mark.parametrize("overrides,field", BAD, ids=[f"{f}:{list(o.values())[-1]}" for o, f in BAD])
def test_bad_value_is_one_line_naming_the_field(overrides, field):
  with pytest.raises(ConfigError) as e:
    validate(tiny_config(steps=20, **overrides))
  message = str(e.value)
  assert message.startswith(f"{field}: ") and "\n" not in message, message


def test_the_limits_themselves_are_valid(tmp_path):
  run_dir = tmp_path / "run"
  run_dir.mkdir()
  (run_dir / "config.json").write_text("{}")
  book = tmp_path / "book.txt"
  book.write_text("text")
  validate(tiny_config(steps=20, **{
      "model.window": 64, "data.seq_len": 64, "optim.warmup_steps": 19, "decode.top_p": 1.0,
      "decode.temperature": 0.0, "decode.top_k": 0, "train.init_from": str(run_dir),
      "data.corpus": f"text:{book}", "data.tokenizer": f"hf:{tmp_path}", "train.sample_tokens": 0}))
  c = tiny_config(steps=20)
  c.mesh = ml_collections.ConfigDict({**c.mesh.to_dict(), "rules": (("batch", "data"), ("embed", None))})
  validate(c)                                                        # explicit (logical, mesh axis) rules
  validate(tiny_config(steps=1))                                     # warmup 0 for a 1-step run
  validate(tiny_config(steps=20, **{"optim.warmup_fraction": 0.5, "optim.warmup_steps": 500}))
  validate(tiny_config(steps=20, **{"data.corpus": "synthetic:reverse", "data.tokenizer": "hf:/gone"}))
  # Paths are checked only when asked (tools that only read the architecture pass check_paths=False).
  validate(tiny_config(steps=20, **{"train.init_from": "/nonexistent/run"}), check_paths=False)


def test_init_from_must_be_a_training_workdir(tmp_path):
  with pytest.raises(ConfigError, match=r"^train\.init_from: .*not a training workdir"):
    validate(tiny_config(**{"train.init_from": str(tmp_path)}))


@pytest.mark.parametrize("path,message", [
    ("model.num_layer", "model.num_layer: unknown field; did you mean model.num_layers?"),
    ("model.moe.topk", "model.moe.topk: unknown field; did you mean model.moe.top_k?"),
    ("optim.lr", "optim.lr: unknown field; did you mean optim.min_lr_ratio or optim.peak_lr?"),
    ("modle.d_model", "modle: unknown field; did you mean model?"),
    ("decode.topp", "decode.topp: unknown field; did you mean decode.top_p?"),
    ("model.d_model.x", "model.d_model: is a value (256), not a section; model.d_model.x names no field"),
])
def test_unknown_field_names_the_closest(path, message):
  with pytest.raises(ConfigError) as e:
    check_field_path(default_config(), path)
  assert str(e.value) == message


def test_unknown_field_without_a_close_name_lists_the_section():
  with pytest.raises(ConfigError) as e:
    check_field_path(default_config(), "optim.foo")
  assert str(e.value).startswith("optim.foo: unknown field; the fields of optim are: b1, b2, clip_norm, ")


def test_validate_finds_unknown_fields_and_wrong_types_in_config_files():
  c = tiny_config()
  c.train.unlock()
  c.train.step = 5                                   # a config file's typo makes a new field
  with pytest.raises(ConfigError, match=r"^train\.step: unknown field; did you mean train\.steps\?$"):
    validate(c)
  c = tiny_config()
  c.unlock()
  c.optimizer = ml_collections.ConfigDict({"peak_lr": 1e-3})
  with pytest.raises(ConfigError, match=r"^optimizer: unknown field; did you mean optim\?$"):
    validate(c)
  c = tiny_config()
  c.data = ml_collections.ConfigDict({**c.data.to_dict(), "seq_len": "32"})   # a section rebuilt by hand
  with pytest.raises(ConfigError, match=r"^data\.seq_len: expected an integer, got '32' \(str\)$"):
    validate(c)
  c = tiny_config()
  c.model = ml_collections.ConfigDict({**c.model.to_dict(), "tie_embeddings": 1})
  with pytest.raises(ConfigError, match=r"^model\.tie_embeddings: expected true or false"):
    validate(c)
  with pytest.raises(ConfigError, match=r"^model\.rope_scaling\.typ: unknown field; did you mean "):
    ModelConfig.from_config({"rope_scaling": {"typ": "linear"}})


def test_config_values_agree_with_the_modules_that_read_them():
  from tformer_jax.data import corpora, tokenizers
  from tformer_jax.parallel import rules
  from tformer_jax.train import optim, precision
  assert set(config_lib.CORPORA) == set(corpora.CORPORA)
  assert {s.split(":")[0] + ":" for s in corpora.KNOWN_SPECS if ":" in s} == set(config_lib.CORPUS_PREFIXES)
  specs = tokenizers.TOKENIZER_SPECS
  assert {s for s in specs if ":" not in s} == set(config_lib.TOKENIZERS)
  assert {s.split(":")[0] + ":" for s in specs if ":" in s} == set(config_lib.TOKENIZER_PREFIXES)
  assert set(rules.PRESETS) == set(config_lib.RULE_PRESETS)
  assert set(precision.PRECISIONS) == set(config_lib.PRECISIONS)
  o = default_config().optim
  for kind in config_lib.SCHEDULES:
    o.schedule = kind
    optim.make_schedule(o, 100)


# -- the mapping of exceptions to one line and exit status 2 ------------------------------------------

def _raised_in(filename: str, exc: BaseException) -> BaseException:
  """`exc` raised by code whose file is `filename` (as if a library there raised it)."""
  code = compile("def boom(e):\n  raise e\n", filename, "exec")
  scope: dict = {}
  exec(code, scope)                  # a function that lives in a fake file
  try:
    scope["boom"](exc)
  except BaseException as e:
    return e
  raise AssertionError("not raised")


def _anticipated():
  from tformer_jax.checkpoint import CheckpointError
  from tformer_jax.data.corpora import DataError
  from tformer_jax.interop.families import HFConfigError
  from tformer_jax.interop.hf import HFWeightsError
  from tformer_jax.parallel.distributed import DistributedError
  from tformer_jax.train.loop import TrainingError
  from tformer_jax.train.workdir import WorkdirBusy
  return [ConfigError("model.x: bad"), cli_common.UsageError("pass --workdir"), DataError("corpus: bad"),
          CheckpointError("no restorable checkpoint in /w; every step failed:\n  step 3: ValueError: x"),
          HFConfigError("llama: unsupported x"), HFWeightsError("w"), DistributedError("distributed: no"),
          TrainingError("5 consecutive non-finite steps"), WorkdirBusy("workdir: /w is in use"),
          FileNotFoundError(2, "No such file or directory", "/p")]


def test_error_message_maps_every_anticipated_class_to_one_line():
  for e in _anticipated():
    message = cli_common.error_message(e)
    assert message and "\n" not in message, (type(e), message)
  assert cli_common.error_message(_anticipated()[3]) == (
      "no restorable checkpoint in /w; every step failed: step 3: ValueError: x")
  orbax = _raised_in("/x/site-packages/orbax/checkpoint/_src/fake.py", ValueError("NOT_FOUND: a\nb"))
  assert cli_common.error_message(orbax) == "checkpoint storage (orbax): ValueError: NOT_FOUND: a; b"
  store = type("TensorStoreError", (RuntimeError,), {"__module__": "tensorstore"})("DATA_LOSS: x")
  assert cli_common.error_message(store).startswith("checkpoint storage (tensorstore): ")
  # Unexpected: plain errors of our code, and programming errors even inside Orbax.
  for e in (ValueError("bug"), RuntimeError("bug"), KeyError("k"),
            _raised_in("/x/site-packages/orbax/checkpoint/fake.py", TypeError("bad argument"))):
    assert cli_common.error_message(e) is None, e


def test_run_main_exit_statuses(capsys):
  def fails(e):
    raise e
  assert cli_common.run_main(fails, ConfigError("decode.top_p: must be in (0, 1]")) == 2
  assert capsys.readouterr().err == "error: decode.top_p: must be in (0, 1]\n"
  with pytest.raises(RuntimeError, match="a bug"):
    cli_common.run_main(fails, RuntimeError("a bug"))
  assert [cli_common.run_main(lambda r=r: r) for r in (None, 0, 1, {"a": 1}, True)] == [0, 0, 1, 0, 0]


def test_train_cli_maps_errors_raised_while_training(monkeypatch, capsys, tmp_path):
  """In-process: tformer-train's main() under run_main, with loop.train raising each anticipated
  error (one line, status 2) and an unexpected one (propagates, so the traceback is printed)."""
  from tformer_jax.cli import train as cli
  from tformer_jax.train import loop
  argv = [f"--config={REPO / 'configs' / 'shakespeare_char.py'}", f"--workdir={tmp_path / 'run'}"]
  for error in _anticipated():
    def train(cfg, workdir, error=error, **_):
      raise error
    monkeypatch.setattr(loop, "train", train)
    assert cli_common.run_main(cli.main, argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
  monkeypatch.setattr(loop, "train", lambda cfg, workdir, **_: {}.pop("unexpected"))
  with pytest.raises(KeyError):
    cli_common.run_main(cli.main, argv)


def test_parse_and_override_name_the_closest_field(capsys):
  cfg_file = str(REPO / "configs" / "gpt2_tiny.py")
  for argv in ([f"--config={cfg_file}", "--config.model.num_layer=2"],
               ["--config.model.num_layer", "2", f"--config={cfg_file}"]):
    with pytest.raises(SystemExit) as e:
      cli_common.parse(argv, config="required")
    assert e.value.code == 2
    assert capsys.readouterr().err == "error: model.num_layer: unknown field; did you mean model.num_layers?\n"
  with pytest.raises(cli_common.UsageError) as e:
    cli_common.override(default_config(), {"model.num_layer": "2"})
  assert str(e.value) == "model.num_layer: unknown field; did you mean model.num_layers?"


# -- scripts/train.py, real processes ------------------------------------------------------------------

CLI_BAD = [  # (flags, the error line, exactly or its start)
    (["--config.model.num_layer=3"], "error: model.num_layer: unknown field; did you mean model.num_layers?"),
    (["--config.model.foo=1"], "error: model.foo: unknown field; the fields of model are: "),
    (["--config.train.init_from=/nonexistent/run"], "error: train.init_from: /nonexistent/run: no such "),
    (["--config.optim.name=rmsprop"], "error: optim.name: unknown value 'rmsprop'; expected 'adamw', "),
    (["--config.decode.top_p=2.0"], "error: decode.top_p: must be in (0, 1]"),
    (["--config.decode.temperature=-1"], "error: decode.temperature: must be >= 0"),
    (["--config.model.window=100"], "error: model.window: window=100 > max_len=64 is the same as no window"),
    (["--config.data.seq_len=128"], "error: data.seq_len: seq_len=128 exceeds model.max_len=64"),
    (["--config.train.steps=3", "--config.optim.warmup_fraction=0.9"], "error: optim.warmup_fraction: a warmup "
                                                                        "of 3 steps is not shorter than train.steps=3"),
    (["--config.optim.eps=-1"], "error: optim.eps: must be > 0"),
    (["--config.data.worker_count=-1"], "error: data.worker_count: must be >= 0"),
    (["--config.data.corpus=shakspeare"], "error: data.corpus: unknown value 'shakspeare'; did you mean "
                                          "'shakespeare'?"),
    (["--config.mesh.axes=('data','data','tensor')"], "error: mesh.axes: axis names must be unique"),
]


def _cli(workdir: pathlib.Path, *flags: str):
  cmd = train_cmd(workdir, *flags)
  if "--config.train.steps=3" in flags:           # train_cmd would shorten the warmup to fit: keep 5
    cmd.append("--config.optim.warmup_steps=5")
  t0 = time.monotonic()
  r = run(cmd, timeout=120)
  return r, time.monotonic() - t0


@pytest.mark.parametrize("flags,line", CLI_BAD, ids=[f[0].split("=")[0][9:] for f, _ in CLI_BAD])
def test_train_cli_bad_value_fails_fast_without_touching_the_workdir(tmp_path, flags, line):
  work = tmp_path / "run"
  r, seconds = _cli(work, *flags)
  assert r.returncode == 2, r.stderr[-2000:]
  assert r.stderr.startswith(line) and len(r.stderr.strip().splitlines()) == 1, r.stderr[-2000:]
  assert not work.exists()
  assert seconds < 15, seconds        # jax is never imported (about 0.3 s on an idle machine)


def test_train_cli_bad_value_leaves_an_existing_workdir_unchanged(tmp_path):
  work = tmp_path / "run"
  (work / "checkpoints" / "4").mkdir(parents=True)
  (work / "config.json").write_text('{"model": {}}')
  (work / "metrics.jsonl").write_text('{"step": 4}\n')
  past = time.time() - 3600
  for p in work.rglob("*"):
    os.utime(p, (past, past))
  os.utime(work, (past, past))
  before = {str(p): (p.stat().st_mtime, p.is_file() and p.read_bytes()) for p in [work, *work.rglob("*")]}
  for flags in (["--config.decode.top_p=2.0"], ["--config.model.num_layer=3"]):
    r, _ = _cli(work, *flags)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr[-2000:]
  after = {str(p): (p.stat().st_mtime, p.is_file() and p.read_bytes()) for p in [work, *work.rglob("*")]}
  assert after == before


def _closed_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_wait_for_coordinator():
  from tformer_jax.parallel import distributed
  with socket.socket() as server:
    server.bind(("127.0.0.1", 0))
    server.listen()
    distributed.wait_for_coordinator(f"127.0.0.1:{server.getsockname()[1]}", 5.0)
  t0 = time.monotonic()
  with pytest.raises(distributed.DistributedError, match=r"^distributed: cannot reach the coordinator "):
    distributed.wait_for_coordinator(f"127.0.0.1:{_closed_port()}", 0.5)
  assert time.monotonic() - t0 < 5


def test_train_cli_distributed_start_up_errors_are_one_line(tmp_path, monkeypatch):
  """Bad settings, and a coordinator that cannot be reached (jax's client would abort the process
  from C++, status 134, when it cannot register in time)."""
  monkeypatch.setenv("TFORMER_INIT_TIMEOUT", "2")
  for flags, needle in ((["--coordinator_address=localhost"], "expected host:port"),
                        (["--coordinator_address=127.0.0.1:1", "--num_processes=2", "--process_id=5"],
                         "process_id: must be in [0, 2), got 5"),
                        ([f"--coordinator_address=127.0.0.1:{_closed_port()}", "--num_processes=2",
                          "--process_id=1"], "cannot reach the coordinator 127.0.0.1:")):
    r, _ = _cli(tmp_path / "run", *flags)
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr[-2000:]
    assert not (tmp_path / "run").exists()


SCRIPT = textwrap.dedent("""
    import sys
    from tformer_jax import cli_common
    from tformer_jax.cli import train as cli
    from tformer_jax.train import loop
    def train(cfg, workdir, **_):
      if sys.argv[1] == "checkpoint":
        from tformer_jax.checkpoint import CheckpointError
        raise CheckpointError("checkpoint step 3 in /w does not fit the state being restored:\\n  x: (2,) vs (3,)")
      raise RuntimeError("an unexpected bug")
    loop.train = train
    cli_common.exit_process(cli_common.run_main(cli.main, sys.argv[2:]))
""")


def test_train_cli_late_errors_one_line_and_unexpected_keep_the_traceback(tmp_path):
  script = tmp_path / "patched_train.py"
  script.write_text(SCRIPT)
  base = train_cmd(tmp_path / "run")[2:]
  e = {**env(), "TFORMER_JAX_ALLOCATOR": "system"}                 # no re-exec of the patched script
  r = run([sys.executable, str(script), "checkpoint", *base], env=e, timeout=120)
  assert r.returncode == 2, r.stderr[-2000:]
  assert r.stderr.strip().splitlines()[-1] == ("error: checkpoint step 3 in /w does not fit the state being "
                                              "restored: x: (2,) vs (3,)")
  assert "Traceback" not in r.stderr
  r = run([sys.executable, str(script), "bug", *base], env=e, timeout=120)
  assert r.returncode == 1
  assert "Traceback (most recent call last)" in r.stderr and "RuntimeError: an unexpected bug" in r.stderr


STUCK = textwrap.dedent("""
    import sys, threading
    from tformer_jax import cli_common
    from tformer_jax.config import ConfigError

    class Stuck(threading.Thread):      # like Orbax's: join(timeout) raises once the time is up
      def join(self, timeout=None):
        super().join(timeout)
        if self.is_alive():
          raise TimeoutError("still running")

    def main():
      Stuck(target=threading.Event().wait).start()     # never ends, not a daemon
      raise ConfigError("checkpoint: the save failed")
    cli_common.exit_process(cli_common.run_main(main), grace_s=1.0)
""")


def test_exit_process_does_not_hang_on_threads_left_blocked(tmp_path):
  script = tmp_path / "stuck.py"
  script.write_text(STUCK)
  t0 = time.monotonic()
  r = run([sys.executable, str(script)], timeout=60)
  assert r.returncode == 2 and r.stderr == "error: checkpoint: the save failed\n", r.stderr[-2000:]
  assert time.monotonic() - t0 < 30


def test_exit_process_after_a_finished_run_is_bounded_and_names_what_was_left(tmp_path):
  """A command that finished its work (status 0) with a thread still waiting (an async save's, after a fallback
  from a damaged step) exits 0 after the grace period, in one log line naming the thread."""
  script = tmp_path / "left.py"
  script.write_text(STUCK.replace('raise ConfigError("checkpoint: the save failed")', "return 0")
                    .replace("Stuck(target=", "Stuck(name='orbax-save', target=")
                    .replace("exit_process(", "setup_logging(); cli_common.exit_process(", 1))
  t0 = time.monotonic()
  r = run([sys.executable, str(script)], timeout=60)
  assert r.returncode == 0, r.stderr[-2000:]
  lines = [x for x in r.stderr.splitlines() if "exit:" in x]
  assert len(lines) == 1 and "1 thread(s) still running" in lines[0] and "orbax-save" in lines[0], r.stderr[-2000:]
  assert time.monotonic() - t0 < 30


@pytest.mark.slow
def test_train_cli_unwritable_checkpoint_dir_is_one_line_and_exits(tmp_path):
  """WORKDIR/checkpoints is a file: a one-line error and status 2, not a traceback, and no hang at exit
  (Orbax's async save fails there and leaves its threads blocked: cli_common.exit_process)."""
  work = tmp_path / "run"
  work.mkdir()
  (work / "checkpoints").write_text("not a directory")
  r = run(train_cmd(work, "--config.train.steps=2", "--config.train.eval_every=2",
                    "--config.train.ckpt_every=2"), timeout=240)
  assert r.returncode == 2, r.stderr[-3000:]
  last = r.stderr.strip().splitlines()[-1]
  assert last.startswith("error: ") and "checkpoints" in last, r.stderr[-3000:]
  assert "tformer_jax/cli/train.py" not in r.stderr      # Orbax's threads may log their own; none of ours
