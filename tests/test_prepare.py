"""tformer-prepare on real text: formats and fields, byte-identical output for any worker count, kill and
resume, corrupt shards, and one clear error per kind of bad input."""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import pathlib
import signal
import subprocess
import sys

import numpy as np
import prepare_faults
import pytest

from tformer_jax.bench.tokenizer import tokenizer_ceiling
from tformer_jax.cli import prepare as prepare_cli
from tformer_jax.data import sources
from tformer_jax.data.corpora import DataError, load_corpus
from tformer_jax.data.json_array import ArrayReader
from tformer_jax.data.prepared import PROGRESS, open_prepared, prepare, token_dtype

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def paragraphs() -> list[str]:
  """About 300 KB of real text: Shakespeare's paragraphs (some with non-ASCII punctuation added)."""
  text = load_corpus("shakespeare").decode("utf-8")
  paras = [p.strip("\n") for p in text.split("\n\n") if p.strip()]
  return [p + (" — café" if i % 97 == 0 else "") for i, p in enumerate(paras[1000:4000])]


def _files(root: pathlib.Path) -> dict[str, str]:
  return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.iterdir())}


def _texts(ds) -> list[str]:
  tok = ds.tokenizer()
  drop = 1 if ds.eos_id is not None else 0
  out = []
  for i in range(ds.num_documents):
    doc = ds.document(i)
    if drop:
      assert doc[-1] == ds.eos_id
    out.append(tok.decode(doc[:len(doc) - drop]))
  return out


def _txt_folder(root: pathlib.Path, docs: list[str]) -> pathlib.Path:
  for i, doc in enumerate(docs):
    sub = root / f"part{i // 100}"
    sub.mkdir(parents=True, exist_ok=True)
    (sub / f"{i:05d}.txt").write_text(doc, encoding="utf-8")
  return root


# --- output identity ---------------------------------------------------------------------------------

def test_workers_give_byte_identical_output_and_the_reader_returns_every_document(tmp_path, paragraphs,
                                                                                   monkeypatch):
  """A sentencepiece BPE trained on a sample; 1 vs 3 workers (the spawned ones up before the first of many
  small units, so they encode most of them); many small shards; documents round-trip."""
  docs = paragraphs[:1500]
  src = tmp_path / "data.jsonl"
  src.write_text("".join(json.dumps({"meta": {"id": i}, "text": d}, ensure_ascii=False) + "\n"
                         for i, d in enumerate(docs)), encoding="utf-8")
  kw = dict(tokenizer="bpe", text_field="text", bpe_vocab_size=400, train_tokenizer_sample_bytes=100_000,
            shard_tokens=4000, progress=False, cache_dir=tmp_path / "cache", unit_bytes=4096)
  one = prepare([str(src)], tmp_path / "w1", workers=1, **kw)
  prepare_faults.wait_for_workers(monkeypatch)
  three = prepare([str(src)], tmp_path / "w3", workers=3, **kw)
  assert one["units"]["spawned"] == 0 and one["units"]["main"] > 40 and one["worker_peak_rss_mb"] == 0
  assert three["units"]["spawned"] > 0 and sum(three["units"].values()) == one["units"]["main"]
  assert three["worker_peak_rss_mb"] > 0
  assert _files(tmp_path / "w1") == _files(tmp_path / "w3")
  assert one["documents"] == three["documents"] == len(docs) and one["tokens"] == three["tokens"]
  ds = open_prepared(tmp_path / "w1", verify=True)
  m = ds.manifest
  assert m["dtype"] == "uint16" and ds.eos_id == 2 and "ends with eos_id (2)" in m["convention"]
  assert m["tokenizer"]["file"] == "tokenizer.model" and m["tokenizer"]["trained_on"]["bytes"] <= 100_000 + 5000
  assert len(ds.shards) > 10 and all(e["num_tokens"] >= 4000 for e in m["shards"][:-1])
  assert isinstance(ds.shards[0][0], np.memmap)
  modes = {(tmp_path / "w1" / name).stat().st_mode & 0o777 for name in ("manifest.json", "tokenizer.model",
                                                                         "shard-00000.tokens.npy")}
  assert len(modes) == 1                           # all as readable as a new file (not write_atomic's 0600)
  assert _texts(ds) == docs
  # the global view: offsets and tokens_at across shard boundaries match the concatenated shards
  allt = np.concatenate([t for t, _ in ds.shards])
  assert ds.doc_offsets[0] == 0 and ds.doc_offsets[-1] == ds.num_tokens == len(allt)
  i = 777
  np.testing.assert_array_equal(ds.document(i), allt[ds.doc_offsets[i]:ds.doc_offsets[i + 1]])
  cut = m["shards"][0]["num_tokens"]
  np.testing.assert_array_equal(ds.tokens_at(cut - 5, 10), allt[cut - 5:cut + 5])
  # a rerun with the same arguments is a no-op; other arguments are refused, naming them
  assert prepare([str(src)], tmp_path / "w1", workers=1, **kw)["already_prepared"]
  with pytest.raises(DataError, match=r"other arguments \(differing: shard_tokens\).*--overwrite"):
    prepare([str(src)], tmp_path / "w1", **{**kw, "shard_tokens": 9999})
  # the ceiling: the library's batch encode of the same texts, same token count as the dataset minus EOS
  c = tokenizer_ceiling(docs, ds.tokenizer(), threads=1)
  assert c["tokens"] == ds.num_tokens - ds.num_documents and c["mb_per_s"] > 0


