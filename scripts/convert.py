"""Convert between Hugging Face model directories and training workdirs.

  python scripts/convert.py --from-hf path/to/hf_model --to runs/my_finetune
      -> runs/my_finetune/config.json (a full experiment config) + an Orbax checkpoint at step 0
         holding {'params': ...}; the HF tokenizer.json (if any) is copied and set as data.tokenizer.
         Fine-tune with train.init_from=runs/my_finetune, sample with generate.py --workdir.
  python scripts/convert.py --from runs/my_finetune --to-hf out/hf_model [--family llama]
      -> config.json + model.safetensors that transformers' from_pretrained loads (and tokenizer.json).

Nothing is downloaded and no code from the HF directory is executed.
"""
from __future__ import annotations

import argparse
import dataclasses
import pathlib
import shutil
import sys
from typing import Sequence

import ml_collections


def hf_to_workdir(hf_dir: str | pathlib.Path, workdir: str | pathlib.Path, step: int = 0) -> pathlib.Path:
  """Write `workdir`/config.json and an Orbax checkpoint of the HF model's params at `step`."""
  from tformer_jax.checkpoint import Checkpointer
  from tformer_jax.config import default_config
  from tformer_jax.interop.hf import load_hf

  hf_dir, work = pathlib.Path(hf_dir), pathlib.Path(workdir).absolute()
  ckpt_dir = work / "checkpoints"
  if ckpt_dir.exists() and any(ckpt_dir.iterdir()):
    raise FileExistsError(f"{ckpt_dir} already holds checkpoints; convert into a fresh workdir")
  model, params = load_hf(hf_dir)
  cfg = default_config()
  cfg.model = ml_collections.ConfigDict(dataclasses.asdict(model.cfg))
  cfg.data.seq_len = min(cfg.data.seq_len, model.cfg.max_len)
  work.mkdir(parents=True, exist_ok=True)
  if (hf_dir / "tokenizer.json").is_file():
    shutil.copyfile(hf_dir / "tokenizer.json", work / "tokenizer.json")
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
  """Export the params of `workdir`'s latest checkpoint (or `step`) as a Hugging Face directory."""
  from tformer_jax.checkpoint import restore_params
  from tformer_jax.config import ModelConfig
  from tformer_jax.interop.hf import save_hf

  cfg, params = restore_params(workdir, step)
  out = save_hf(ModelConfig.from_config(cfg.model), params, hf_dir, family)
  tok = str(cfg.get("data", {}).get("tokenizer", ""))
  if tok.startswith("hf:"):
    src = pathlib.Path(tok[3:])
    src = src / "tokenizer.json" if src.is_dir() else src
    if src.is_file():
      shutil.copyfile(src, out / "tokenizer.json")
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
  if args.from_hf:
    if not args.to:
      p.error("--from-hf needs --to WORKDIR")
    out = hf_to_workdir(args.from_hf, args.to, step=args.step or 0)
  else:
    if not args.to_hf:
      p.error("--from needs --to-hf DIR")
    out = workdir_to_hf(args.from_workdir, args.to_hf, args.family, args.step)
  print(f"wrote {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
