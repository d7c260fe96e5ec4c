"""What `torchlyra prepare` reads, and in which order: text files, JSONL (.jsonl, .jsonl.gz) with a
configurable text field, Parquet, directories and globs of them, or the bundled corpus. Sources are
cut into work units (a few MiB each) that worker processes read independently; the documents of
the units, taken in unit order, are the source order.

A document is a whole text file, one JSONL line, or one Parquet row (never cut here: only the
packer splits a long document). Bad input: invalid UTF-8 is replaced (U+FFFD) and counted, empty
documents are skipped and counted, a JSONL line that is not JSON or lacks the text field is an
error naming the file and the line.

Chat data (`prepare --chat`): a document is one conversation, the `messages` list of a JSONL line
or Parquet row (conversations.parse_record). A malformed record is skipped, counted and named
(file and line, or row), unless `strict`: then it is an error.

Preference data (`prepare --preferences`): a document is one pair, a record with `prompt`,
`chosen` and `rejected` (preferences.parse_pair), malformed records handled as for chat.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import io
import itertools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from train.data import conversations, corpus, preferences
from formats.errors import UserError

FORMATS = {"text": (".txt", ".text", ".md"), "jsonl": (".jsonl", ".jsonl.gz", ".ndjson"), "parquet": (".parquet",)}
UNIT_BYTES = 4 << 20  # a work unit: enough text to amortize a task, little enough to bound memory


@dataclass(frozen=True)
class Source:
    """One input file (the bundled corpus: one extracted play)."""
    path: str          # the file to open
    name: str          # how documents are named (val hashing, messages): the path, or the play
    format: str        # text | jsonl | parquet
    size: int
    val: bool = False  # from --val-input: every document goes to the validation split
    stamp: str = ""    # what identifies the content ("" = its modification time)


@dataclass(frozen=True)
class Unit:
    """A slice of the input that one worker reads: several small text files, a byte range of a
    JSONL file (whole lines), lines of a .jsonl.gz (decompressed by the main process, which alone
    can read the stream in order), or a Parquet row group."""
    index: int
    sources: tuple[Source, ...]
    start: int = 0     # JSONL: first (decompressed) byte; Parquet: row group; else 0
    end: int = -1      # JSONL: end byte (exclusive); else -1
    nbytes: int = 0    # input bytes it stands for (progress)
    payload: bytes | None = None  # .jsonl.gz: the lines themselves
    first_line: int = 1           # .jsonl.gz: number of the payload's first line


# ---- finding sources --------------------------------------------------------------------------
def _format_of(path: str, forced: str | None) -> str | None:
    if forced:
        return forced
    lower = path.lower()
    for fmt, suffixes in FORMATS.items():
        if lower.endswith(suffixes):
            return fmt
    return None


def _walk(root: Path) -> list[Path]:
    found = []
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [Path(dirpath) / f for f in sorted(files) if not f.startswith(".")]
    return found


def _expand(arg: str, forced: str | None, flag: str) -> list[tuple[Path, str]]:
    """(path, format) of every input file that one --input argument names, in order."""
    if os.path.isdir(arg):
        paths, explicit = _walk(Path(arg)), False
    elif os.path.isfile(arg):
        paths, explicit = [Path(arg)], True
    else:
        matches = sorted(glob.glob(arg, recursive=True))
        if not matches:
            raise UserError(f"{flag} {arg}: no such file, directory or glob match")
        return [item for m in matches for item in _expand(m, forced, flag)]
    out = []
    for p in paths:
        fmt = _format_of(str(p), forced)
        if fmt is None and explicit:
            known = ", ".join(s for suffixes in FORMATS.values() for s in suffixes)
            raise UserError(f"{flag} {p}: unknown format (expected a name ending in {known}, or pass --format)")
        if fmt is not None:
            out.append((p, fmt))
    if not out:
        raise UserError(f"{flag} {arg}: expected .txt, .jsonl, .jsonl.gz or .parquet files, found none")
    return out


def find_sources(inputs: list[str] | None, val_inputs: list[str] | None = None,
                 forced_format: str | None = None) -> list[Source]:
    """The input files in source order (each argument in turn, directories walked in name order),
    or the bundled corpus when inputs is empty. A file named twice is read once."""
    if not inputs:
        if val_inputs:
            raise UserError("--val-input needs --input (the bundled corpus splits by --val-fraction)")
        return [Source(str(path), name, "text", path.stat().st_size, stamp=corpus.SOURCE_SHA256)
                for name, path in corpus.extract_plays()]
    seen: dict[str, str] = {}
    sources = []
    for flag, args, val in (("--input", inputs, False), ("--val-input", val_inputs or [], True)):
        for arg in args:
            for path, fmt in _expand(arg, forced_format, flag):
                real = os.path.realpath(path)
                if real in seen:
                    if seen[real] != flag:
                        raise UserError(f"{path}: named by both --input and --val-input")
                    continue
                seen[real] = flag
                sources.append(Source(str(path), path.as_posix(), fmt, path.stat().st_size, val))
    return sources


def fingerprint(sources: list[Source]) -> str:
    """Names, sizes and modification times of the inputs (the pinned hash of its source archive for
    the bundled corpus): a changed input makes an earlier or interrupted preparation stale."""
    h = hashlib.sha256()
    for s in sources:
        stamp = s.stamp or os.stat(s.path).st_mtime_ns
        h.update(f"{s.name}\0{s.format}\0{s.size}\0{stamp}\0{s.val}\n".encode())
    return h.hexdigest()


# ---- cutting sources into units ---------------------------------------------------------------
def _jsonl_ranges(path: str, size: int) -> list[tuple[int, int]]:
    """Byte ranges of about UNIT_BYTES that end just after a newline."""
    ranges, start = [], 0
    with open(path, "rb") as f:
        while start < size:
            f.seek(min(start + UNIT_BYTES, size))
            f.readline()  # to the end of the line that straddles the cut
            end = min(f.tell(), size) if start + UNIT_BYTES < size else size
            ranges.append((start, end))
            start = end
    return ranges


def _parquet_row_groups(path: str, text_field: str) -> list[int]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        meta = pf.metadata
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError for a file that is not Parquet
        raise UserError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from None
    names = pf.schema_arrow.names  # top-level columns (a messages list is one, with nested leaves)
    if text_field not in names:
        raise UserError(f"{path}: no column {text_field!r} (--text-field, or --messages-field with --chat); "
                        f"columns: {', '.join(names)}")
    return [meta.row_group(i).total_byte_size for i in range(meta.num_row_groups)]


def check_sources(sources: list[Source], text_field: str, chat: bool = False, pairs: bool = False) -> None:
    """What can be checked before any work: every Parquet file opens and has the text column;
    chat data comes as JSONL or Parquet."""
    for s in sources:
        if chat and s.format == "text":
            raise UserError(f"{s.name}: --chat reads conversations from JSONL (.jsonl, .jsonl.gz) or Parquet, "
                            f"found a text file")
        if s.format == "parquet":
            for name in preferences.FIELDS if pairs else (text_field,):
                _parquet_row_groups(s.path, name)


def _gz_units(source: Source, index) -> Iterator[Unit]:
    """Lines of a .jsonl.gz in payloads of about UNIT_BYTES (decompressed), read as a stream."""
    try:
        with open(source.path, "rb") as raw, gzip.GzipFile(fileobj=raw) as f:
            lines, size, start, line, consumed = [], 0, 0, 1, 0
            for text in f:
                lines.append(text)
                size += len(text)
                if size >= UNIT_BYTES:
                    yield Unit(next(index), (source,), start, nbytes=raw.tell() - consumed,
                               payload=b"".join(lines), first_line=line)
                    consumed, start, line, lines, size = raw.tell(), start + size, line + len(lines), [], 0
            if lines:
                yield Unit(next(index), (source,), start, nbytes=source.size - consumed,
                           payload=b"".join(lines), first_line=line)
    except (OSError, EOFError) as e:  # gzip.BadGzipFile is an OSError
        raise UserError(f"{source.name}: cannot read ({type(e).__name__}: {e})") from None


def iter_units(sources: list[Source], text_field: str) -> Iterator[Unit]:
    """The work units of the sources, numbered in order, made as they are asked for (a .jsonl.gz
    is decompressed here, so only the units in flight are ever in memory)."""
    index = itertools.count()
    pending: list[Source] = []  # small text files gathered into one unit
    for s in sources:
        if s.format == "text":
            pending.append(s)
            if sum(p.size for p in pending) >= UNIT_BYTES // 4:
                yield Unit(next(index), tuple(pending), nbytes=sum(p.size for p in pending))
                pending = []
            continue
        if pending:
            yield Unit(next(index), tuple(pending), nbytes=sum(p.size for p in pending))
            pending = []
        if s.format == "jsonl" and s.path.lower().endswith(".gz"):
            yield from _gz_units(s, index)
        elif s.format == "jsonl":
            for start, end in _jsonl_ranges(s.path, s.size):
                yield Unit(next(index), (s,), start, end, end - start)
        else:  # parquet
            sizes = _parquet_row_groups(s.path, text_field)
            for i, size in enumerate(sizes):
                yield Unit(next(index), (s,), i, -1, s.size * size // max(1, sum(sizes)))
    if pending:
        yield Unit(next(index), tuple(pending), nbytes=sum(p.size for p in pending))


# ---- reading a unit ---------------------------------------------------------------------------
@dataclass
class ReadStats:
    documents: int = 0      # kept
    empty: int = 0          # skipped: empty or whitespace only
    replaced: int = 0       # invalid UTF-8 sequences (or lone surrogates) replaced by U+FFFD
    replaced_docs: int = 0  # documents holding at least one replacement
    bytes: int = 0          # UTF-8 bytes of the kept documents
    malformed: int = 0      # chat: records skipped as malformed

    def add(self, other: "ReadStats") -> None:
        for k in ("documents", "empty", "replaced", "replaced_docs", "bytes", "malformed"):
            setattr(self, k, getattr(self, k) + getattr(other, k))


@dataclass
class Documents:
    """The kept documents of one unit: ids (stable names, for the validation split), texts, and
    whether each comes from a --val-input source."""
    ids: list[str] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    val: list[bool] = field(default_factory=list)
    nbytes: list[int] = field(default_factory=list)  # UTF-8 bytes of each document
    stats: ReadStats = field(default_factory=ReadStats)
    conversations: list[list[dict]] = field(default_factory=list)  # chat: each document's messages
    malformed: list[str] = field(default_factory=list)  # chat: "where: why" of each skipped record

    def skip_malformed(self, where: str, why: str, strict: bool) -> None:
        if strict:
            raise UserError(f"{where}: malformed conversation: {why} (--strict stops at the first)")
        self.malformed.append(f"{where}: {why}")
        self.stats.malformed += 1

    def add_conversation(self, doc_id: str, record, val: bool, where: Callable[[], str], messages_field: str,
                         strict: bool) -> None:
        """Check one chat record; keep its messages, or skip and name it (strict: raise)."""
        try:
            messages = conversations.parse_record(record, messages_field)
        except conversations.MalformedRecord as e:
            self.skip_malformed(where(), str(e), strict)
            return
        self._keep_record(doc_id, conversations.text_of(messages), val, messages)

    def add_pair(self, doc_id: str, record, val: bool, where: Callable[[], str], strict: bool) -> None:
        """Check one preference record; keep its (prompt, chosen, rejected), or skip and name it."""
        try:
            pair = preferences.parse_pair(record)
        except conversations.MalformedRecord as e:
            self.skip_malformed(where(), str(e), strict)
            return
        self._keep_record(doc_id, preferences.text_of(pair), val, pair)

    def _keep_record(self, doc_id: str, text: str, val: bool, record) -> None:
        """Keep one checked chat or preference record (its text counts toward the statistics)."""
        self.ids.append(doc_id)
        self.texts.append(text)
        self.val.append(val)
        self.nbytes.append(len(text.encode("utf-8", "surrogatepass")))
        self.conversations.append(record)
        self.stats.documents += 1
        self.stats.bytes += self.nbytes[-1]

    def add(self, doc_id: str, text: str, val: bool, replaced: int = 0) -> None:
        if not text.strip():
            self.stats.empty += 1
            return
        try:
            nbytes = len(text.encode("utf-8"))
        except UnicodeEncodeError:  # lone surrogates, e.g. from a JSON "\udc80" escape
            lone = sum(1 for c in text if "\ud800" <= c <= "\udfff")
            text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
            replaced, nbytes = replaced + lone, len(text.encode("utf-8"))
        self.ids.append(doc_id)
        self.texts.append(text)
        self.val.append(val)
        self.nbytes.append(nbytes)
        self.stats.documents += 1
        self.stats.bytes += nbytes
        if replaced:
            self.stats.replaced += replaced
            self.stats.replaced_docs += 1


def decode(data: bytes) -> tuple[str, int]:
    """UTF-8 text and the number of invalid sequences replaced by U+FFFD."""
    try:
        return data.decode("utf-8"), 0
    except UnicodeDecodeError:
        text = data.decode("utf-8", errors="replace")
        return text, text.count("\ufffd") - data.count("\ufffd".encode())  # minus U+FFFD already there


def _line_number(path: str, start: int) -> int:
    """1-based number of the line that begins at byte `start` (computed only to report an error)."""
    with open(path, "rb") as f:
        return f.read(start).count(b"\n") + 1


def _jsonl_text(line: bytes, text_field: str, where: Callable[[], str]) -> tuple[str, int]:
    text, replaced = decode(line)
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise UserError(f"{where()}: not valid JSON ({e})") from None
    if not isinstance(obj, dict) or text_field not in obj:
        found = f"fields {', '.join(list(obj)[:8])}" if isinstance(obj, dict) else type(obj).__name__
        raise UserError(f"{where()}: expected a JSON object with field {text_field!r} (--text-field), found {found}")
    value = obj[text_field]
    if value is None:
        value = ""
    if not isinstance(value, str):
        raise UserError(f"{where()}: field {text_field!r} expected a string, found {type(value).__name__}")
    return value, replaced


def _jsonl_lines(unit: Unit) -> Iterator[tuple[bytes, int, Callable[[], int]]]:
    """(line, byte offset, its line number on demand) for the unit's lines."""
    source = unit.sources[0]
    if unit.payload is not None:
        offset = unit.start
        for n, line in enumerate(io.BytesIO(unit.payload)):
            yield line, offset, lambda n=n: unit.first_line + n
            offset += len(line)
        return
    with open(source.path, "rb") as f:
        f.seek(unit.start)
        offset = unit.start
        for n, line in enumerate(f):
            if offset >= unit.end:
                return
            # Counting the lines before the unit is only worth it to report an error.
            yield line, offset, lambda n=n: _line_number(source.path, unit.start) + n
            offset += len(line)