def test_kill_midway_then_resume_is_byte_identical(tmp_path, paragraphs):
  src = _txt_folder(tmp_path / "books", paragraphs[:2000])
  args = dict(tokenizer="byte", shard_tokens=20_000, progress=False)
  prepare([str(src)], tmp_path / "whole", **args)
  code = (f"import prepare_faults; prepare_faults.kill_after(3); from tformer_jax.data.prepared import prepare; "
          f"prepare([{str(src)!r}], {str(tmp_path / 'cut')!r}, tokenizer='byte', shard_tokens=20000, progress=False)")
  env = dict(os.environ, PYTHONPATH=str(REPO / "tests"))
  proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, timeout=300)
  assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
  cut = tmp_path / "cut"
  state = json.loads((cut / PROGRESS).read_text())
  assert len(state["shards"]) == 3 and not (cut / "manifest.json").exists()
  with pytest.raises(DataError, match="did not finish; rerun the same tformer-prepare command"):
    open_prepared(cut)
  (cut / "shard-00003.tokens.npy.tmp").write_bytes(b"half a shard")     # what a kill mid-write leaves
  (cut / "shard-00003.offsets.npy").write_bytes(b"uncommitted")
  stats = prepare([str(src)], cut, **args)
  assert stats["resumed"] and _files(cut) == _files(tmp_path / "whole")


# --- damage ------------------------------------------------------------------------------------------

def test_corrupt_or_truncated_shard_is_named(tmp_path, paragraphs):
  src = tmp_path / "a.txt"
  src.write_text("\n".join(paragraphs[:600]), encoding="utf-8")
  out = tmp_path / "out"
  prepare([str(src)], out, tokenizer="byte", txt_split="line", shard_tokens=30_000, progress=False)
  shard = out / "shard-00001.tokens.npy"
  data = bytearray(shard.read_bytes())
  data[-7] ^= 0x20
  shard.write_bytes(bytes(data))
  open_prepared(out)                                   # same size: only the checksum can tell
  with pytest.raises(DataError, match=r"shard-00001\.tokens\.npy: checksum mismatch"):
    open_prepared(out, verify=True)
  assert prepare_cli.main([f"--verify={out}"]) == 2
  shard.write_bytes(bytes(data[:-100]))
  with pytest.raises(DataError, match=r"shard-00001\.tokens\.npy: truncated"):
    open_prepared(out)
  (out / "shard-00000.offsets.npy").unlink()
  with pytest.raises(DataError, match=r"shard-00000\.offsets\.npy: missing"):
    open_prepared(out)


# --- formats and fields ------------------------------------------------------------------------------

def test_the_json_array_reader_reads_any_chunking_like_json_loads(monkeypatch):
  """The streamed reader of large .json arrays (data/json_array.py) at chunk sizes that cut numbers, strings
  and nesting anywhere: the values json.loads gives; a truncated array names the character where it ends."""
  records = [{"title": "T", "n": 12345, "x": -1.5e-3, "ok": True, "none": None, "lines": ["a", "b, c"]},
             7, 0.25, "text with , and ]", [], {}]
  text = json.dumps(records, indent=1)
  for chunk in (1, 2, 3, 7, 1 << 20):
    monkeypatch.setattr(ArrayReader, "CHUNK", chunk)
    assert list(ArrayReader(io.StringIO(text), "w").elements()) == records
    assert list(ArrayReader(io.StringIO(" [ ] "), "w").elements()) == []
    with pytest.raises(DataError, match=r"w: invalid JSON at character 8: the file ends inside the array"):
      list(ArrayReader(io.StringIO("[1, 2345"), "w").elements())
    with pytest.raises(DataError, match=r"expected ',' or '\]', found '2'"):
      list(ArrayReader(io.StringIO("[1 2]"), "w").elements())


