"""lm-evaluation-harness: our `tformer` model class against the harness's own Hugging Face backend (HFLM)
on the same weights, for the three kinds of request (the shipped multiple-choice, rolling-perplexity
and generation tasks); on a tiny transformers Llama and on a model trained by tformer-train (exported
with tformer-convert --to-hf for HFLM); and the tformer-eval --tasks command line.

Tolerances: accuracy and exact match equal; loglikelihood requests within 1e-4 nats each (observed
~2e-5); a rolling document within 1e-4 nats or 1e-6 of its total (HFLM sums each window's token
log-probabilities in float32: ~1e-4 on a 4000-nat document); generated text identical (greedy).
Without the `eval` extra (lm-eval) these tests skip; the HFLM cases also need torch + transformers.
"""
from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (the `eval` extra)")
torch = pytest.importorskip("torch", reason="the HF-backend reference needs torch (the `reference` extra)")
transformers = pytest.importorskip("transformers", reason="the HF-backend reference needs transformers")
pytest.importorskip("accelerate", reason="the harness's HF backend needs accelerate (the `eval` extra)")
pytestmark = pytest.mark.reference

import jax  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402

from tformer_jax import decode, model_loading  # noqa: E402
from tformer_jax.cli import convert, eval as eval_cli, train as train_cli  # noqa: E402
from tformer_jax.config import default_config  # noqa: E402
from tformer_jax.data.corpora import load_corpus  # noqa: E402
from tformer_jax.eval import harness  # noqa: E402

from train_utils import REPO  # noqa: E402

TASKS = ["shakespeare_next_line", "shakespeare_ppl", "shakespeare_continue"]
LIMIT = 4
LL_TOL = 1e-4


def write_tokenizer(d: pathlib.Path) -> int:
  """A byte-level BPE on Shakespeare whose post-processor prepends <s> (like Llama's); its vocab size."""
  text = load_corpus("shakespeare")[:200_000].decode("utf-8", "replace")
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(text.splitlines(), trainers.BpeTrainer(
      vocab_size=320, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
  d.mkdir(parents=True, exist_ok=True)
  tok.save(str(d / "tokenizer.json"))
  (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                       "tokenizer_class": "PreTrainedTokenizerFast"}))
  return tok.get_vocab_size()


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory) -> pathlib.Path:
  """A tiny random transformers Llama (float32, 128 positions) with the BPE above, as an HF directory."""
  d = tmp_path_factory.mktemp("hf_llama")
  vocab = write_tokenizer(d)
  torch.manual_seed(0)
  cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                 tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
  transformers.LlamaForCausalLM(cfg).save_pretrained(d)
  return d


@pytest.fixture(scope="module")
def manager():
  """Our tasks only (indexing the harness's own thousands of YAMLs takes 5-20 s here)."""
  return harness.task_manager(include_defaults=False)


def evaluate(lm, manager, tasks=TASKS, limit=LIMIT) -> dict:
  return lm_eval.simple_evaluate(model=lm, tasks=tasks, limit=limit, task_manager=manager, log_samples=True,
                                 bootstrap_iters=0)


def hf_backend(path: pathlib.Path) -> HFLM:
  return HFLM(pretrained=str(path), batch_size=4, device="cpu", dtype="float32")


def responses(res: dict, task: str) -> list:
  """Every request's answer, in the harness's (document, request) order."""
  return [r[0] for s in sorted(res["samples"][task], key=lambda s: s["doc_id"]) for r in s["resps"]]


def assert_same(ours: dict, theirs: dict) -> None:
  for task, metrics in theirs["results"].items():
    for name in ("acc,none", "acc_norm,none", "exact_match,none"):
      if name in metrics:
        assert ours["results"][task][name] == metrics[name], (task, name)
  mc_ours, mc_theirs = responses(ours, "shakespeare_next_line"), responses(theirs, "shakespeare_next_line")
  assert len(mc_ours) == 4 * LIMIT
  np.testing.assert_allclose([x[0] for x in mc_ours], [x[0] for x in mc_theirs], rtol=0, atol=LL_TOL)
  assert [x[1] for x in mc_ours] == [x[1] for x in mc_theirs]
  ppl_ours, ppl_theirs = responses(ours, "shakespeare_ppl"), responses(theirs, "shakespeare_ppl")
  np.testing.assert_allclose(ppl_ours, ppl_theirs, rtol=1e-6, atol=LL_TOL)
  for key in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
    np.testing.assert_allclose(ours["results"]["shakespeare_ppl"][key], theirs["results"]["shakespeare_ppl"][key],
                               rtol=1e-6)
  assert responses(ours, "shakespeare_continue") == responses(theirs, "shakespeare_continue")


