"""BIG-bench's JSON tasks from the `bigbench==1.0.0` source archive on PyPI: fetched through pip,
pinned by sha256, cached once; only the task.json files asked for are extracted (never imported).

pip prepares a source archive's metadata even for `download`, and bigbench's setup.py imports
`pkg_resources`, which setuptools 70+ lacks: the pip subprocess caps its build setuptools below 70.
"""
from __future__ import annotations

import json
import tarfile
from pathlib import Path

from formats.atomic import write_atomic
from formats.errors import UserError
from train.data.pinned_download import PinnedFile, cache_dir, fetch

PACKAGE = "bigbench==1.0.0"
ARCHIVE_NAME = "bigbench-1.0.0.tar.gz"
ARCHIVE_SHA256 = "1bb398a5512c6d798cdebe0dfa0ac03f67f6033fa6b39c6ef71df978c7cbc5c2"
TASKS_ROOT = "bigbench-1.0.0/bigbench/benchmark_tasks/"


ARCHIVE = PinnedFile(PACKAGE, ARCHIVE_NAME, ARCHIVE_SHA256, binary=False,
                     hint="check access to PyPI, or pass your own --tasks FILE.jsonl",
                     build_constraints="setuptools<70\n")


def fetch_archive() -> Path:
    """The verified archive, downloaded once into the cache (a wrong-hash copy is replaced)."""
    return fetch(ARCHIVE)


def task_files(names: list[str]) -> dict[str, Path]:
    """{task: cached task.json} for task names such as "operators" or "cs_algorithms/lcs",
    extracting the missing ones in one pass over the archive."""
    root = cache_dir() / "bigbench-1.0.0"
    paths = {name: root / name / "task.json" for name in names}
    missing = {TASKS_ROOT + name + "/task.json": name for name, p in paths.items() if not p.is_file()}
    if missing:
        archive = fetch_archive()
        try:
            with tarfile.open(archive, "r:gz") as tar:
                for member in tar:          # streamed: a .tar.gz has no index to seek in
                    name = missing.pop(member.name, None)
                    if name is not None:
                        write_atomic(paths[name], tar.extractfile(member).read())
                    if not missing:
                        break
        except (tarfile.TarError, OSError, EOFError) as e:
            raise UserError(f"{archive}: not a readable .tar.gz archive ({e})") from None
        if missing:
            raise UserError(f"{archive}: no BIG-bench task {', '.join(sorted(missing.values()))} "
                            f"(expected {', '.join(sorted(missing))})")
    return paths


def read_task(path: Path) -> dict:
    """A task.json as a dict with its "examples" list."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: not a readable BIG-bench task.json ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("examples"), list):
        raise UserError(f"{path}: field 'examples' expected a list, found {type(data.get('examples')).__name__}")
    return data