def test_formats_and_fields(tmp_path, paragraphs, monkeypatch):
  docs = paragraphs[:40]
  # a JSON array of poems: title + a list of lines, and a nested list of objects
  poems = [{"title": f"T{i}", "paragraphs": d.split("\n"), "notes": [{"text": "n1"}, {"text": "n2"}]}
           for i, d in enumerate(docs)]
  (tmp_path / "poems.json").write_text(json.dumps(poems, ensure_ascii=False), encoding="utf-8")
  out = prepare([str(tmp_path / "poems.json")], tmp_path / "p", tokenizer="byte",
                text_field=["title", "paragraphs", "notes.text"], progress=False)
  assert out["documents"] == len(docs)
  assert _texts(open_prepared(tmp_path / "p")) == [f"T{i}\n{d}\nn1\nn2" for i, d in enumerate(docs)]
  # the same array streamed by the main process (as a JSON array too large to parse whole is): same output
  monkeypatch.setattr(sources, "JSON_WHOLE_BYTES", 1000)
  prepare([str(tmp_path / "poems.json")], tmp_path / "p_streamed", tokenizer="byte",
          text_field=["title", "paragraphs", "notes.text"], progress=False)
  assert _files(tmp_path / "p_streamed") == _files(tmp_path / "p")
  text = (tmp_path / "poems.json").read_text(encoding="utf-8")
  (tmp_path / "cut.json").write_text(text[:len(text) // 2], encoding="utf-8")
  with pytest.raises(DataError, match=r"cut\.json: invalid JSON at character \d+"):
    prepare([str(tmp_path / "cut.json")], tmp_path / "cut", tokenizer="byte", text_field="title", progress=False)
  # JSON Lines, gzipped, with a nested field; a glob over two files keeps their order
  for k in (0, 1):
    with gzip.open(tmp_path / f"part{k}.jsonl.gz", "wt", encoding="utf-8") as f:
      for d in docs[k * 20:(k + 1) * 20]:
        f.write(json.dumps({"doc": {"body": d}}) + "\n\n")
  prepare([str(tmp_path / "part*.jsonl.gz")], tmp_path / "j", tokenizer="byte", text_field="doc.body",
          progress=False)
  assert _texts(open_prepared(tmp_path / "j")) == docs
  # one .txt: documents per paragraph (blank lines, any whitespace on them) or per line
  (tmp_path / "book.txt").write_text("\n \n".join(docs) + "\n", encoding="utf-8")
  prepare([str(tmp_path / "book.txt")], tmp_path / "para", tokenizer="byte", txt_split="paragraph", progress=False)
  assert _texts(open_prepared(tmp_path / "para")) == docs
  prepare([str(tmp_path / "book.txt")], tmp_path / "line", tokenizer="byte", txt_split="line", progress=False)
  assert _texts(open_prepared(tmp_path / "line")) == [x for d in docs for x in d.split("\n") if x.strip()]


def test_vocabulary_size_picks_the_token_dtype(tmp_path, paragraphs):
  assert token_dtype(256) == np.uint16 and token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32
  with pytest.raises(DataError, match="does not fit uint32"):
    token_dtype((1 << 32) + 1)
  # an HF tokenizer.json with 70,000 ids (a word-level vocabulary): uint32 shards, ids and EOS preserved
  from tokenizers import Tokenizer, models, pre_tokenizers
  words = sorted({w for p in paragraphs for w in p.split()})
  vocab = {"[UNK]": 0, "</s>": 1, **{w: i + 2 for i, w in enumerate(words)}}
  vocab.update({f"<extra{i}>": len(vocab) + i for i in range(70_000 - len(vocab))})
  hf = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
  hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  hf.save(str(tmp_path / "tokenizer.json"))
  src = tmp_path / "d.jsonl"
  src.write_text("".join(json.dumps({"t": p}) + "\n" for p in paragraphs[:50]))
  prepare([str(src)], tmp_path / "o", tokenizer=f"hf:{tmp_path}", text_field="t", progress=False)
  ds = open_prepared(tmp_path / "o", verify=True)
  assert ds.dtype == np.uint32 and ds.vocab_size == 70_000 and ds.eos_id == 1
  np.testing.assert_array_equal(ds.document(3), [vocab[w] for w in paragraphs[3].split()] + [1])


@pytest.mark.parametrize("module", ["pyarrow", "datasets"])
def test_parquet_and_datasets_sources(tmp_path, paragraphs, module):
  pytest.importorskip(module, reason=f"{module} is not installed (an optional source format)")
  rows = {"title": [f"T{i}" for i in range(30)], "body": paragraphs[:30]}
  if module == "pyarrow":
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table(rows), tmp_path / "t.parquet", row_group_size=7)
    src = tmp_path / "t.parquet"
  else:
    import datasets
    try:
      datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "ds"))
    except Exception as e:  # noqa: BLE001 - some datasets/pyarrow pairs cannot save at all (dill: MonthDayNano)
      pytest.skip(f"this datasets/pyarrow pair cannot write a dataset: {type(e).__name__}: {e}")
    src = tmp_path / "ds"
  prepare([str(src)], tmp_path / "o", tokenizer="byte", column="title,body", progress=False)
  assert _texts(open_prepared(tmp_path / "o")) == [f"T{i}\n{p}" for i, p in enumerate(paragraphs[:30])]
  with pytest.raises(DataError, match=r"no column 'text' \(its columns: title, body\)"):
    prepare([str(src)], tmp_path / "o2", tokenizer="byte", column="text", progress=False)


