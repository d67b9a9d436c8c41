"""tformer-prepare and prepared data under real faults: a directory of the user's own files, the
user's tokenizer inside --out, two prepares into one --out, --overwrite, a full and a read-only disk
(small tmpfs mounts), Ctrl-C to the process group, data errors with one worker in a fresh interpreter,
binary .txt in every split mode. Each fault is injected for real (files, processes, signals, mounts)."""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from tformer_jax.cli import prepare as prepare_cli
from tformer_jax.data.corpora import DataError, load_corpus
from tformer_jax.data.prepared import LOCK, PROGRESS, open_prepared, prepare

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def books(tmp_path_factory) -> pathlib.Path:
  """About 300 KB of Shakespeare's paragraphs, 60 .txt files."""
  text = load_corpus("shakespeare").decode("utf-8")
  paras = [p.strip("\n") for p in text.split("\n\n") if p.strip()][1000:4000]
  root = tmp_path_factory.mktemp("books")
  for i in range(60):
    (root / f"{i:03d}.txt").write_text("\n\n".join(paras[i * 50:(i + 1) * 50]), encoding="utf-8")
  return root


def _files(root: pathlib.Path) -> dict[str, str]:
  return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.iterdir()) if p.is_file()}


def _cli(*argv: str, capsys) -> tuple[int, str]:
  capsys.readouterr()
  rc = prepare_cli.main([*argv, "--noprogress"])
  return rc, capsys.readouterr().err.strip()


def _one_line(err: str) -> str:
  assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
  return err


def _cmd(*args: str, kill_after: int = 0, signal_name: str = "KILL") -> list[str]:
  """tformer-prepare (with kill_after: signalled after committing that many shards, tests/prepare_faults.py)."""
  if kill_after:
    return [sys.executable, str(REPO / "tests" / "prepare_faults.py"), f"--kill-after={kill_after}",
            f"--signal={signal_name}", "--", *args, "--noprogress"]
  return [sys.executable, "-m", "tformer_jax.cli.prepare", *args, "--noprogress"]


# --- owned output directories -------------------------------------------------------------------------

def test_a_directory_of_the_users_own_files_is_refused_untouched(books, tmp_path, capsys):
  out = tmp_path / "mine"
  out.mkdir()
  (out / "tokenizer.json").write_text('{"mine": true}')
  (out / "draft.tmp").write_text("notes")
  (out / "shard-00000.tokens.npy").write_bytes(b"my array")
  before = _files(out)
  rc, err = _cli(f"--source={books}", f"--out={out}", "--tokenizer=byte", capsys=capsys)
  assert rc == 2 and "holds files that are not part of a prepared dataset" in _one_line(err)
  assert _files(out) == before and sorted(p.name for p in out.iterdir()) == sorted(before)
  # --overwrite replaces only a dataset of ours
  rc, err = _cli(f"--source={books}", f"--out={out}", "--tokenizer=byte", "--overwrite", capsys=capsys)
  assert rc == 2 and "not part of a prepared dataset" in _one_line(err) and _files(out) == before
  # a manifest.json of someone else's format does not make a directory ours
  other = tmp_path / "site"
  other.mkdir()
  (other / "manifest.json").write_text('{"name": "my web app"}')
  rc, err = _cli(f"--source={books}", f"--out={other}", "--tokenizer=byte", capsys=capsys)
  assert rc == 2 and "manifest.json" in _one_line(err) and (other / "manifest.json").read_text().startswith('{"name"')


