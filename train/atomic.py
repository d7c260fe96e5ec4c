"""The durability primitive shared by every atomic writer (shards, manifests, checkpoints)."""
import os


def fsync_path(path) -> None:
    """fsync a file or a directory (a directory's entry list must be synced after a rename)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
