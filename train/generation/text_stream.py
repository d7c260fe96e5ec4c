"""Printing generated tokens as they arrive, decoding UTF-8 incrementally."""
from __future__ import annotations

import codecs
import sys


class TextStream:
    """Prints one row's tokens as they arrive, decoding UTF-8 incrementally (a character split
    across tokens is printed once complete)."""

    def __init__(self, tokenizer, out=None, skip: set[int] = frozenset()):
        self.tokenizer, self.out, self.skip = tokenizer, out or sys.stdout, set(skip)
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def __call__(self, tokens: list[int]) -> None:
        data = b"".join(self.tokenizer.decode_single_token_bytes(t) for t in tokens if t not in self.skip)
        self.out.write(self.decoder.decode(data))
        self.out.flush()

    def close(self) -> None:
        self.out.write(self.decoder.decode(b"", final=True))
        self.out.flush()