def test_the_users_tokenizer_inside_out_is_never_deleted(books, tmp_path, capsys):
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers  # noqa: PLC0415
  tok = Tokenizer(models.BPE(unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.train_from_iterator([p.read_text() for p in sorted(books.iterdir())[:5]],
                          trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]", "</s>"]))
  hf_dir = tmp_path / "hf_model"
  hf_dir.mkdir()
  tok.save(str(hf_dir / "tokenizer.json"))
  before = _files(hf_dir)
  rc, err = _cli(f"--source={books}", f"--out={hf_dir}", f"--tokenizer=hf:{hf_dir}/tokenizer.json", capsys=capsys)
  assert rc == 2 and "not part of a prepared dataset (tokenizer.json)" in _one_line(err)
  assert _files(hf_dir) == before
  # prepared beside it, the tokenizer and its chat template travel with the data
  (hf_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}", "eos_token": "</s>"}))
  stats = prepare([str(books)], tmp_path / "prep", tokenizer=f"hf:{hf_dir}", progress=False)
  ds = open_prepared(tmp_path / "prep", verify=True)
  assert stats["documents"] == ds.num_documents > 0
  assert (tmp_path / "prep" / "tokenizer_config.json").read_text() == (hf_dir / "tokenizer_config.json").read_text()
  assert set(ds.manifest["tokenizer"]["extra_files"]) == {"tokenizer_config.json"}


def test_overwrite_replaces_our_dataset_atomically(books, tmp_path):
  out = tmp_path / "prep"
  prepare([str(books)], out, tokenizer="byte", shard_tokens=50_000, progress=False)
  old = _files(out)
  with pytest.raises(DataError, match="made with other arguments .*pass --overwrite"):
    prepare([str(books)], out, tokenizer="byte", shard_tokens=80_000, progress=False)
  assert _files(out) == old
  stats = prepare([str(books)], out, tokenizer="byte", shard_tokens=80_000, overwrite=True, progress=False)
  ds = open_prepared(out, verify=True)
  assert stats["path"] == str(out) and ds.manifest["shard_tokens"] == 80_000 and _files(out) != old
  assert sorted(p.name for p in tmp_path.iterdir()) == ["prep"]          # nothing left beside it
  assert not (out / LOCK).exists() and not (out / PROGRESS).exists()


def test_overwrite_onto_a_symlinked_out_replaces_the_target_not_the_link(books, tmp_path):
  real, link = tmp_path / "real", tmp_path / "link"
  prepare([str(books)], real, tokenizer="byte", shard_tokens=40_000, progress=False)
  link.symlink_to(real, target_is_directory=True)
  stats = prepare([str(books)], link, tokenizer="byte", shard_tokens=50_000, overwrite=True, progress=False)
  assert link.is_symlink() and link.resolve() == real.resolve() and stats["path"] == str(real.resolve())
  assert open_prepared(real, verify=True).manifest["shard_tokens"] == 50_000
  assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]


def _dead_pid() -> int:
  """The pid of a process that has exited (a killed run's, as its partial directory names it)."""
  p = subprocess.Popen(["true"])
  p.wait()
  return p.pid


def test_a_killed_overwrite_leaves_a_partial_dir_the_next_run_removes(books, tmp_path, caplog):
  """kill -9 during --overwrite: the replacement's `.prep.partial-HOST-PID-*` stays beside --out; the next run
  removes it (its pid is gone) and only it: another output's, and one a live writer holds, stay (named in one
  warning line with the command that removes them)."""
  out = tmp_path / "prep"
  prepare([str(books)], out, tokenizer="byte", shard_tokens=40_000, progress=False)
  killed = subprocess.run(_cmd(f"--source={books}", f"--out={out}", "--tokenizer=byte", "--shard_tokens=50000",
                               "--overwrite", kill_after=1), cwd=REPO, capture_output=True, text=True, timeout=120)
  assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
  partial = [p for p in tmp_path.iterdir() if p.name.startswith(".prep.partial-")]
  assert len(partial) == 1 and any(partial[0].glob("shard-*.npy")), sorted(tmp_path.iterdir())
  host = partial[0].name.removeprefix(".prep.partial-").rsplit("-", 2)[0]
  other = tmp_path / f".prep2.partial-{host}-{_dead_pid()}-abcd1234"       # another output's: not ours
  live = tmp_path / f".prep.partial-{host}-{os.getpid()}-live0000"         # a live writer's (this process)
  for d in (other, live):
    d.mkdir()
    (d / "shard-00000.tokens.npy").write_bytes(b"x")
  with caplog.at_level("INFO", logger="tformer_jax.data.prepared.outdir"):
    stats = prepare([str(books)], out, tokenizer="byte", shard_tokens=50_000, overwrite=True, progress=False)
  ds = open_prepared(out, verify=True)
  assert stats["path"] == str(out) and ds.manifest["shard_tokens"] == 50_000
  assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["prep", other.name, live.name])
  warning = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
  assert len(warning) == 1 and "\n" not in warning[0] and f"rm -r '{live}'" in warning[0], warning
  assert str(other) not in warning[0]