# --- bad input ---------------------------------------------------------------------------------------

def test_bad_input_errors(tmp_path, paragraphs, capsys):
  jl = tmp_path / "d.jsonl"
  jl.write_text(json.dumps({"text": "a"}) + "\n" + json.dumps({"body": "b", "id": 2}) + "\n")
  with pytest.raises(DataError, match=r"d\.jsonl:2: no field 'text' \(missing key 'text'; the keys there: 'body'"):
    prepare([str(jl)], tmp_path / "o1", tokenizer="byte", text_field="text", progress=False)
  with pytest.raises(DataError, match=r"d\.jsonl:1: the record is a dict .*pass the text field"):
    prepare([str(jl)], tmp_path / "o2", tokenizer="byte", progress=False)
  # not UTF-8: skipped and counted, or a failure naming the file
  books = tmp_path / "books"
  books.mkdir()
  (books / "a.txt").write_text(paragraphs[0], encoding="utf-8")
  (books / "b.txt").write_bytes("caf\u00e9 latin-1".encode("latin-1"))
  (books / "c.txt").write_text("  \n\n", encoding="utf-8")
  stats = prepare([str(books)], tmp_path / "o3", tokenizer="byte", progress=False)
  assert stats["documents"] == 1 and stats["skipped"] == {"not_utf8": 1, "empty": 1}
  assert open_prepared(tmp_path / "o3").manifest["skipped_documents"] == {"not_utf8": 1, "empty": 1}
  with pytest.raises(DataError, match=r"b\.txt: the document is not valid UTF-8 \(invalid byte b'\\xe9' at byte 3\)"):
    prepare([str(books)], tmp_path / "o4", tokenizer="byte", on_bad_utf8="fail", progress=False)
  # an empty dataset
  (tmp_path / "empty.json").write_text(json.dumps([{"t": ""}, {"t": "   "}]))
  with pytest.raises(DataError, match=r"empty dataset: .*no documents \(2 empty"):
    prepare([str(tmp_path / "empty.json")], tmp_path / "o5", tokenizer="byte", text_field="t", progress=False)
  assert not (tmp_path / "o5" / PROGRESS).exists()
  with pytest.raises(DataError, match="the pattern matches no files"):
    prepare([str(tmp_path / "nothing*.jsonl")], tmp_path / "o6", tokenizer="byte", progress=False)
  (tmp_path / "x.csv").write_text("a,b\n")
  with pytest.raises(DataError, match=r"unknown format \.csv"):
    prepare([str(tmp_path / "x.csv")], tmp_path / "o7", tokenizer="byte", progress=False)
  with pytest.raises(DataError, match="field 'text' holds a int"):
    (tmp_path / "n.jsonl").write_text('{"text": 5}\n')
    prepare([str(tmp_path / "n.jsonl")], tmp_path / "o8", tokenizer="byte", text_field="text", progress=False)
  (tmp_path / "o9").mkdir()
  (tmp_path / "o9" / "notes.md").write_text("mine")
  with pytest.raises(DataError, match=r"holds files that are not part of a prepared dataset \(notes\.md\)"):
    prepare([str(books)], tmp_path / "o9", tokenizer="byte", progress=False)
  # the command line: one line, status 2
  capsys.readouterr()
  assert prepare_cli.main([f"--source={jl}", f"--out={tmp_path / 'o10'}", "--tokenizer=byte", "--field=text",
                           "--noprogress"]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("error: ") and "no field 'text'" in err and "\n" not in err
  assert prepare_cli.main([f"--source={books}", f"--out={tmp_path / 'o11'}", "--tokenizer=byte",
                           "--noprogress"]) == 0
  assert '"documents": 1' in capsys.readouterr().out
  # an output inside its source directory: its own files are not read as sources when it is rerun
  for _ in range(2):
    again = prepare([str(books)], books / "prepared", tokenizer="byte", progress=False)
  assert again["already_prepared"] and again["documents"] == 1