def test_tiny_llama_matches_the_hf_backend(hf_llama, manager):
  ours = harness.TformerLM(hf=str(hf_llama), batch_size=4)
  assert (ours.max_length, ours.prefix_token_id, ours.eot_token_id) == (128, 0, 1)
  theirs = hf_backend(hf_llama)
  text = "ROMEO: But soft, what light"
  assert ours.tok_encode(text) == theirs.tok_encode(text) and ours.tok_encode(text)[0] == 0   # BOS added
  assert ours.tok_encode("<s>" + text) == theirs.tok_encode("<s>" + text)                     # not twice
  r_ours, r_theirs = evaluate(ours, manager), evaluate(theirs, manager)
  # each document is longer than one 128-token window: several rolling windows per request
  assert len(ours.tok_encode(r_ours["samples"]["shakespeare_ppl"][0]["doc"]["text"])) > 2 * 128
  assert_same(r_ours, r_theirs)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[pathlib.Path, pathlib.Path]:
  """(workdir, its HF export): 20 steps of tformer-train on Shakespeare with the BPE above, float32, the
  harness's shakespeare_next_line at its evaluation (train.eval_tasks)."""
  root = tmp_path_factory.mktemp("trained")
  write_tokenizer(root / "tok")
  work, hf_dir = root / "work", root / "hf"
  flags = {"model.d_model": 32, "model.num_layers": 2, "model.num_heads": 4, "model.num_kv_heads": 2,
           "model.max_len": 128, "model.dtype": "float32", "model.param_dtype": "float32",
           "data.tokenizer": f"hf:{root / 'tok' / 'tokenizer.json'}", "data.seq_len": 64, "data.batch_size": 8,
           "optim.peak_lr": 3e-3, "optim.warmup_steps": 3, "train.steps": 20, "train.eval_every": 20,
           "train.ckpt_every": 20, "train.eval_batches": 1, "train.sample_tokens": 0, "train.log_every": 10,
           "train.eval_tasks": "shakespeare_next_line", "train.eval_tasks_limit": LIMIT}
  # tformer-train in this process (main(argv), as scripts/train.py runs it), on one device as a subprocess had
  assert train_cli.main([f"--config={REPO / 'configs' / 'llama_tiny.py'}", f"--workdir={work}",
                         *[f"--config.{k}={v}" for k, v in flags.items()], "--config.mesh.num_devices=1"]) == 0
  assert convert.main(["--from", str(work), "--to-hf", str(hf_dir)]) == 0
  return work, hf_dir


@pytest.fixture(scope="module")
def trained_results(trained, manager) -> tuple[dict, dict]:
  work, hf_dir = trained
  ours = harness.TformerLM(workdir=str(work), batch_size=4)
  assert (ours.max_length, ours.prefix_token_id, ours.eot_token_id) == (128, 0, 1)
  return evaluate(ours, manager), evaluate(hf_backend(hf_dir), manager)


def test_trained_model_matches_the_hf_backend_on_its_export(trained_results):
  assert_same(*trained_results)


def test_train_eval_tasks_logs_the_harness_metrics_with_the_loss(trained, trained_results):
  work, _ = trained
  rows = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines() if line.strip()]
  row = next(r for r in rows if "harness/shakespeare_next_line/acc" in r)
  assert row["step"] == 20 and "val_loss" in row
  api = trained_results[0]["results"]["shakespeare_next_line"]     # the step-20 checkpoint, the same documents
  assert row["harness/shakespeare_next_line/acc"] == api["acc,none"]
  assert row["harness/shakespeare_next_line/acc_norm"] == api["acc_norm,none"]


def test_cli_prints_the_table_and_writes_the_json(trained, trained_results, tmp_path, capsys):
  work, _ = trained
  out = tmp_path / "res.json"
  eval_cli.main([f"--workdir={work}", "--tasks=shakespeare_next_line", f"--limit={LIMIT}", f"--json={out}",
                 "--batch_size=2"])
  printed = capsys.readouterr().out
  assert "shakespeare_next_line" in printed and "acc_norm" in printed and f"wrote {out}" in printed
  assert f"{work}: checkpoint step 20" in printed.splitlines()      # the step it scored, printed and stored
  stored = json.loads(out.read_text())
  assert stored["tformer"]["source"] == str(work) and stored["tformer"]["batch_size"] == 2
  assert stored["tformer"]["step"] == 20
  api = trained_results[0]["results"]["shakespeare_next_line"]          # the same documents, batched by 4
  for key in ("acc,none", "acc_norm,none"):
    assert stored["results"]["shakespeare_next_line"][key] == api[key]
  # lm-eval's --output_path: the results folder, DIR/<model>/results_<time>.json
  eval_cli.main([f"--workdir={work}", "--tasks=shakespeare_next_line", f"--limit={LIMIT}",
                 f"--output_path={tmp_path / 'results'}", "--batch_size=2"])
  found = list((tmp_path / "results").glob("*/results_*.json"))
  assert len(found) == 1 and found[0].parent.name == str(work).replace("/", "__"), found
  assert json.loads(found[0].read_text())["results"] == stored["results"]