def _read_jsonl(unit: Unit, text_field: str, docs: Documents) -> None:
    source = unit.sources[0]
    try:
        for line, offset, line_number in _jsonl_lines(unit):
            if not line.strip():
                continue
            text, replaced = _jsonl_text(line, text_field, lambda: f"{source.name}:{line_number()} (byte {offset})")
            docs.add(f"{source.name}:{offset}", text, source.val, replaced)
    except OSError as e:
        raise UserError(f"{source.name}: cannot read ({type(e).__name__}: {e})") from None


def _parquet_row_group(unit: Unit, field: str):
    """(source, index of the row group's first row in the file, the column `field` of row group
    unit.start as Python values)."""
    import pyarrow.parquet as pq

    source = unit.sources[0]
    try:
        pf = pq.ParquetFile(source.path)
        first_row = sum(pf.metadata.row_group(i).num_rows for i in range(unit.start))
        column = pf.read_row_group(unit.start, columns=[field]).column(0)
    except Exception as e:  # pyarrow's own error types (ArrowInvalid, OSError)
        raise UserError(f"{source.name}: row group {unit.start} unreadable ({type(e).__name__}: {e})") from None
    return source, first_row, column.to_pylist()


def _read_parquet(unit: Unit, text_field: str, docs: Documents) -> None:
    source, first_row, values = _parquet_row_group(unit, text_field)
    for row, value in enumerate(values):
        replaced = 0
        if isinstance(value, bytes):
            value, replaced = decode(value)
        elif value is not None and not isinstance(value, str):
            raise UserError(f"{source.name}: row {first_row + row}: column {text_field!r} expected text, "
                            f"found {type(value).__name__}")
        docs.add(f"{source.name}:{first_row + row}", value or "", source.val, replaced)


