"""Convert between Hugging Face model directories and training workdirs.

  tformer-convert --from-hf=path/to/hf_model --to=runs/converted
      -> runs/converted/config.json (a full experiment config) + an Orbax checkpoint at step 0
         holding {'params': ...}; the HF tokenizer files (tokenizer.json, tokenizer_config.json,
         special_tokens_map.json, chat_template.jinja, generation_config.json) are copied and tokenizer.json
         set as data.tokenizer (one that does not load is refused). Train from it with
         --config=runs/converted (its config) and --config.train.init_from=runs/converted, or skip this
         step: train.init_from=hf:DIR.
  tformer-convert --from=runs/my_finetune --to-hf=out/hf_model [--family=llama]
      -> config.json + model.safetensors that transformers' from_pretrained loads, the tokenizer the run's
         data was tokenized with (a prepared corpus's own, chat template included), and its bos/eos/pad ids
         in config.json and generation_config.json.
         Without --family, the first family that reproduces the architecture exactly; a model that
         no family holds is refused with the fields that differ.

  tformer-convert --from-gguf=path/to/model.gguf --out=out/hf_model
      -> the HF directory (config.json + float32 model.safetensors, tokenizer.json, tokenizer_config.json with
         the chat template and special tokens, generation_config.json) of a GGUF Llama-family checkpoint,
         dequantised with the gguf package (the `gguf` extra; tformer_jax/interop/gguf.py): use it as
         train.init_from=hf:DIR or with tformer-generate / -eval / -serve. A .gguf given to --from-hf
         (with --to) goes through the same import into a workdir.

Outputs are owned: each is written whole in a directory beside the target, then renamed into place
(tformer_export.json / tformer_convert.json list its files), so a failure (a full disk) leaves nothing;
the target must be missing or empty, or with --overwrite an earlier output of ours, which it replaces.
Nothing is downloaded and no code from the HF directory is executed (a .bin holding pickled objects
is refused, not unpickled). Anticipated errors (a bad directory, a malformed or corrupt config.json or
weights file, a config.json that disagrees with the weights, a missing checkpoint, an architecture HF
cannot hold) print one line, `error: ...`, and exit 2.
"""
from __future__ import annotations

import dataclasses
import pathlib
import shutil
import sys
import tempfile
from typing import Any, Sequence

import ml_collections
from absl import flags

from tformer_jax import cli_common, model_loading
from tformer_jax.checkpoint import Checkpointer, CheckpointError, restore_params
from tformer_jax.config import ConfigError, ModelConfig, default_config
from tformer_jax.data.corpora import DataError
from tformer_jax.data.pipeline import parse_mixture
from tformer_jax.data.prepared import read_manifest
from tformer_jax.data.tokenizers import SentencePieceTokenizer, get_tokenizer
from tformer_jax.interop.families import FAMILIES
from tformer_jax.interop.gguf import gguf_to_hf
from tformer_jax.interop.hf import (
    HFConfigError,
    HFWeightsError,
    byte_tokenizer_files,
    check_target,
    load_hf,
    save_hf,
    special_token_ids,
    tokenizer_files,
    write_dir_atomically,
)
from tformer_jax.interop.hf.tokenizer import sentencepiece_tokenizer_files

# What a user can cause (bad paths or permissions, malformed or unsafe HF files, checkpoints, configs,
# architectures): one line, exit status 2. Anything else is a bug and keeps its traceback.
USER_ERRORS = (HFConfigError, HFWeightsError, CheckpointError, ConfigError, DataError, OSError)


CONVERT_MARKER = "tformer_convert.json"
CONVERT_FORMAT = "tformer_jax.converted/1"


def hf_to_workdir(hf_dir: str | pathlib.Path, workdir: str | pathlib.Path, step: int = 0,
                  overwrite: bool = False) -> pathlib.Path:
  """Write `workdir`/config.json and an Orbax checkpoint of the HF model's params at `step`, with its
  tokenizer files (a tokenizer.json that does not load is refused). The workdir is written whole beside
  the target and renamed into place: the target must be missing, empty or (overwrite) an earlier
  conversion of ours."""
  hf_dir, work = pathlib.Path(hf_dir), pathlib.Path(workdir).absolute()
  check_target(work, overwrite, CONVERT_MARKER, CONVERT_FORMAT, "a converted workdir")
  tok_file = hf_dir / "tokenizer.json"
  if tok_file.is_file():
    try:
      get_tokenizer(f"hf:{tok_file}")
    except DataError as e:
      raise DataError(f"{tok_file} does not load as a tokenizer ({e}); fix it, or convert a copy of "
                      f"{hf_dir} without it") from None
  model, params = load_hf(hf_dir)
  cfg = default_config()
  cfg.model = ml_collections.ConfigDict(dataclasses.asdict(model.cfg))
  cfg.data.seq_len = min(cfg.data.seq_len, model.cfg.max_len)
  if tok_file.is_file():                   # the tokenizer and its bos/eos/pad ids travel with the weights
    cfg.data.tokenizer = "hf:" + str(work / "tokenizer.json")

  def write(tmp: pathlib.Path) -> None:
    for name, f in tokenizer_files(hf_dir).items():
      (tmp / name).parent.mkdir(parents=True, exist_ok=True)
      shutil.copyfile(f, tmp / name)
    (tmp / "config.json").write_text(cfg.to_json_best_effort(indent=2) + "\n")
    ckpt = Checkpointer(tmp / "checkpoints")
    try:
      ckpt.save(step, {"params": params}, None, {"converted_from": str(hf_dir.absolute())}, force=True)
      ckpt.wait()
    finally:
      ckpt.close()

  write_dir_atomically(work, write, CONVERT_MARKER, CONVERT_FORMAT, {"converted_from": str(hf_dir.absolute())})
  return work