def test_cli_one_line_errors(trained, capsys):
  work, _ = trained
  for argv, want in [([f"--workdir={work}", "--limit=3"], "--limit needs --tasks"),
                     ([f"--workdir={work}", "--tasks=shakespeare_ppl", "--include_path=/no/such/dir"], "not a folder"),
                     ([f"--workdir={work}", "--tasks=shakespeare_ppl", "--limit=0"], "--limit must be > 0"),
                     ([f"--workdir={work}", "--tasks=,"], "name at least one harness task"),
                     ([f"--workdir={work}", "--output_path=res"], "--output_path needs --tasks"),
                     ([f"--workdir={work}", "--tasks=shakespeare_ppl", "--json=a.json", "--output_path=res"],
                      "pass one of --json=FILE, --output_path=PATH")]:
    with pytest.raises(SystemExit) as e:
      eval_cli.main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.startswith("error: ") and want in err and "\n" not in err, (argv, err)


def test_byte_model_answers_equal_its_own_forward_and_decoder():
  """A model on the byte tokenizer (no BOS/EOS: the prefix is the newline): a rolling request is the
  full forward's log-likelihood after the prefix; generation is decode.generate's greedy text, cut."""
  cfg = default_config()
  cfg.model.update(d_model=32, num_layers=2, num_heads=4, max_len=64, position="rope", norm="rmsnorm")
  model, params, tok = model_loading.random_init(cfg, seed=3)
  lm = harness.TformerLM(model=model, params=params, tokenizer=tok, batch_size=1)   # decode.generate's shapes
  assert (lm.prefix_token_id, lm.eot_token_id, lm.max_length) == (10, None, 64)
  text = "But soft, what light through yonder window breaks?"
  ids = [10] + list(tok.encode(text))
  logp = jax.nn.log_softmax(model.apply({"params": params}, np.asarray([ids[:-1]], np.int32))[0], -1)
  want = float(np.sum(np.asarray(logp)[np.arange(len(ids) - 1), ids[1:]]))
  req = [Instance("loglikelihood_rolling", {}, (text,), 0), Instance("loglikelihood_rolling", {}, ("x" * 150,), 1)]
  got = lm.loglikelihood_rolling(req, disable_tqdm=True)
  assert abs(got[0] - want) < LL_TOL and np.isfinite(got[1])
  prompt = "ROMEO:\n"
  gen = lm.generate_until([Instance("generate_until", {}, (prompt, {"until": ["\n"], "max_gen_toks": 20}), 0)],
                          disable_tqdm=True)
  out = decode.generate(model, params, [tok.encode(prompt)], max_new_tokens=20, temperature=0.0, stop_tokens=[10],
                        pad_id=-1)[0]
  out = out[out >= 0]
  assert gen == [tok.decode(out).split("\n")[0]]


def test_train_eval_tasks_limit_is_checked():
  from tformer_jax.config import ConfigError, validate
  cfg = default_config()
  cfg.train.eval_tasks, cfg.train.eval_tasks_limit = "shakespeare_ppl", -1
  with pytest.raises(ConfigError, match="train.eval_tasks_limit: must be >= 0"):
    validate(cfg)


def test_the_loop_takes_its_eval_tasks_hook_from_the_caller(tmp_path):
  """train sits below eval: tformer-train passes HarnessEval down; a library caller that names
  train.eval_tasks and passes no hook is told so in one line, before the workdir is made."""
  from tformer_jax.config import ConfigError
  from tformer_jax.train import loop
  cfg = default_config()
  cfg.train.eval_tasks = "shakespeare_ppl"
  with pytest.raises(ConfigError, match="train.eval_tasks: this caller passed no eval_hook"):
    loop.train(cfg, tmp_path / "run")
  assert not (tmp_path / "run").exists()


def test_length_buckets_bound_the_compiled_shapes():
  assert [harness.length_bucket(n, 128) for n in (1, 16, 17, 100, 128)] == [16, 16, 32, 128, 128]
  assert harness.length_bucket(90, 100) == 100
  assert harness.shipped_tasks() == sorted(TASKS)
