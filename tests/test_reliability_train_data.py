"""Training on prepared data under real faults: a flipped byte in a shard (inside and outside the
vocabulary), a directory prepared again with other text under a run that resumes, an explicit
data.tokenizer that is not the corpus's, and train.init_from=hf:DIR whose tokenizer is another one of the
same size. Each is refused in one line naming the data before a step runs."""
from __future__ import annotations

import json
import pathlib
import re

import flax.linen as nn
import jax
import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from tformer_jax import cli_common
from tformer_jax.config import ConfigError, ModelConfig, load_config_file
from tformer_jax.data.corpora import DataError, load_corpus
from tformer_jax.data.prepared import RUN_DATA, open_prepared, prepare, tokenizer_spec
from tformer_jax.interop import hf
from tformer_jax.nn import Transformer
from tformer_jax.train import init_from, loop

from train_utils import tiny_config

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def texts() -> list[str]:
  text = load_corpus("shakespeare").decode("utf-8")
  return [p.strip("\n") for p in text.split("\n\n") if p.strip()][1000:2500]


def _corpus(root: pathlib.Path, texts: list[str]) -> pathlib.Path:
  root.mkdir(parents=True)
  for i in range(0, len(texts), 50):
    (root / f"{i:05d}.txt").write_text("\n\n".join(texts[i:i + 50]), encoding="utf-8")
  return root


def _tokenizer(root: pathlib.Path, texts: list[str], vocab: int = 300) -> pathlib.Path:
  tok = Tokenizer(models.BPE(unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["[UNK]", "</s>"]))
  root.mkdir(parents=True, exist_ok=True)
  tok.save(str(root / "tokenizer.json"))
  return root / "tokenizer.json"


def _refused(cfg, work: pathlib.Path, error: type, match: str) -> str:
  with pytest.raises(error) as e:
    loop.train(cfg, work)
  line = cli_common.error_message(e.value)
  assert line is not None and "\n" not in line, line
  assert re.search(match, line), line
  return line


def test_a_flipped_byte_in_a_shard_is_named_before_training(texts, tmp_path):
  prep = tmp_path / "prep"
  prepare([str(_corpus(tmp_path / "src", texts))], prep, tokenizer="byte", shard_tokens=60_000, progress=False)
  shard = prep / open_prepared(prep).manifest["shards"][1]["tokens"]
  header = len(shard.read_bytes()) - 2 * open_prepared(prep).manifest["shards"][1]["num_tokens"]
  data = bytearray(shard.read_bytes())
  at = 1234
  data[header + 2 * at] ^= 0x01                              # the low byte: still a byte id (< 256)
  shard.write_bytes(bytes(data))
  cfg = tiny_config(steps=2)
  cfg.data.corpus = f"prepared:{prep}"
  _refused(cfg, tmp_path / "w1", DataError, rf"{shard}: checksum mismatch .* the file is damaged")
  data[header + 2 * at + 1] ^= 0x40                          # the high byte: an id outside the vocabulary
  shard.write_bytes(bytes(data))
  _refused(cfg, tmp_path / "w2", DataError, rf"{shard}: token id \d+ at offset {at} is outside the vocabulary "
                                            r"\(256 ids\)")
  assert not (tmp_path / "w1").exists() and not (tmp_path / "w2").exists()


def test_resume_on_a_directory_prepared_again_with_other_text_is_refused(texts, tmp_path):
  prep, work = tmp_path / "prep", tmp_path / "work"
  prepare([str(_corpus(tmp_path / "a", texts))], prep, tokenizer="byte", progress=False)
  cfg = tiny_config(steps=1)
  cfg.data.corpus = f"prepared:{prep}"
  loop.train(cfg, work)
  record = json.loads((work / RUN_DATA).read_text())
  assert record["datasets"][0]["path"] == str(prep.absolute())
  assert json.loads((work / "config.json").read_text())["data"]["tokenizer"] == "byte"
  # a workdir as train.init_from names the tokenizer its data had
  assert init_from.source_tokenizer_sha256(str(work), "byte") == open_prepared(prep).manifest["tokenizer"]["sha256"]
  prepare([str(_corpus(tmp_path / "b", texts[::-1][:1000]))], prep, tokenizer="byte", overwrite=True,
          progress=False)
  cfg.train.steps = 2
  before = sorted(p.name for p in (work / "checkpoints").iterdir())
  _refused(cfg, work, DataError, rf"prepared:{prep.absolute()} changed since this run started in .*: it was "
                                 r"prepared again with other text")
  assert sorted(p.name for p in (work / "checkpoints").iterdir()) == before


def test_data_tokenizer_and_init_from_must_be_the_prepared_corpus_tokenizer(texts, tmp_path):
  a = _tokenizer(tmp_path / "hf_a", texts[:700])
  b = _tokenizer(tmp_path / "tok_b", texts[700:])
  assert Tokenizer.from_file(str(a)).get_vocab_size() == Tokenizer.from_file(str(b)).get_vocab_size()
  prep = tmp_path / "prep"
  prepare([str(_corpus(tmp_path / "src", texts))], prep, tokenizer=f"hf:{b}", progress=False)
  ds = open_prepared(prep)
  # an explicit other tokenizer: refused; the same one (the original file) or the default: the corpus's own
  cfg = tiny_config(steps=2)
  cfg.data.corpus = f"prepared:{prep}"
  cfg.data.tokenizer = f"hf:{a}"
  _refused(cfg, tmp_path / "w0", ConfigError, rf"data\.tokenizer: hf:{a} is not the tokenizer {prep} was prepared "
                                              rf"with \(hf:{b}, sha256 ")
  cfg.data.tokenizer = f"hf:{b}"
  assert init_from.check_data_tokenizer(cfg).data.tokenizer == tokenizer_spec(ds)
  cfg.data.tokenizer = "byte"
  assert init_from.check_data_tokenizer(cfg).data.tokenizer == tokenizer_spec(ds) == f"hf:{prep / 'tokenizer.json'}"
  # init_from=hf:A (a model whose tokenizer has the same size) on data prepared with B: refused
  llama = load_config_file(REPO / "configs" / "llama_tiny.py").model
  llama.vocab_size, llama.d_model, llama.num_layers, llama.num_heads, llama.num_kv_heads = 300, 32, 2, 4, 2
  model_cfg = ModelConfig.from_config(llama)
  params = nn.unbox(Transformer(model_cfg).init(jax.random.PRNGKey(0), np.zeros((1, 8), np.int32))["params"])
  hf.save_hf(model_cfg, params, tmp_path / "hf_model", files={"tokenizer.json": a})
  cfg = tiny_config(steps=2)
  cfg.data.corpus = f"prepared:{prep}"
  cfg.train.init_from = f"hf:{tmp_path / 'hf_model'}"
  _refused(cfg, tmp_path / "w1", ConfigError, rf"train\.init_from=hf:{tmp_path / 'hf_model'}: its tokenizer .* is "
                                              rf"not the one {prep} was prepared with \(hf:{b}")
  # the same tokenizer: the run takes the source's architecture and keeps the corpus's tokenizer
  hf.save_hf(model_cfg, params, tmp_path / "hf_model", files={"tokenizer.json": b}, overwrite=True)
  out = init_from.check_data_tokenizer(init_from.with_source_architecture(cfg))
  assert out.data.tokenizer == tokenizer_spec(ds) and out.model.d_model == 32