def data_tokenizer_files(cfg: ml_collections.ConfigDict) -> tuple[pathlib.Path | None, dict[str, pathlib.Path]]:
  """(directory, {name: file}) of the HF tokenizer the run's data was tokenized with: a prepared corpus's
  own copy (its manifest's tokenizer, chat template included), else data.tokenizer's hf: files; none for
  the byte tokenizer or a sentencepiece model (an HF directory carries tokenizer.json)."""
  data = cfg.get("data", {})
  mixture = data.get("mixture")
  spec = str(parse_mixture(mixture)[0][0] if mixture else data.get("corpus", "")).strip()
  if spec.startswith("prepared:"):
    root = pathlib.Path(spec[len("prepared:"):].strip()).expanduser()
    try:
      info = read_manifest(root)["tokenizer"]
    except DataError as e:
      print(f"note: no tokenizer files written ({e})", file=sys.stderr)
      return None, {}
    file = info.get("file")
    if not file or not file.endswith(".json"):
      return root, {}                              # a sentencepiece model: _own_tokenizer_files exports it
    names = [file, *info.get("extra_files", {})]
    return root, {n: root / n for n in names if (root / n).is_file()}
  tok_spec = str(data.get("tokenizer", ""))
  if not tok_spec.startswith("hf:"):
    return None, {}
  src = pathlib.Path(tok_spec[3:]).expanduser()
  tok_dir = src if src.is_dir() else src.parent
  return tok_dir, tokenizer_files(tok_dir)


def workdir_to_hf(workdir: str | pathlib.Path, hf_dir: str | pathlib.Path, family: str | None = None,
                  step: int | None = None, overwrite: bool = False) -> pathlib.Path:
  """Export the params of `workdir`'s latest checkpoint (or `step`) as a Hugging Face directory, with
  the tokenizer the run's data was tokenized with (`data_tokenizer_files`) and its bos/eos/pad ids in
  config.json and generation_config.json. Written whole and atomically (hf.save_hf)."""
  cfg, params, step = restore_params(workdir, step, with_step=True)     # the step read, for tformer_export.json
  tok_dir, files = data_tokenizer_files(cfg)
  ids = None
  try:
    tokenizer = model_loading.tokenizer_from_config(cfg)
    ids = special_token_ids(tokenizer, tok_dir)
  except (DataError, OSError) as e:       # a tokenizer this machine cannot load: export the weights anyway
    print(f"note: no bos/eos/pad ids written ({e})", file=sys.stderr)
  model_cfg = ModelConfig.from_config(cfg.model)
  with tempfile.TemporaryDirectory() as tmp:
    if not files:
      files = _own_tokenizer_files(cfg, model_cfg, pathlib.Path(tmp))
    return save_hf(model_cfg, params, hf_dir, family, token_ids=ids, files=files, overwrite=overwrite,
                   source={"from_workdir": str(pathlib.Path(workdir).absolute()), "step": step})


def _own_tokenizer_files(cfg: ml_collections.ConfigDict, model_cfg: ModelConfig, tmp: pathlib.Path
                         ) -> dict[str, pathlib.Path]:
  """Tokenizer files for a run whose tokenizer has no HF files: the byte tokenizer as a byte-level
  tokenizer.json transformers loads with the same ids; for any other, a one-line note and none."""
  spec = str(cfg.get("data", {}).get("tokenizer", "byte")).strip()
  synthetic = str(cfg.data.get("corpus", "")).startswith("synthetic:")
  if spec == "byte" and not synthetic:
    return byte_tokenizer_files(tmp, model_cfg.max_len)
  if spec.startswith("hf:"):
    return {}
  try:
    tok = None if synthetic else model_loading.tokenizer_from_config(cfg)   # the run's own: a prepared corpus's too
  except (DataError, OSError):                     # not loadable here: noted with the ids (workdir_to_hf)
    tok = None
  if isinstance(tok, SentencePieceTokenizer):      # tokenizer.model + transformers' tokenizer.json of it
    try:
      return sentencepiece_tokenizer_files(tok.path, tmp, model_cfg.max_len)
    except ImportError as e:                       # transformers (or its protobuf) missing
      why = (f"the run's sentencepiece model ({tok.path}) is exported through transformers' converter, which "
             f"needs {e.name or e}: pip install 'tformer-jax[reference]' protobuf")
  else:
    why = "a synthetic task's vocabulary is not text" if synthetic else f"data.tokenizer={spec} has no HF files"
  print(f"note: no tokenizer files written: {why}", file=sys.stderr)
  return {}