def _read_jsonl_chat(unit: Unit, messages_field: str, strict: bool, docs: Documents, pairs: bool = False) -> None:
    source = unit.sources[0]
    try:
        for line, offset, line_number in _jsonl_lines(unit):
            if not line.strip():
                continue
            where = lambda: f"{source.name}:{line_number()}"  # noqa: E731 (computed only when reported)
            try:
                record = json.loads(decode(line)[0])
            except ValueError as e:
                docs.skip_malformed(where(), f"not valid JSON ({e})", strict)
                continue
            if pairs:
                docs.add_pair(f"{source.name}:{offset}", record, source.val, where, strict)
            else:
                docs.add_conversation(f"{source.name}:{offset}", record, source.val, where, messages_field, strict)
    except OSError as e:
        raise UserError(f"{source.name}: cannot read ({type(e).__name__}: {e})") from None


def _read_parquet_chat(unit: Unit, messages_field: str, strict: bool, docs: Documents) -> None:
    source, first_row, values = _parquet_row_group(unit, messages_field)
    for row, value in enumerate(values):
        docs.add_conversation(f"{source.name}:{first_row + row}", {messages_field: value}, source.val,
                              lambda row=row: f"{source.name}: row {first_row + row}", messages_field, strict)


def _read_parquet_pairs(unit: Unit, strict: bool, docs: Documents) -> None:
    columns = [_parquet_row_group(unit, name) for name in preferences.FIELDS]
    source, first_row = columns[0][:2]
    for row, values in enumerate(zip(*(c[2] for c in columns))):
        docs.add_pair(f"{source.name}:{first_row + row}", dict(zip(preferences.FIELDS, values)), source.val,
                      lambda row=row: f"{source.name}: row {first_row + row}", strict)


def read_unit(unit: Unit, text_field: str, chat: bool = False, strict: bool = False,
              pairs: bool = False) -> Documents:
    """The documents of one unit; with `chat`, its conversations (text_field is then the
    messages field); with `pairs` too, its preference pairs."""
    docs = Documents()
    first = unit.sources[0]
    if chat and pairs and first.format == "parquet":
        _read_parquet_pairs(unit, strict, docs)
        return docs
    if chat:
        if first.format == "jsonl":
            _read_jsonl_chat(unit, text_field, strict, docs, pairs)
        elif first.format == "parquet":
            _read_parquet_chat(unit, text_field, strict, docs)
        else:
            raise UserError(f"{first.name}: chat data expected JSONL (.jsonl, .jsonl.gz) or Parquet, "
                            f"found {first.format}")
        return docs
    if first.format == "jsonl":
        _read_jsonl(unit, text_field, docs)
    elif first.format == "parquet":
        _read_parquet(unit, text_field, docs)
    else:
        for source in unit.sources:
            try:
                data = Path(source.path).read_bytes()
            except OSError as e:
                raise UserError(f"{source.name}: cannot read ({e})") from None
            text, replaced = decode(data)
            docs.add(source.name, text, source.val, replaced)
    return docs