def test_a_second_prepare_into_the_same_out_refuses_while_the_first_runs(books, tmp_path):
  out = tmp_path / "prep"
  first = subprocess.Popen(_cmd(f"--source={books}", f"--out={out}", "--tokenizer=byte", "--shard_tokens=40000",
                                kill_after=1, signal_name="STOP"),   # the first stops itself mid-run
                           cwd=REPO, start_new_session=True, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.time() + 60
    while pathlib.Path(f"/proc/{first.pid}/stat").read_text().split(")")[1].split()[0] != "T":
      assert time.time() < deadline and first.poll() is None, first.communicate()
      time.sleep(0.05)
    for shard_tokens in (40_000, 70_000):              # the same or other arguments: refused at once
      with pytest.raises(DataError, match=rf"output {out} is being written by another tformer-prepare "
                                          rf"\(pid {first.pid} "):
        prepare([str(books)], out, tokenizer="byte", shard_tokens=shard_tokens, progress=False)
  finally:
    os.killpg(first.pid, signal.SIGCONT)
  _, err = first.communicate(timeout=120)
  assert first.returncode == 0, err
  ds = open_prepared(out, verify=True)
  assert ds.manifest["shard_tokens"] == 40_000 and not (out / LOCK).exists()
  ref = prepare([str(books)], tmp_path / "ref", tokenizer="byte", shard_tokens=40_000, progress=False)
  assert ref["tokens"] == ds.num_tokens
  assert {k: v for k, v in _files(out).items()} == _files(tmp_path / "ref")


# --- signals and one worker ------------------------------------------------------------------------------

def test_ctrl_c_is_one_line_and_the_rerun_resumes_byte_identically(books, tmp_path):
  out, ref = tmp_path / "prep", tmp_path / "ref"
  args = [f"--source={books}", f"--out={out}", "--tokenizer=byte", "--shard_tokens=40000", "--workers=2"]
  p = subprocess.run(_cmd(*args, kill_after=2, signal_name="INT"),    # SIGINT to the group, as a terminal's ^C
                     cwd=REPO, start_new_session=True, capture_output=True, text=True,
                     timeout=120)
  assert p.returncode == 2, p.stderr
  lines = [x for x in p.stderr.splitlines() if x.strip() and "(test hook)" not in x]
  assert lines == ["error: interrupted (SIGINT): the committed shards are kept; rerun the same command to "
                   "resume"], p.stderr
  state = json.loads((out / PROGRESS).read_text())
  assert len(state["shards"]) >= 2
  p = subprocess.run(_cmd(*args), cwd=REPO, capture_output=True, text=True, timeout=120)
  assert p.returncode == 0, p.stderr
  assert '"resumed": true' in p.stdout
  prepare([str(books)], ref, tokenizer="byte", shard_tokens=40_000, progress=False)
  assert _files(out) == _files(ref)


def test_data_errors_with_one_worker_name_the_source_in_a_fresh_interpreter(tmp_path):
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"text": "fine"}\n{"text": \n')
  latin = tmp_path / "latin.txt"
  latin.write_bytes("caf\u00e9".encode("latin-1"))
  other = tmp_path / "other.jsonl"
  other.write_text('{"body": "no text field"}\n')
  script = f"""
import sys
from tformer_jax.cli import prepare
cases = [{str(bad)!r}, "--field=text"], [{str(latin)!r}, "--on_bad_utf8=fail"], [{str(other)!r}, "--field=text"]
for i, argv in enumerate(cases):
  out = {str(tmp_path)!r} + "/o" + str(i)
  print("rc", prepare.main(["--source=" + argv[0], *argv[1:], "--out=" + out, "--tokenizer=byte", "--noprogress"]),
        file=sys.stderr)
"""
  p = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
  lines = [x for x in p.stderr.splitlines() if x.strip()]
  assert "AttributeError" not in p.stderr and "Traceback" not in p.stderr, p.stderr
  assert lines[0].startswith(f"error: {bad}:2: invalid JSON") and lines[1] == "rc 2", lines
  assert lines[2].startswith(f"error: {latin}: the document is not valid UTF-8") and lines[3] == "rc 2", lines
  assert lines[4].startswith(f"error: {other}:1: no field 'text'") and lines[5] == "rc 2", lines


def test_binary_txt_is_skipped_in_every_split_mode(tmp_path):
  src = tmp_path / "src"
  src.mkdir()
  (src / "a.txt").write_text("first paragraph\n\nsecond paragraph\n", encoding="utf-8")
  blob = bytes(range(1, 256)) * 4
  (src / "image.txt").write_bytes(b"\x89PNG\r\n\n\x00\x00\x00\rIHDR\n\n" + b"\x00" * 300 + b"\n\nend\n" + blob)
  for split, docs in (("file", 1), ("line", 2), ("paragraph", 2)):
    stats = prepare([str(src)], tmp_path / split, tokenizer="byte", txt_split=split, progress=False)
    ds = open_prepared(tmp_path / split)
    texts = [bytes(ds.document(i).tolist()) for i in range(ds.num_documents)]
    assert stats["documents"] == docs and all(b"\x00" not in t for t in texts), (split, texts)
    assert stats["skipped"]["not_utf8"] == 1, (split, stats["skipped"])
  with pytest.raises(DataError, match=r"image\.txt: the document is not text \(a binary file: it holds NUL bytes"):
    prepare([str(src)], tmp_path / "fail", tokenizer="byte", txt_split="paragraph", on_bad_utf8="fail",
            progress=False)


# --- full and read-only disks -----------------------------------------------------------------------------

def _mount_tmpfs(path: pathlib.Path, options: str) -> bool:
  path.mkdir(parents=True, exist_ok=True)
  p = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
  return p.returncode == 0


@pytest.fixture
def small_disk(tmp_path):
  """A 256 KiB tmpfs (root and mount needed; skipped elsewhere)."""
  disk = tmp_path / "disk"
  if not _mount_tmpfs(disk, "size=256k"):
    pytest.skip("cannot mount a tmpfs here (needs root)")
  yield disk
  subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_full_disk_is_one_line_and_resumes_once_there_is_room(books, small_disk, tmp_path, capsys):
  out = small_disk / "prep"
  args = (f"--source={books}", f"--out={out}", "--tokenizer=byte", "--shard_tokens=40000")
  rc, err = _cli(*args, capsys=capsys)
  assert rc == 2 and "No space left on device" in _one_line(err) and "rerun the same command to resume" in err
  state = json.loads((out / PROGRESS).read_text())
  assert state["shards"] and not list(out.glob("*.tmp"))
  subprocess.run(["mount", "-o", "remount,size=8m", str(small_disk)], check=True)
  rc, err = _cli(*args, capsys=capsys)
  assert rc == 0, err
  prepare([str(books)], tmp_path / "ref", tokenizer="byte", shard_tokens=40_000, progress=False)
  assert _files(out) == _files(tmp_path / "ref")


def test_a_read_only_disk_is_one_line(books, small_disk, capsys):
  small = (f"--source={books / '000.txt'}", f"--out={small_disk / 'done'}", "--tokenizer=byte")   # fits the disk
  assert _cli(*small, capsys=capsys)[0] == 0
  subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
  rc, err = _cli(f"--source={books}", f"--out={small_disk / 'prep'}", "--tokenizer=byte", capsys=capsys)
  assert rc == 2 and "Read-only file system" in _one_line(err) and "not writable" in err
  rc, err = _cli(*small, capsys=capsys)                  # already prepared: nothing to write
  assert rc == 0, err
