"""Convert between Hugging Face model directories and training workdirs.

  tformer-convert --from-hf path/to/hf_model --to runs/converted
      -> runs/converted/config.json (a full experiment config) + an Orbax checkpoint at step 0
         holding {'params': ...}; the HF tokenizer files (tokenizer.json, tokenizer_config.json,
         special_tokens_map.json, generation_config.json) are copied and tokenizer.json set as
         data.tokenizer. Train from it with --config=runs/converted (its config) and
         --config.train.init_from=runs/converted, or skip this step: train.init_from=hf:DIR.
  tformer-convert --from runs/my_finetune --to-hf out/hf_model [--family llama]
      -> config.json + model.safetensors that transformers' from_pretrained loads, the run's tokenizer
         files, and its bos/eos/pad ids in config.json and generation_config.json.
         Without --family, the first family that reproduces the architecture exactly; a model that
         no family holds is refused with the fields that differ.

Nothing is downloaded and no code from the HF directory is executed (a .bin holding pickled objects
is refused, not unpickled). Anticipated errors (a bad directory, a malformed or corrupt config.json or
weights file, a config.json that disagrees with the weights, a missing checkpoint, an architecture HF
cannot hold) print one line, `error: ...`, and exit 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import pathlib
import shutil
import sys
from typing import Sequence

import ml_collections

from tformer_jax import cli_common, decode_io
from tformer_jax.checkpoint import Checkpointer, CheckpointError, restore_params
from tformer_jax.config import ConfigError, ModelConfig, default_config
from tformer_jax.data.corpora import DataError
from tformer_jax.interop.hf import TOKENIZER_FILES, HFConfigError, HFWeightsError, load_hf, save_hf, special_token_ids

# What a user can cause (bad paths or permissions, malformed or unsafe HF files, checkpoints, configs,
# architectures): one line, exit status 2. Anything else is a bug and keeps its traceback.
USER_ERRORS = (HFConfigError, HFWeightsError, CheckpointError, ConfigError, DataError, OSError)


def hf_to_workdir(hf_dir: str | pathlib.Path, workdir: str | pathlib.Path, step: int = 0) -> pathlib.Path:
  """Write `workdir`/config.json and an Orbax checkpoint of the HF model's params at `step`."""
  hf_dir, work = pathlib.Path(hf_dir), pathlib.Path(workdir).absolute()
  ckpt_dir = work / "checkpoints"
  if ckpt_dir.exists() and any(ckpt_dir.iterdir()):
    raise FileExistsError(f"{ckpt_dir} already holds checkpoints; convert into a fresh workdir")
  model, params = load_hf(hf_dir)
  cfg = default_config()
  cfg.model = ml_collections.ConfigDict(dataclasses.asdict(model.cfg))
  cfg.data.seq_len = min(cfg.data.seq_len, model.cfg.max_len)
  work.mkdir(parents=True, exist_ok=True)
  for name in TOKENIZER_FILES:             # the tokenizer and its bos/eos/pad ids travel with the weights
    if (hf_dir / name).is_file():
      shutil.copyfile(hf_dir / name, work / name)
  if (work / "tokenizer.json").is_file():
    cfg.data.tokenizer = "hf:" + str(work / "tokenizer.json")
  (work / "config.json").write_text(cfg.to_json_best_effort(indent=2) + "\n")
  ckpt = Checkpointer(ckpt_dir)
  try:
    ckpt.save(step, {"params": params}, None, {"converted_from": str(hf_dir.absolute())}, force=True)
    ckpt.wait()
  finally:
    ckpt.close()
  return work


def workdir_to_hf(workdir: str | pathlib.Path, hf_dir: str | pathlib.Path, family: str | None = None,
                  step: int | None = None) -> pathlib.Path:
  """Export the params of `workdir`'s latest checkpoint (or `step`) as a Hugging Face directory, with
  the run's tokenizer files (an hf: tokenizer) and its bos/eos/pad ids in config.json and
  generation_config.json."""
  cfg, params = restore_params(workdir, step)
  tok_spec = str(cfg.get("data", {}).get("tokenizer", ""))
  tok_dir = None
  if tok_spec.startswith("hf:"):
    src = pathlib.Path(tok_spec[3:])
    tok_dir = src if src.is_dir() else src.parent
  ids = None
  try:
    tokenizer = decode_io.tokenizer_from_config(cfg)
    ids = special_token_ids(tokenizer, tok_dir)
  except (DataError, OSError) as e:       # a tokenizer this machine cannot load: export the weights anyway
    print(f"note: no bos/eos/pad ids written ({e})", file=sys.stderr)
  out = save_hf(ModelConfig.from_config(cfg.model), params, hf_dir, family, token_ids=ids)  # refuses first
  if tok_dir is not None:
    for name in TOKENIZER_FILES:          # the source's own generation_config.json wins over ours
      if (tok_dir / name).is_file():
        shutil.copyfile(tok_dir / name, out / name)
  return out


def main(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  src = p.add_mutually_exclusive_group(required=True)
  src.add_argument("--from-hf", dest="from_hf", help="a local Hugging Face model directory")
  src.add_argument("--from", dest="from_workdir", help="a training workdir (config.json + checkpoints/)")
  p.add_argument("--to", help="the workdir to create (with --from-hf)")
  p.add_argument("--to-hf", dest="to_hf", help="the HF directory to write (with --from)")
  p.add_argument("--family", help="HF family for --to-hf (default: the first that fits the model)")
  p.add_argument("--step", type=int, default=None, help="checkpoint step: written (--from-hf, default 0) "
                 "or read (--from, default latest)")
  args = p.parse_args(argv)
  if args.from_hf and not args.to:
    p.error("--from-hf needs --to WORKDIR")
  if args.from_workdir and not args.to_hf:
    p.error("--from needs --to-hf DIR")
  try:
    if args.from_hf:
      out = hf_to_workdir(args.from_hf, args.to, step=args.step or 0)
    else:
      out = workdir_to_hf(args.from_workdir, args.to_hf, args.family, args.step)
  except USER_ERRORS as e:
    print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
    return 2
  print(f"wrote {out}")
  return 0



def entry() -> None:
  """The `tformer-convert` console command."""
  cli_common.exit_process(cli_common.run_main(main))


if __name__ == "__main__":
  entry()
