"""Text data files checked before a reader guesses: every byte UTF-8, or the place that is not."""

from __future__ import annotations

import codecs
from pathlib import Path

from streamrl.errors import ConfigError

__all__ = ["check_utf8"]


def check_utf8(path: Path, chunk_bytes: int = 1 << 20) -> None:
    """Raise ``ConfigError`` naming the line and byte offset of the first byte of ``path`` that
    is not UTF-8 (the readers would fail with a decoder's traceback, or guess)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, line = 0, 1
    with path.open("rb") as f:
        while chunk := f.read(chunk_bytes):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as err:
                at = offset + err.start
                line += chunk.count(b"\n", 0, err.start)
                raise ConfigError(
                    f"{path}:{line}: byte 0x{chunk[err.start]:02x} at offset {at} is not UTF-8; "
                    "save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8 in > out)."
                ) from None
            offset += len(chunk)
            line += chunk.count(b"\n")
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise ConfigError(f"{path}:{line}: the file ends inside a UTF-8 character.") from None
