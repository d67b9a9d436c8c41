"""A JSON array read from a text stream one chunk at a time (the large .json sources of
tformer_jax/data/sources.py): its elements in order, with bounded memory and errors naming the character."""
from __future__ import annotations

import io
import json
from typing import Any, Iterator

from tformer_jax.data.corpora import DataError

_DECODER = json.JSONDecoder()
_NUMBER_CHARS = "0123456789+-.eE"     # what may follow a number's first characters in the same number


class ArrayReader:
  """A JSON array read from a text stream one chunk at a time: `elements()` yields its values (bounded
  memory: the buffer holds the unread text of about one chunk and the value being read)."""

  CHUNK = 1 << 20

  def __init__(self, f: io.TextIOBase, where: str):
    self.f, self.where = f, where
    self.buf, self.pos, self.dropped, self.eof = "", 0, 0, False   # dropped: characters before buf

  def _more(self) -> bool:
    """Append the next chunk to the unread text; False at the end of the stream."""
    chunk = self.f.read(self.CHUNK)
    self.dropped += self.pos
    self.buf, self.pos = self.buf[self.pos:] + chunk, 0
    self.eof = not chunk
    return bool(chunk)

  def _next_char(self) -> str:
    """The next character that is not whitespace ('' at the end of the stream), not consumed."""
    while True:
      while self.pos < len(self.buf) and self.buf[self.pos] in " \t\r\n":
        self.pos += 1
      if self.pos < len(self.buf):
        return self.buf[self.pos]
      if not self._more():
        return ""

  def _value(self) -> Any:
    """The value at the read position. One that fails to parse, or a number the buffer's end may cut
    (nothing but number characters follow it in the buffer), is parsed again with the next chunk
    appended, until the stream ends."""
    self._next_char()
    while True:
      try:
        obj, end = _DECODER.raw_decode(self.buf, self.pos)
      except ValueError as e:
        if self._more():
          continue
        raise DataError(f"{self.where}: invalid JSON at character {self.dropped + self.pos}: {e}") from None
      cut = not self.eof and isinstance(obj, (int, float)) and not self.buf[end:].lstrip(_NUMBER_CHARS)
      if not cut:
        self.pos = end
        return obj
      self._more()          # then parse it again (at the end of the stream it is whole)

  def elements(self) -> Iterator[Any]:
    first = self._next_char()
    if first != "[":
      raise DataError(f"{self.where}: a large .json source must be a JSON array (starts with {first!r}); "
                      "write one record per line as .jsonl instead")
    self.pos += 1
    sep = "," if self._next_char() != "]" else "]"
    while sep == ",":
      yield self._value()
      sep = self._next_char()
      if sep == ",":
        self.pos += 1
      elif sep == "]":
        break
      elif not sep:
        raise DataError(f"{self.where}: invalid JSON at character {self.dropped + self.pos}: the file ends "
                        "inside the array")
      else:
        raise DataError(f"{self.where}: invalid JSON array at character {self.dropped + self.pos}: expected "
                        f"',' or ']', found {sep!r}")
    self.pos += 1
    if self._next_char():
      raise DataError(f"{self.where}: invalid JSON: data after the array's end, at character "
                      f"{self.dropped + self.pos}")

