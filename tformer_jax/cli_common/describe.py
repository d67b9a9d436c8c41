"""`--print_config`: every config field with its value and its description, the descriptions read from
the comments beside the fields in tformer_jax/config/schema.py and an enum field's values from its tuple."""
from __future__ import annotations

import inspect
import io
import re
import tokenize
from typing import Any, Sequence

import ml_collections

from tformer_jax import config as config_lib

_SECTION_CLASSES = {"ModelConfig": "model.", "RopeScaling": "model.rope_scaling.", "MoEConfig": "model.moe.",
                    "MLAConfig": "model.mla."}
_FIELD = re.compile(r"^\s+(\w+)(?:\s*:\s*[^=]+)?\s*=")
_SECTION = re.compile(r"^\s+c\.(\w+)\s*=\s*ml_collections\.ConfigDict")

_NESTED = re.compile(r"^\s+(\w+)\s*=\s*ml_collections\.ConfigDict")


def _nested(lines: list[str], row: int) -> str:
  """'lora.' for a field inside `lora=ml_collections.ConfigDict(dict(...))` within a section, else ''."""
  indent = len(lines[row - 1]) - len(lines[row - 1].lstrip())
  for back in range(row - 2, -1, -1):
    above = lines[back]
    if above.strip() and not above.strip().startswith("#") and len(above) - len(above.lstrip()) < indent:
      m = _NESTED.match(above)
      return m.group(1) + "." if m else ""
  return ""


def field_docs() -> dict[str, str]:
  """{'model.num_kv_heads': '0 = num_heads (MHA); 1 = MQA; ...', ...}: the comments beside the fields in
  tformer_jax/config/schema.py (the dataclasses, default_config and its _<name>_section functions), a
  comment-only line continuing the field above it; an enum field's values are listed from its tuple
  (`enum_fields`). The schema's one source of descriptions."""
  source = inspect.getsource(config_lib.schema)
  docs: dict[str, str] = {}
  prefix, last, last_line = None, None, -1
  lines = source.splitlines()
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    if tok.type != tokenize.COMMENT:
      continue
    row = tok.start[0]
    text = tok.string.lstrip("#").strip()
    line = lines[row - 1]
    if line.strip().startswith("#"):
      if last is not None and row == last_line + 1:
        docs[last] += " " + text
        last_line = row
      continue
    m = _FIELD.match(line)
    # the section a field belongs to: the nearest class or `c.<name> = ConfigDict` above it
    for back in range(row - 1, -1, -1):
      above = lines[back]
      cls = re.match(r"^class (\w+)", above)
      sec = _SECTION.match(above) or re.match(r"^def _(\w+)_section\(", above)   # or a section's own function
      if cls or sec or above.startswith("def "):
        prefix = _SECTION_CLASSES.get(cls.group(1)) if cls else (sec.group(1) + "." if sec else None)
        break
    if m and prefix:
      last, last_line = prefix + _nested(lines, row) + m.group(1), row
      docs[last] = text
    else:
      last = None
  for key, allowed in enum_fields().items():
    docs[key] = enum_doc(docs.get(key, ""), allowed)
  return docs


def enum_fields() -> dict[str, tuple[str, ...]]:
  """{field: its allowed values}: the config's own tuples (config/enums.py), which `field_docs` lists."""
  c = config_lib
  model = dict(attention=c.ATTENTIONS, activation=c.ACTIVATIONS, norm=c.NORMS, norm_position=c.NORM_POSITIONS,
               position=c.POSITIONS, rope_layout=c.ROPE_LAYOUTS, remat=c.REMAT_POLICIES, dtype=c.DTYPES,
               param_dtype=c.DTYPES, **{"rope_scaling.type": c.ROPE_SCALINGS, "moe.dispatch": c.MOE_DISPATCH})
  other = {"data.sampling": c.SAMPLINGS, "data.packing": c.PACKINGS, "optim.name": c.OPTIMIZERS,
           "optim.schedule": c.SCHEDULES, "train.precision": c.PRECISIONS, "mesh.parallelism": c.PARALLELISMS,
           "mesh.context_strategy": c.CONTEXT_STRATEGIES, "runtime.backend": c.RUNTIME_BACKENDS,
           "runtime.attention": c.RUNTIME_ATTENTION, "runtime.cpu_kernels": c.AUTO_ON_OFF,
           "runtime.cpu_matmul": c.RUNTIME_CPU_MATMUL, "runtime.cpu_blas": c.RUNTIME_CPU_BLAS,
           "runtime.decode_layout": c.DECODE_LAYOUTS, "runtime.moe_exchange": c.RUNTIME_MOE_EXCHANGE,
           "runtime.moe_gmm": c.RUNTIME_MOE_GMM}
  return {**{f"model.{k}": v for k, v in model.items()}, **other}


_OPTION = re.compile(r"\s*([\w.+-]+)(?:\s*\(((?:[^()]|\([^()]*\))*)\))?")


def enum_doc(comment: str, allowed: Sequence[str]) -> str:
  """A field's description with its values listed from `allowed` (so it cannot name a value that does
  not exist): a leading 'a (note) | b | c' in the comment gives the notes, the rest is kept."""
  options, pos = [], 0
  while (m := _OPTION.match(comment, pos)) is not None:
    options.append((m.group(1), m.group(2)))
    pos = m.end()
    if not comment[pos:].lstrip().startswith("|"):
      break
    pos = comment.index("|", pos) + 1
  if len(options) < 2:                      # no list in the comment: the values, then the comment
    return " | ".join(allowed) + (f": {comment}" if comment else "")
  notes = {name: note for name, note in options if note}
  head = " | ".join(f"{v} ({notes[v]})" if v in notes else v for v in allowed)
  return head + comment[pos:]


def describe_config(cfg: ml_collections.ConfigDict) -> str:
  """Every field of `cfg` with its value and its description (`field_docs`), one line each."""
  docs = field_docs()
  rows: list[tuple[str, str]] = []

  def walk(node: Any, prefix: str) -> None:
    for key in sorted(node.keys()) if prefix else list(node.keys()):
      value = node[key]
      if isinstance(value, ml_collections.ConfigDict):
        walk(value, f"{prefix}{key}.")
      else:
        rows.append((f"{prefix}{key}", repr(value)))

  walk(cfg, "")
  width = min(max(len(f"{k} = {v}") for k, v in rows), 60)
  out = []
  for key, value in rows:
    text = f"{key} = {value}"
    doc = docs.get(key, "")
    out.append(f"{text:<{width}}  # {doc}" if doc else text)
  return "\n".join(out)
