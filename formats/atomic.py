"""The durability primitives shared by every atomic writer (shards, manifests, tokenizers,
checkpoints, exports): fsync, a file or a directory published whole by one rename, and the
sha256 of a file."""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from formats.errors import UserError


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


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for f in files:
            fsync_path(Path(dirpath) / f)
        fsync_path(Path(dirpath))


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two directories (Linux renameat2 RENAME_EXCHANGE); False if unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _publish(tmp: Path, target: Path) -> None:
    _fsync_tree(tmp)
    if not target.exists():
        os.rename(tmp, target)
    elif _exchange(tmp, target):
        shutil.rmtree(tmp)                      # tmp now holds the previous contents
    else:
        # No atomic swap on this filesystem: a short window where the old copy sits at .old-*.
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        os.rename(target, old / "x")
        os.rename(tmp, target)
        shutil.rmtree(old)
    fsync_path(target.parent)


@contextlib.contextmanager
def staged_dir(target: str | os.PathLike, *, replace: str = "never"):
    """Yield a fresh hidden directory beside `target`; publish it as `target` on normal exit,
    remove it on any exception (nothing partial is ever left).

    replace: "never" refuses an existing non-empty target, "always" replaces it; a callable
    path -> bool decides (used to replace only a previous checkpoint)."""
    target = Path(target)
    if target.exists() and not target.is_dir():
        raise UserError(f"{target}: expected a directory, found a file")
    if target.is_dir() and any(target.iterdir()):
        allowed = replace(target) if callable(replace) else replace == "always"
        if not allowed:
            hint = (" and holds no torchlyra checkpoint (refusing to replace it)" if callable(replace)
                    else " (pass --overwrite to replace it)")
            raise UserError(f"{target}: output directory exists and is not empty{hint}")
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in target.parent.glob(f".{target.name}.tmp-*"):   # left by a killed writer
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)   # mkdtemp's 0700 would otherwise become the published mode
    try:
        yield tmp
        _publish(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
