"""Fine-tuning from a Hugging Face model (train.init_from=hf:DIR) and scoring one (tformer-eval --hf):
the run starts from the model's weights with its architecture and tokenizer, the loss falls, and the
export (tokenizer, bos/eos/pad ids, generation_config.json) reloads in transformers with our logits."""
import json

import hf_utils
import jax.numpy as jnp
import numpy as np
import pytest

from tformer_jax.checkpoint import restore_params
from tformer_jax.cli import convert, eval as eval_cli, train as train_cli
from tformer_jax.cli_common import workdir_config
from tformer_jax.config import ModelConfig
from tformer_jax.data import pipeline
from tformer_jax.interop.hf import load_hf
from tformer_jax.nn import Transformer
from tformer_jax.train import step as step_lib
from tformer_jax.train.metrics import read_metrics

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  """A tiny random Llama with a byte-level BPE trained on Shakespeare, saved as transformers would."""
  d = tmp_path_factory.mktemp("hf_llama")
  tok = hf_utils.byte_level_bpe(200_000, 320, ["<s>", "</s>"])
  hf_utils.save_tokenizer_files(tok, d, "<s>", "</s>")
  hf_utils.save_llama(d, tok.get_vocab_size(), hidden=32, ffn=64, max_positions=128, tied=False)
  return d


def _torch_logits(model_dir, tokens):
  m = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
  with torch.no_grad():
    return m(torch.as_tensor(np.asarray(tokens))).logits.numpy()


def test_eval_of_an_hf_model_matches_transformers_loss(hf_dir):
  res = eval_cli.main([f"--hf={hf_dir}", "--corpus=shakespeare", "--seq_len=32", "--batch_size=4", "--batches=2"])
  cfg = eval_cli._data_config(eval_cli.parse_args([f"--hf={hf_dir}", "--corpus=shakespeare", "--seq_len=32",
                                                   "--batch_size=4"]))
  batches = pipeline.eval_batches(pipeline.build_dataset(cfg.data), cfg.data, 2)
  nll = []
  for b in batches:
    logp = torch.log_softmax(torch.as_tensor(_torch_logits(hf_dir, b["inputs"])), -1)
    nll.append(-logp.gather(-1, torch.as_tensor(b["targets"]).long()[..., None]).squeeze(-1).numpy())
  assert res["val_loss"] == pytest.approx(float(np.mean(nll)), rel=1e-5)
  assert res["tokens"] == 2 * 4 * 32


@pytest.mark.slow
def test_finetune_from_hf_then_export_reloads_in_transformers(hf_dir, tmp_path):
  work, out = tmp_path / "ft", tmp_path / "export"
  # tformer-train in this process (main(argv), as scripts/train.py runs it), on one device as a subprocess had
  assert train_cli.main(["--config=finetune_hf", f"--workdir={work}", f"--config.train.init_from=hf:{hf_dir}",
                         "--config.data.seq_len=32", "--config.data.batch_size=8", "--config.train.steps=12",
                         "--config.optim.peak_lr=3e-3", "--config.optim.warmup_steps=1",
                         "--config.train.log_every=1", "--config.train.eval_every=12",
                         "--config.train.eval_batches=2", "--config.train.sample_tokens=0",
                         "--config.model.scan_layers=true", "--config.mesh.num_devices=1"]) == 0
  cfg = workdir_config(work)
  assert cfg.model.d_model == 32 and cfg.model.num_kv_heads == 2 and cfg.model.scan_layers   # theirs + our layout
  assert cfg.data.tokenizer == f"hf:{hf_dir}"
  rows = [m for m in read_metrics(work) if "loss" in m]
  # step 1 is the HF weights' loss on the first batch: the run started from them
  model, params = load_hf(hf_dir)
  ds = pipeline.build_dataset(cfg.data)
  first = next(pipeline.train_iterator(ds, cfg.data))
  want = step_lib.eval_step(params, {k: jnp.asarray(v) for k, v in first.items()}, model=model)
  assert rows[0]["loss"] == pytest.approx(float(want["nll_sum"] / want["count"]), rel=1e-4)
  assert rows[-1]["loss"] < rows[0]["loss"] - 0.2                            # and it learns

  assert convert.main(["--from", str(work), "--to-hf", str(out)]) == 0
  assert (out / "tokenizer.json").read_bytes() == (hf_dir / "tokenizer.json").read_bytes()
  gen = json.loads((out / "generation_config.json").read_text())
  hf_cfg = json.loads((out / "config.json").read_text())
  assert gen["eos_token_id"] == hf_cfg["eos_token_id"] == 1 and gen["bos_token_id"] == 0
  _, ours = restore_params(work)
  assert "layers" in ours and "layers_0" in params                   # trained scanned, from unscanned weights
  tokens = np.asarray(first["inputs"][:2])
  mine = Transformer(ModelConfig.from_config(cfg.model)).apply({"params": ours}, jnp.asarray(tokens))
  np.testing.assert_allclose(_torch_logits(out, tokens), np.asarray(mine), **TOL)
