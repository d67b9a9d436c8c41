"""Does an exported model decode the same in transformers as in tformer-generate? Greedy, N tokens, one prompt.

  python benchmarks/greedy_parity.py --hf=out/smollm2_shakespeare [--prompt="ROMEO:" --new_tokens=32 --json OUT]

Runs `tformer-generate --hf=DIR --prompt=P --max_new_tokens=N --temperature=0` (the command, as a user runs it)
and transformers' `AutoModelForCausalLM.from_pretrained(DIR)` (float32) `generate(do_sample=False,
max_new_tokens=N)` with no end-of-sequence stop (so both make exactly N tokens), on the same prompt ids.
`equal`: tformer-generate printed the prompt followed by exactly the text of transformers' N tokens.
Prints one JSON line (and writes it to --json); exit status 1 when they differ.
"""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
from typing import Any, Sequence

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
  sys.path.insert(0, str(REPO))

from absl import flags  # noqa: E402

from tformer_jax import cli_common  # noqa: E402
from tformer_jax.bench import emit  # noqa: E402

DEFAULT_PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?\n"


def define_flags(fv: flags.FlagValues) -> None:
  flags.DEFINE_string("hf", None, "the exported HF directory", flag_values=fv)
  flags.DEFINE_string("prompt", DEFAULT_PROMPT, "the prompt", flag_values=fv)
  flags.DEFINE_integer("new_tokens", 32, "tokens generated", flag_values=fv)
  flags.DEFINE_string("json", None, "also write the result to this file", flag_values=fv)


def ours(hf_dir: str, prompt: str, n: int) -> str:
  """The continuation tformer-generate prints (its stdout is the prompt, the text, a newline)."""
  exe = shutil.which("tformer-generate")
  cmd = [exe] if exe else [sys.executable, str(REPO / "scripts" / "generate.py")]
  out = subprocess.run([*cmd, f"--hf={hf_dir}", f"--prompt={prompt}", f"--max_new_tokens={n}", "--temperature=0"],
                       check=True, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}).stdout
  if not out.startswith(prompt):
    raise RuntimeError(f"tformer-generate's output does not start with the prompt: {out[:200]!r}")
  return out[len(prompt):].removesuffix("\n")


def theirs(hf_dir: str, prompt: str, n: int) -> tuple[list[int], list[int], str]:
  """(prompt ids, the N generated ids, their text) from transformers."""
  import torch  # noqa: PLC0415 (the reference side only)
  import transformers  # noqa: PLC0415

  tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
  model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
  model.generation_config.eos_token_id = None          # exactly n tokens, as tformer-generate without --stop
  ids = tok(prompt, return_tensors="pt").input_ids
  with torch.no_grad():
    gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                         pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else 0)
  new = gen[0, ids.shape[1]:].tolist()
  return ids[0].tolist(), new, tok.decode(new)


def check(hf_dir: str, prompt: str, n: int) -> dict[str, Any]:
  prompt_ids, ids, text = theirs(hf_dir, prompt, n)
  mine = ours(hf_dir, prompt, n)
  return {"bench": "greedy_parity", "hf": hf_dir, "prompt": prompt, "prompt_tokens": len(prompt_ids),
          "new_tokens": n, "transformers_tokens": len(ids), "transformers_ids": ids, "transformers_text": text,
          "tformer_generate_text": mine, "equal": mine == text and len(ids) == n}


def main(argv: Sequence[str] | None = None) -> int:
  args = cli_common.parse(argv, define_flags, doc=__doc__, prog="benchmarks/greedy_parity.py")
  if not args.hf or not (pathlib.Path(args.hf) / "config.json").is_file():
    cli_common.fail(f"--hf: {args.hf!r} is not an HF model directory (no config.json)")
  if args.new_tokens < 1 or not args.prompt:
    cli_common.fail("--new_tokens must be >= 1 and --prompt non-empty")
  res = check(args.hf, args.prompt, args.new_tokens)
  emit(res, args.json)
  return 0 if res["equal"] else 1


if __name__ == "__main__":
  sys.exit(main())