def define_flags(fv: flags.FlagValues) -> None:
  flags.DEFINE_string("from-hf", None, "a local Hugging Face model directory (with --to)", flag_values=fv)
  flags.DEFINE_string("from", None, "a training workdir: config.json + checkpoints/ (with --to-hf)", flag_values=fv)
  flags.DEFINE_string("to", None, "the workdir to create (with --from-hf)", flag_values=fv)
  flags.DEFINE_string("to-hf", None, "the HF directory to write (with --from)", flag_values=fv)
  flags.DEFINE_string("from-gguf", None, "a GGUF Llama-family checkpoint file (with --out): written as an HF "
                      "directory, float32, with its tokenizer and chat template", flag_values=fv)
  flags.DEFINE_string("out", None, "the HF directory to write (with --from-gguf)", flag_values=fv)
  flags.DEFINE_string("family", None, f"HF family for --to-hf, one of {', '.join(FAMILIES)} (default: the first "
                      "of them that holds the model exactly)", flag_values=fv)
  flags.DEFINE_integer("step", None, "checkpoint step: written (--from-hf, default 0) or read (--from, default "
                       "the latest)", flag_values=fv)
  flags.DEFINE_bool("overwrite", False, "replace an earlier output of tformer-convert (anything else in the "
                    "target is refused)", flag_values=fv)


def main(argv: Sequence[str] | None = None) -> int:
  args = cli_common.parse(argv, define_flags, doc=__doc__, prog="tformer-convert")
  source = getattr(args, "from")
  if args.from_gguf or args.out:
    return _from_gguf(args, source)
  if bool(args.from_hf) == bool(source):
    cli_common.fail("pass exactly one of --from-hf=DIR (with --to=WORKDIR) or --from=WORKDIR (with --to-hf=DIR)")
  if args.from_hf and not args.to:
    cli_common.fail("--from-hf needs --to=WORKDIR")
  if source and not args.to_hf:
    cli_common.fail("--from needs --to-hf=DIR")
  try:
    if args.from_hf and args.from_hf.endswith(".gguf"):
      out = _gguf_to_workdir(args)
    elif args.from_hf:
      out = hf_to_workdir(args.from_hf, args.to, step=args.step or 0, overwrite=args.overwrite)
    else:
      out = workdir_to_hf(source, args.to_hf, args.family, args.step, overwrite=args.overwrite)
  except USER_ERRORS as e:
    print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
    return 2
  print(f"wrote {out}")
  return 0


def _from_gguf(args: Any, source: str | None) -> int:
  """--from-gguf=FILE --out=DIR: the GGUF checkpoint as an HF directory."""
  if not args.from_gguf or not args.out or args.from_hf or source or args.to or args.to_hf:
    cli_common.fail("--from-gguf=FILE takes --out=DIR (and neither --from-hf, --from, --to nor --to-hf)")
  cli_common.require_extra("tformer-convert --from-gguf", "gguf")
  try:
    out = gguf_to_hf(args.from_gguf, args.out, overwrite=args.overwrite)
  except USER_ERRORS as e:
    print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
    return 2
  print(f"wrote {out}")
  return 0


def _gguf_to_workdir(args: Any) -> pathlib.Path:
  """--from-hf=FILE.gguf --to=WORKDIR: the GGUF imported as an HF directory beside the workdir, then converted."""
  cli_common.require_extra("tformer-convert --from-hf=FILE.gguf", "gguf")
  work = pathlib.Path(args.to).absolute()
  check_target(work, args.overwrite, CONVERT_MARKER, CONVERT_FORMAT, "a converted workdir")
  work.parent.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=work.parent, prefix=f".{work.name}.gguf-") as tmp:
    hf_dir = gguf_to_hf(args.from_hf, pathlib.Path(tmp) / "hf")
    return hf_to_workdir(hf_dir, work, step=args.step or 0, overwrite=args.overwrite)


def entry() -> None:
  """The `tformer-convert` console command."""
  cli_common.exit_process(cli_common.run_main(main))


if __name__ == "__main__":
  entry()
