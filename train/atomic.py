"""The durability primitives shared by every atomic writer (shards, manifests, tokenizers,
checkpoints): fsync, publish-by-rename, and the sha256 of a file."""
import hashlib
import os
from pathlib import Path


def fsync_path(path) -> None:
    """fsync a file or a directory (a directory's entry list must be synced after a rename)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_name(path) -> Path:
    """The hidden name a file is written under before publish() renames it into place."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def publish(tmp, final) -> None:
    """fsync a finished temporary file, then rename it over its final name."""
    fsync_path(tmp)
    os.replace(tmp, final)
    fsync_path(Path(final).parent)


def write_atomic(path, data: bytes) -> None:
    """Write `data` to `path` so that a crash leaves either the old file or the new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(path)
    tmp.write_bytes(data)
    publish(tmp, path)


def sha256_file(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
