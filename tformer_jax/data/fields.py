"""The text of a structured record, chosen by fields (`--field` / `--column`, the same spec): a field is a key
path `a.b.c`; several fields are joined with newlines; where a value is a list (of strings, or of objects the
rest of the path reads), its items are joined with newlines. A record that is itself a string needs no field;
a missing field is an error; a null value is empty text."""
from __future__ import annotations

from typing import Any, Sequence

from tformer_jax.data.corpora import DataError

Fields = tuple[tuple[str, ...], ...]


def parse_fields(spec: str | Sequence[str] | None) -> Fields:
  """'title,paragraphs' or ['title', 'paragraphs'] or 'meta.text' -> key paths; None -> ()."""
  if spec is None:
    return ()
  items = [spec] if isinstance(spec, str) else list(spec)
  out = []
  for item in items:
    for name in str(item).split(","):
      name = name.strip()
      if not name:
        continue
      parts = tuple(p.strip() for p in name.split("."))
      if any(not p for p in parts):
        raise DataError(f"field {name!r}: empty key in the path (fields are key paths like 'a.b.c')")
      out.append(parts)
  if not out:
    raise DataError(f"field spec {spec!r} names no field")
  return tuple(out)


def fields_text(fields: Fields) -> list[str]:
  return [".".join(f) for f in fields]


def _pieces(value: Any, path: tuple[str, ...], full: str, where: str, out: list[str]) -> None:
  if value is None:
    return
  if isinstance(value, list):
    for item in value:
      _pieces(item, path, full, where, out)
    return
  if path:
    if not isinstance(value, dict):
      raise DataError(f"{where}: field {full!r}: {'.'.join(path)!r} is read from a {type(value).__name__}, "
                      "not an object")
    if path[0] not in value:
      keys = ", ".join(map(repr, list(value)[:12])) or "none"
      raise DataError(f"{where}: no field {full!r} (missing key {path[0]!r}; the keys there: {keys})")
    _pieces(value[path[0]], path[1:], full, where, out)
    return
  if isinstance(value, str):
    out.append(value)
  elif isinstance(value, (bytes, bytearray)):
    out.append(bytes(value).decode("utf-8", errors="surrogateescape"))
  else:
    raise DataError(f"{where}: field {full!r} holds a {type(value).__name__} ({str(value)[:40]}), not text")


def record_text(record: Any, fields: Fields, where: str) -> str:
  """The text of one record: its fields' strings joined with newlines."""
  if not fields:
    if isinstance(record, str):
      return record
    keys = f" (its keys: {', '.join(map(repr, list(record)[:12]))})" if isinstance(record, dict) else ""
    raise DataError(f"{where}: the record is a {type(record).__name__}{keys}, not a string: pass the text "
                    "field(s) with --field / --column (text_field=...)")
  out: list[str] = []
  for f in fields:
    if len(f) == 1 and type(record) is dict:     # the common case, without the general walk
      value = record.get(f[0], _MISSING)
      if type(value) is str:
        out.append(value)
        continue
      if type(value) is list and all(type(v) is str for v in value):
        out += value
        continue
    _pieces(record, f, ".".join(f), where, out)
  return "\n".join(out)


_MISSING = object()
