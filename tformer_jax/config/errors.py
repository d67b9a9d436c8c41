"""ConfigError and the one-line '<field>: <rule>' messages, with the closest valid names for a misspelling."""
from __future__ import annotations

import difflib
import pathlib
from typing import Any, Iterable, Mapping, Sequence


class ConfigError(ValueError):
  """An invalid configuration; the message names the field and the rule it breaks."""


def _fail(field: str, rule: str) -> None:
  raise ConfigError(f"{field}: {rule}")


def _either(names: Sequence[str]) -> str:
  return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def _closest(name: str, known: Sequence[str], n: int = 3) -> list[str]:
  """The names of `known` closest to `name`: difflib ratio >= 0.6 and within 0.1 of the best; else
  the names that hold `name` as a word ('lr' -> 'peak_lr')."""
  def ratio(k: str) -> float:
    return difflib.SequenceMatcher(None, name.lower(), k.lower()).ratio()
  scored = sorted(((ratio(k), k) for k in known), key=lambda x: -x[0])
  best = scored[0][0] if scored else 0.0
  close = [k for r, k in scored[:n] if r >= 0.6 and r >= best - 0.1]
  return close or [k for k in known if name.lower() in k.lower().split("_")][:n]


def unknown_field_error(path: str, known: Iterable[Any]) -> ConfigError:
  """`ConfigError('<path>: unknown field; did you mean <closest>?')` for a field that its section
  (whose fields are `known`) does not have; without a close name, the section's fields."""
  parent, _, name = path.rpartition(".")
  known = sorted(str(k) for k in known)
  close = _closest(name, known)
  if close:
    hint = "did you mean " + _either([f"{parent}.{k}" if parent else k for k in close]) + "?"
  else:
    hint = f"the fields of {parent or 'the config'} are: {', '.join(known)}"
  return ConfigError(f"{path}: unknown field; {hint}")


def _check_choice(field: str, value: Any, allowed: Sequence[str]) -> None:
  if value not in allowed:
    close = _closest(str(value), list(allowed), n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    _fail(field, f"unknown value {value!r}; {hint}expected one of {tuple(allowed)}")


def _check_spec(field: str, value: str, names: Sequence[str], prefixes: Mapping[str, str]) -> str:
  """A corpus/tokenizer spec: one of `names`, or a key of `prefixes` ('text:' -> 'text:PATH', its
  spelled-out form) with something after it. Returns the text after the prefix ('' for a name)."""
  if value in names:
    return ""
  for prefix, shown in prefixes.items():
    if value.startswith(prefix):
      if not value[len(prefix):].strip():
        _fail(field, f"{value!r} needs something after {prefix!r}: {shown}")
      return value[len(prefix):]
  heads = list(names) + [p.rstrip(":") for p in prefixes]
  close = _closest(value.split(":")[0].strip(), heads, n=1)
  hint = ""
  if close:
    hint = f"did you mean {close[0]!r}? " if close[0] in names else f"did you mean '{close[0]}:...'? "
  _fail(field, f"unknown value {value!r}; {hint}expected {_either(list(names) + list(prefixes.values()))}")
  return ""


def _check_path(field: str, spec: str, path: str, what: str) -> None:
  p = pathlib.Path(path).expanduser()
  if not p.exists():
    _fail(field, f"{spec}: no such {what} ({p.resolve()})")
