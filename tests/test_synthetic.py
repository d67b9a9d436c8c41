"""Synthetic tasks: exact answers, seeding, loss masks, exact-match accuracy, pipeline integration."""
from __future__ import annotations

import numpy as np
import pytest

from tformer_jax.data.corpora import DataError
from tformer_jax.data.pipeline import build_dataset, eval_batches, iterate, train_iterator
from tformer_jax.data.synthetic import SyntheticTask, SyntheticVocab, exact_match_accuracy, parse_synthetic


def _cfg(task: str, **kw) -> dict:
  base = dict(corpus=f"synthetic:{task}", seq_len=20, batch_size=8, seed=0, worker_count=0)
  base.update(kw)
  return base


def _batch(task: str, **kw) -> tuple[dict, SyntheticVocab]:
  cfg = _cfg(task, **kw)
  ds = build_dataset(cfg)
  return next(train_iterator(ds, cfg)), ds.tokenizer


def _sequences(b: dict) -> np.ndarray:
  return np.concatenate([b["inputs"][:, :1], b["targets"]], axis=1)     # the seq_len+1 tokens


@pytest.mark.parametrize("task, answer", [
    ("copy", lambda x: x),
    ("reverse", lambda x: x[::-1]),
    ("sort", np.sort),
])
def test_sequence_tasks_are_exact(task, answer):
  b, vocab = _batch(task)
  n = 10                                                  # (seq_len + 1 - 1) // 2
  assert vocab.vocab_size == 18 and b["inputs"].max() < vocab.vocab_size
  np.testing.assert_array_equal(b["targets"][:, :-1], b["inputs"][:, 1:])
  for seq, mask, tgt in zip(_sequences(b), b["loss_mask"], b["targets"]):
    x = seq[:n]
    assert (x < 16).all() and seq[n] == vocab.sep
    np.testing.assert_array_equal(seq[n + 1:2 * n + 1], answer(x))
    np.testing.assert_array_equal(tgt[mask > 0], answer(x))          # loss only on the answer
    assert mask.sum() == n and mask.dtype == np.float32


def test_reverse_targets_are_reversed_inputs():
  b, _ = _batch("reverse", seq_len=8)
  for inp, tgt, mask in zip(b["inputs"], b["targets"], b["loss_mask"]):
    np.testing.assert_array_equal(tgt[mask > 0], inp[:4][::-1])


def test_associative_recall_answers_the_queried_key():
  b, vocab = _batch("recall", seq_len=20, batch_size=16)
  m = 9                                                   # (seq_len + 1 - 3) // 2 pairs
  for seq, mask, tgt in zip(_sequences(b), b["loss_mask"], b["targets"]):
    keys, vals = seq[:2 * m:2], seq[1:2 * m:2]
    assert len(set(keys.tolist())) == m and seq[2 * m] == vocab.sep
    q = seq[2 * m + 1]
    assert q in keys
    assert tgt[mask > 0].tolist() == [vals[list(keys).index(q)]]
    assert (seq[2 * m + 3:] == vocab.pad).all()


def test_options_and_padding():
  b, vocab = _batch("copy:n=3,symbols=5", seq_len=12)
  assert vocab.vocab_size == 7
  seq = _sequences(b)[0]
  assert (seq[:3] < 5).all() and seq[3] == vocab.sep and (seq[7:] == vocab.pad).all()
  assert b["loss_mask"][0].tolist() == [0, 0, 0, 1, 1, 1] + [0] * 6
  assert parse_synthetic("synthetic:associative_recall", 20).task == "recall"


def test_seeded():
  same = [_batch("sort", seed=1)[0]["inputs"] for _ in range(2)]
  np.testing.assert_array_equal(*same)
  assert not np.array_equal(same[0], _batch("sort", seed=2)[0]["inputs"])
  cfg = _cfg("copy")
  ds = build_dataset(cfg)
  ev = eval_batches(ds, cfg, 2)
  np.testing.assert_array_equal(ev[1]["inputs"], eval_batches(ds, cfg, 2)[1]["inputs"])
  assert not np.array_equal(ev[0]["inputs"], next(train_iterator(ds, cfg))["inputs"])  # own stream
  assert set(ev[0]) == {"inputs", "targets", "loss_mask"}


def test_resume_and_process_shards():
  cfg = _cfg("recall", batch_size=8)
  ds = build_dataset(cfg)
  it = train_iterator(ds, cfg)
  iterate(it, 2)
  state = it.get_state()
  want = iterate(it, 2)
  again = train_iterator(ds, cfg)
  again.set_state(state)
  for a, b in zip(iterate(again, 2), want):
    for k in a:
      np.testing.assert_array_equal(a[k], b[k])
  full = next(train_iterator(ds, cfg))["inputs"]
  parts = [next(train_iterator(ds, cfg, process_index=p, process_count=2))["inputs"] for p in range(2)]
  np.testing.assert_array_equal(np.stack(parts, 1).reshape(full.shape), full)


def test_exact_match_accuracy():
  b, _ = _batch("reverse", batch_size=4)
  assert float(exact_match_accuracy(b["targets"], b)) == 1.0
  pred = b["targets"].copy()
  pred[0, 0] = (pred[0, 0] + 1) % 16                    # outside the answer span: ignored
  assert float(exact_match_accuracy(pred, b)) == 1.0
  ans = np.flatnonzero(b["loss_mask"][1])[3]
  pred[1, ans] = (pred[1, ans] + 1) % 16                # one wrong answer token fails the sequence
  assert float(exact_match_accuracy(pred, b)) == 0.75
  logits = np.eye(18, dtype=np.float32)[pred]           # (B, L, V) logits work too
  assert float(exact_match_accuracy(logits, b)) == 0.75
  no_mask = {"targets": b["targets"]}
  assert float(exact_match_accuracy(pred, no_mask)) == 0.5


def test_vocab_round_trip():
  v = SyntheticVocab(10)
  ids = v.encode("3 1 4 | 4 1 3 . .")
  assert ids.tolist() == [3, 1, 4, 10, 4, 1, 3, 11, 11] and v.decode(ids) == "3 1 4 | 4 1 3 . ."
  with pytest.raises(DataError, match="must be in"):
    v.encode("12")


@pytest.mark.parametrize("spec, seq_len, match", [
    ("synthetic:shuffle", 20, "unknown synthetic task 'shuffle'"),
    ("synthetic:copy", 1, "need seq_len >= 2"),
    ("synthetic:copy:n=20", 20, "n=20 items need seq_len >= 40"),
    ("synthetic:recall:n=9,symbols=4", 40, "n <= symbols=4"),
    ("synthetic:copy:len=3", 20, "bad synthetic option 'len=3'"),
    ("synthetic:", 20, "bad synthetic corpus"),
])
def test_errors(spec, seq_len, match):
  with pytest.raises(DataError, match=match):
    build_dataset(dict(corpus=spec, seq_len=seq_len, batch_size=4))


def test_task_dataclass_directly():
  t = SyntheticTask("sort", seq_len=6, num_symbols=3)
  seq, start, end = t.sequence(np.random.default_rng(0))
  assert len(seq) == 7 and (start, end) == (4, 7) and list(seq[4:7]) == sorted(seq[:3])
