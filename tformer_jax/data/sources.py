"""Text sources as a stream of documents, cut into work units that worker processes turn into text.

A source spec is a path, a glob pattern (`data/*.jsonl`) or a directory, read by its extension:

  .txt                a text file: one document per file (`txt_split='file'`), per non-empty line
                      ('line'), or per paragraph separated by blank lines ('paragraph')
  .jsonl .ndjson      JSON Lines: one record per non-blank line
  .json               a JSON array of records (a single object is one record)
  .parquet            a Parquet table, one record per row (needs pyarrow)
  DIR                 a Hugging Face `datasets` directory written by `save_to_disk` (it holds state.json or
                      dataset_dict.json; needs `datasets`), else every file of the extensions above under DIR,
                      recursively, in sorted order
  (.gz after any file extension: read through gzip)

The text of a record is chosen by fields (`--field` / `--column`, the same spec): a field is a key path
`a.b.c`; several fields (`title,paragraphs` or a list) are joined with newlines; where a value is a list
(of strings, or of objects the rest of the path reads), its items are joined with newlines. So
`['title', 'paragraphs']` makes a chinese-poetry poem `title\\nline 1\\nline 2...`, and `messages.content` reads
every message's content. A record that is itself a string needs no field. A missing field is an error; a
null value is empty text.

Units are deterministic (they depend only on the sources and the arguments), and each says where it starts
(`Position`), so an interrupted run can restart at any unit. The main process only reads bytes and cuts them
(except for large JSON arrays, Parquet and `datasets`, whose records it parses); workers decode, parse,
pick the fields and tokenize (`unit_documents`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import glob
import gzip
import io
import json
import logging
import os
import pathlib
import re
import zlib
from typing import Any, BinaryIO, Iterator, Sequence

from tformer_jax.data.corpora import DataError
from tformer_jax.data.fields import Fields, fields_text, parse_fields, record_text  # noqa: F401 (re-exported)
from tformer_jax.data.json_array import ArrayReader

log = logging.getLogger(__name__)

TXT_SPLITS = ("file", "line", "paragraph")
FORMATS = {".txt": "txt", ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet"}
DATASETS_MARKERS = ("state.json", "dataset_dict.json")
BLOCK_BYTES = 1 << 20           # a text/JSONL unit: about this many bytes, cut at a record boundary
JSON_WHOLE_BYTES = 32 << 20     # a JSON array up to this size is parsed whole by a worker
RECORDS_PER_UNIT = 2048         # records per unit when the main process reads records (big JSON, Parquet, datasets)

NOT_UTF8, EMPTY = -1, -2        # unit_documents' codes for a skipped record


@dataclasses.dataclass(frozen=True)
class Source:
  path: str
  format: str            # txt | jsonl | json | parquet | datasets
  bytes: int             # size on disk (a datasets directory: its files)
  mtime_ns: int
  gzip: bool = False

  def describe(self) -> dict[str, Any]:
    return {"path": self.path, "format": self.format + ("+gzip" if self.gzip else ""), "bytes": self.bytes}


@dataclasses.dataclass(frozen=True)
class Position:
  """Where a unit starts: the source's index, a byte offset (txt/jsonl) or record index (others), and the
  1-based line number at that offset (for messages)."""
  source: int = 0
  offset: int = 0
  line: int = 1

  def as_dict(self) -> dict[str, int]:
    return dataclasses.asdict(self)


@dataclasses.dataclass
class Unit:
  position: Position
  kind: str              # files | txt_block | jsonl_block | records | binary (a skipped .txt)
  path: str              # (the first file's, for files)
  data: Any = None       # bytes (blocks), records (records), [(path, format, gzip)] (files a worker reads whole)
  input_bytes: int = 0   # bytes of the source this unit covers (progress)
  gzip: bool = False


# --- resolving source specs -------------------------------------------------------------------------

def _format_of(path: pathlib.Path) -> tuple[str | None, bool]:
  suffixes = [s.lower() for s in path.suffixes]
  gz = bool(suffixes) and suffixes[-1] == ".gz"
  ext = suffixes[-2] if gz and len(suffixes) > 1 else (suffixes[-1] if suffixes and not gz else "")
  return FORMATS.get(ext), gz


def _is_datasets_dir(path: pathlib.Path) -> bool:
  return path.is_dir() and any((path / m).is_file() for m in DATASETS_MARKERS)


def _source(path: pathlib.Path, fmt: str, gz: bool = False) -> Source:
  if fmt == "datasets":
    files = [p for p in path.rglob("*") if p.is_file()]
    size = sum(p.stat().st_size for p in files)
    mtime = max((p.stat().st_mtime_ns for p in files), default=0)
  else:
    st = path.stat()
    size, mtime = st.st_size, st.st_mtime_ns
  return Source(str(path.absolute()), fmt, size, mtime, gz)


def resolve_sources(specs: Sequence[str]) -> list[Source]:
  """The files (and datasets directories) of `specs`, in order; DataError for a spec that names nothing
  readable."""
  if isinstance(specs, (str, os.PathLike)):
    specs = [specs]
  if not specs:
    raise DataError("no sources: pass at least one file, directory or glob pattern (--source)")
  out: list[Source] = []
  known = ", ".join(sorted(FORMATS))
  for spec in specs:
    spec = str(spec)
    if any(c in spec for c in "*?["):
      paths = sorted(pathlib.Path(p) for p in glob.glob(os.path.expanduser(spec), recursive=True))
      paths = [p for p in paths if p.is_file() or _is_datasets_dir(p)]
      if not paths:
        raise DataError(f"source {spec}: the pattern matches no files")
      for p in paths:
        fmt, gz = ("datasets", False) if p.is_dir() else _format_of(p)
        if fmt is None:
          raise DataError(f"source {p} (from {spec}): unknown format; expected a file ending in {known} "
                          "(optionally .gz) or a datasets directory")
        out.append(_source(p, fmt, gz))
      continue
    path = pathlib.Path(spec).expanduser()
    if not path.exists():
      raise DataError(f"source {spec}: no such file or directory ({path.absolute()})")
    if _is_datasets_dir(path):
      out.append(_source(path, "datasets"))
    elif path.is_dir():
      files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")
                     and _format_of(p)[0] is not None)
      if not files:
        raise DataError(f"source {spec}: the directory has no {known} files (searched recursively)")
      formats = {_format_of(p)[0] for p in files}
      if len(formats) > 1:
        log.info("source %s: %d files of formats %s", spec, len(files), sorted(formats))
      out += [_source(p, *_format_of(p)) for p in files]
    else:
      fmt, gz = _format_of(path)
      if fmt is None:
        raise DataError(f"source {spec}: unknown format {''.join(path.suffixes) or '(no extension)'}; "
                        f"expected {known} (optionally .gz) or a datasets directory")
      out.append(_source(path, fmt, gz))
  return out


# --- units (main process) ---------------------------------------------------------------------------

def _open(path: str, gz: bool) -> BinaryIO:
  return gzip.open(path, "rb") if gz else open(path, "rb")


@contextlib.contextmanager
def _gzip_intact(path: str) -> Iterator[None]:
  """A truncated or damaged .gz read inside the block is a DataError naming the file (was gzip's traceback)."""
  try:
    yield
  except (EOFError, gzip.BadGzipFile, zlib.error) as e:
    raise DataError(f"{path}: the gzip file is truncated or damaged ({e}); download or compress it again") from None


def _cut(buf: bytes, paragraph: bool) -> int:
  """The end of the last complete record in buf (after its separator), 0 if none."""
  if paragraph:
    i = buf.rfind(b"\n\n")
    return i + 2 if i >= 0 else 0
  return buf.rfind(b"\n") + 1


BINARY_SNIFF_BYTES = 8192       # a .txt whose first bytes hold a NUL is binary, not text (as git and grep decide)


def is_binary(data: bytes) -> bool:
  """Text never holds NUL bytes; binary files (images, archives, UTF-16) almost always do."""
  return b"\x00" in data


def _blocks(src: Source, index: int, start: Position, kind: str, paragraph: bool,
            block_bytes: int) -> Iterator[Unit]:
  offset, line = start.offset, start.line
  if kind == "txt_block" and not offset:
    with _open(src.path, src.gzip) as f, _gzip_intact(src.path):
      if is_binary(f.read(BINARY_SNIFF_BYTES)):
        yield Unit(Position(index), "binary", src.path, None, src.bytes, src.gzip)   # one skipped document
        return
  with _open(src.path, src.gzip) as f, _gzip_intact(src.path):
    if offset:
      f.seek(offset)
    buf = b""
    while True:
      chunk = f.read(block_bytes)
      buf += chunk
      if not chunk:
        if buf:
          yield Unit(Position(index, offset, line), kind, src.path, buf, len(buf), src.gzip)
        return
      cut = _cut(buf, paragraph)
      if cut <= 0:
        continue                      # one record longer than a block: read on
      block, buf = buf[:cut], buf[cut:]
      yield Unit(Position(index, offset, line), kind, src.path, block, len(block), src.gzip)
      offset += cut
      line += block.count(b"\n")


def _json_array(src: Source) -> Iterator[Any]:
  """The elements of a large JSON array, parsed incrementally (bounded memory)."""
  with _open(src.path, src.gzip) as raw, _gzip_intact(src.path):
    yield from ArrayReader(io.TextIOWrapper(raw, encoding="utf-8", errors="surrogateescape"), src.path).elements()


def _records_units(src: Source, index: int, start: Position, records: Iterator[Any], per_unit: int
                   ) -> Iterator[Unit]:
  """Units of `per_unit` records from record `start.offset` on (the records before it are read and dropped)."""
  n, first, batch = 0, start.offset, []
  for rec in records:
    n += 1
    if n <= start.offset:
      continue
    batch.append(rec)
    if len(batch) >= per_unit:
      yield Unit(Position(index, first), "records", src.path, batch, 0, src.gzip)
      first, batch = n, []
  if batch:
    yield Unit(Position(index, first), "records", src.path, batch, 0, src.gzip)


def _parquet_records(src: Source, fields: Fields) -> Iterator[Any]:
  try:
    import pyarrow.parquet as pq  # noqa: PLC0415 (optional dependency)
  except ImportError:
    raise DataError(f"{src.path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
  pf = pq.ParquetFile(src.path)
  names = pf.schema_arrow.names
  columns = _top_columns(src, fields, names)
  for batch in pf.iter_batches(batch_size=RECORDS_PER_UNIT, columns=columns):
    yield from batch.to_pylist()


def _top_columns(src: Source, fields: Fields, names: Sequence[str]) -> list[str]:
  if not fields:
    if len(names) == 1:
      return list(names)
    raise DataError(f"{src.path}: pass the text column(s) with --column (its columns: {', '.join(names)})")
  columns = list(dict.fromkeys(f[0] for f in fields))
  for c in columns:
    if c not in names:
      raise DataError(f"{src.path}: no column {c!r} (its columns: {', '.join(names)})")
  return columns


def _datasets_records(src: Source, fields: Fields, start: int) -> Iterator[Any]:
  try:
    import datasets  # noqa: PLC0415 (optional dependency, slow import)
  except ImportError:
    raise DataError(f"{src.path}: reading a datasets directory needs `datasets` (pip install datasets)") from None
  ds = datasets.load_from_disk(src.path)
  parts = [ds[k] for k in sorted(ds)] if isinstance(ds, datasets.DatasetDict) else [ds]
  skip = start
  for part in parts:
    columns = _top_columns(src, fields, part.column_names)
    part = part.select_columns(columns)
    for i in range(min(skip, len(part)), len(part), RECORDS_PER_UNIT):
      batch = part[i:i + RECORDS_PER_UNIT]
      yield from (dict(zip(batch, values)) for values in zip(*batch.values()))
    skip = max(0, skip - len(part))


def _skipped_records(records: Iterator[Any], n: int) -> Iterator[Any]:
  """Placeholders for `n` records already skipped by the reader, then the records."""
  yield from (None for _ in range(n))
  yield from records


def check_fields(sources: Sequence[Source], fields: Fields) -> None:
  """Fail early on structured sources without fields; text sources with fields."""
  for src in sources:
    if src.format == "txt" and fields:
      raise DataError(f"{src.path}: a .txt source has no fields; drop --field/--column or convert it to .jsonl")


def _whole_file(src: Source, txt_split: str) -> bool:
  """Read whole by a worker: a .txt in file mode, a JSON array small enough to parse at once."""
  return ((src.format == "txt" and txt_split == "file")
          or (src.format == "json" and src.bytes <= JSON_WHOLE_BYTES and not src.gzip))


def iter_units(sources: Sequence[Source], fields: Fields, *, txt_split: str = "file",
               start: Position = Position(), block_bytes: int = BLOCK_BYTES) -> Iterator[Unit]:
  """The work units of all sources in order, from `start` (a unit's position) on. Consecutive whole files
  are grouped into one unit up to `block_bytes` (so many small files cost few tasks)."""
  if txt_split not in TXT_SPLITS:
    raise DataError(f"txt_split must be one of {', '.join(TXT_SPLITS)}, got {txt_split!r}")
  group: list[int] = []

  def flush() -> Iterator[Unit]:
    if group:
      files = [(sources[i].path, sources[i].format, sources[i].gzip) for i in group]
      yield Unit(Position(group[0]), "files", files[0][0], files, sum(sources[i].bytes for i in group))
      group.clear()

  for index in range(start.source, len(sources)):
    src = sources[index]
    pos = start if index == start.source else Position(index)
    if _whole_file(src, txt_split):
      if pos.offset == 0:
        group.append(index)
        if sum(sources[i].bytes for i in group) >= block_bytes or len(group) >= 1024:
          yield from flush()
      continue
    yield from flush()
    if src.format in ("txt", "jsonl"):
      kind = "jsonl_block" if src.format == "jsonl" else "txt_block"
      yield from _blocks(src, index, pos, kind, src.format == "txt" and txt_split == "paragraph", block_bytes)
    elif src.format == "json":
      yield from _records_units(src, index, pos, _json_array(src), RECORDS_PER_UNIT)
    elif src.format == "parquet":
      yield from _records_units(src, index, pos, _parquet_records(src, fields), RECORDS_PER_UNIT)
    elif src.format == "datasets":
      records = _skipped_records(_datasets_records(src, fields, pos.offset), pos.offset)
      yield from _records_units(src, index, pos, records, RECORDS_PER_UNIT)
    else:
      raise DataError(f"{src.path}: unknown source format {src.format!r}")
  yield from flush()


# --- documents of a unit (worker process) -----------------------------------------------------------

_PARAGRAPH = re.compile(rb"\n[ \t\r]*\n")


def _doc_or_code(text: str | bytes, where: str, on_bad_utf8: str) -> str | int:
  """The document's text, or NOT_UTF8 / EMPTY (binary text counts as not UTF-8)."""
  if isinstance(text, bytes):
    if is_binary(text):
      return _bad_utf8(where, on_bad_utf8, "a binary file: it holds NUL bytes", binary=True)
    try:
      text = text.decode("utf-8")
    except UnicodeDecodeError as e:
      return _bad_utf8(where, on_bad_utf8, f"invalid byte {text[e.start:e.start + 1]!r} at byte {e.start}")
  else:
    try:
      text.encode("utf-8")
    except UnicodeEncodeError as e:
      return _bad_utf8(where, on_bad_utf8, f"not UTF-8 near character {e.start}")
  return text if text.strip() else EMPTY


def _bad_utf8(where: str, on_bad_utf8: str, detail: str, binary: bool = False) -> int:
  if on_bad_utf8 == "fail":
    what = "not text" if binary else "not valid UTF-8"
    raise DataError(f"{where}: the document is {what} ({detail}); re-encode the source to UTF-8 or "
                    "pass --on_bad_utf8=skip to skip such documents (they are counted in the manifest)")
  return NOT_UTF8


def _read(path: str, gz: bool) -> bytes:
  with _open(path, gz) as f, _gzip_intact(path):
    return f.read()


def _loads(text: str, where: str) -> Any:
  try:
    return json.loads(text)
  except ValueError as e:
    raise DataError(f"{where}: invalid JSON: {e}") from None


def _files_documents(unit: Unit, fields: Fields, on_bad_utf8: str) -> list[str | int]:
  """Whole files: a .txt is one document, a JSON file its record(s)."""
  out: list[str | int] = []
  for file, fmt, gz in unit.data:
    data = _read(file, gz)
    if fmt == "txt":
      out.append(_doc_or_code(data, file, on_bad_utf8))
      continue
    value = _loads(data.decode("utf-8", errors="surrogateescape"), file)
    records = value if isinstance(value, list) else [value]
    out += [_doc_or_code(record_text(r, fields, f"{file}: record {i}"), f"{file}: record {i}", on_bad_utf8)
            for i, r in enumerate(records)]
  return out


def _txt_documents(unit: Unit, on_bad_utf8: str, txt_split: str) -> list[str | int]:
  """A block of a .txt file: its non-empty lines, or its paragraphs, each named by its first line."""
  data: bytes = unit.data
  out: list[str | int] = []
  if txt_split == "line":
    for i, line in enumerate(data.split(b"\n")):
      line = line.rstrip(b"\r")
      if line.strip():
        out.append(_doc_or_code(line, f"{unit.path}:{unit.position.line + i}", on_bad_utf8))
    return out
  line, pos = unit.position.line, 0
  for m in [*_PARAGRAPH.finditer(data), None]:
    end = m.start() if m else len(data)
    para = data[pos:end]
    if para.strip():
      first = line + para[:len(para) - len(para.lstrip(b"\r\n"))].count(b"\n")
      out.append(_doc_or_code(para.strip(b"\r\n"), f"{unit.path}:{first}", on_bad_utf8))
    if m:
      line += data.count(b"\n", pos, m.end())
      pos = m.end()
  return out


def _jsonl_documents(unit: Unit, fields: Fields, on_bad_utf8: str) -> list[str | int]:
  out: list[str | int] = []
  for i, line in enumerate(unit.data.split(b"\n")):
    if not line.strip():
      continue
    where = f"{unit.path}:{unit.position.line + i}"
    record = _loads(line.decode("utf-8", errors="surrogateescape"), where)
    out.append(_doc_or_code(record_text(record, fields, where), where, on_bad_utf8))
  return out


def unit_documents(unit: Unit, fields: Fields, on_bad_utf8: str, txt_split: str) -> list[str | int]:
  """Each record of the unit in order: its document text, or NOT_UTF8 / EMPTY for a skipped one."""
  if unit.kind == "files":
    return _files_documents(unit, fields, on_bad_utf8)
  if unit.kind == "binary":
    return [_bad_utf8(unit.path, on_bad_utf8, "a binary file: it holds NUL bytes", binary=True)]
  if unit.kind == "txt_block":
    return _txt_documents(unit, on_bad_utf8, txt_split)
  if unit.kind == "jsonl_block":
    return _jsonl_documents(unit, fields, on_bad_utf8)
  if unit.kind == "records":
    first = unit.position.offset
    return [_doc_or_code(record_text(r, fields, f"{unit.path}: record {first + i}"),
                         f"{unit.path}: record {first + i}", on_bad_utf8) for i, r in enumerate(unit.data)]
  raise DataError(f"unknown unit kind {unit.kind!r}")
