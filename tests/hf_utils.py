"""Tiny real-format Hugging Face checkpoints for the tests, made with the libraries themselves: a
byte-level BPE trained on Shakespeare (`tokenizers`) and a random Llama saved by transformers.
Callers skip first without torch / transformers / tokenizers (pytest.importorskip)."""
from __future__ import annotations

import json
import pathlib

from tformer_jax.data.corpora import load_corpus


def byte_level_bpe(chars: int, vocab_size: int, specials: list[str]):
  """A byte-level BPE trained on the first `chars` bytes of Shakespeare, with `specials` first."""
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, trainers
  text = load_corpus("shakespeare")[:chars].decode("utf-8", "replace")
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(text.splitlines(), trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  return tok


def save_tokenizer_files(tok, d: pathlib.Path, bos: str, eos: str) -> None:
  """tokenizer.json + a tokenizer_config.json naming the bos / eos tokens."""
  tok.save(str(d / "tokenizer.json"))
  (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": bos, "eos_token": eos}))


def save_llama(d: pathlib.Path, vocab_size: int, *, hidden: int, ffn: int, max_positions: int,
               tied: bool) -> None:
  """A random 2-layer LlamaForCausalLM (GQA 4/2, bos 0, eos 1, torch seed 0) saved into d."""
  import torch
  import transformers
  torch.manual_seed(0)
  cfg = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=ffn,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=max_positions, tie_word_embeddings=tied,
                                 bos_token_id=0, eos_token_id=1)
  transformers.LlamaForCausalLM(cfg).save_pretrained(d)
