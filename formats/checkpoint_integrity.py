"""What makes a checkpoint step complete: the hash manifest written after Orbax renames the step
into place (Orbax does not checksum array bytes) and verified before any read, the Orbax
temporary-path hook that writes it, and the fault-injection points tests kill the process at.

Each file's checksum is xxHash's XXH3-128 (about 10 GB/s a core here, sha256 1.1 GB/s): it finds
a damaged or truncated file, the manifest's one job; nothing here guards against an adversary.
Manifests written before hold sha256 and are verified as they are.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import os
import signal
from pathlib import Path
from typing import Callable

from formats.errors import UserError
from formats.atomic import write_atomic

MANIFEST_FILE = "torchlyra_manifest.json"
# Fault injection for tests, "N" or "N@K": SIGKILL this process once N files of the checkpoint it
# is saving (the K-th save of the process, default the first) are on disk, checked as each item is
# finalized, before and after the step's rename, and after the manifest.
FAULT_ENV = "TORCHLYRA_FAULT_KILL_AFTER_CHECKPOINT_FILES"
# Fault injection for tests, "STEP": SIGKILL this process as its save of step STEP starts, while its
# peers save that step: a host lost in mid-save. Killed before it writes a shard, never after (its
# background writer could finish a tiny step before the kill: the step would then be complete).
SAVE_FAULT_ENV = "TORCHLYRA_FAULT_KILL_WHILE_SAVING_STEP"


class CheckpointDamaged(UserError):
    """A step directory is incomplete or fails its manifest; the message says which file."""


# ---- the hash manifest ---------------------------------------------------------------------
def _files(step_dir: Path) -> list[Path]:
    return sorted(p for p in step_dir.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)


WRITTEN_CHECKSUM = "xxh3_128"            # the manifest field of each file's checksum (older: "sha256")


def _checksum(path: Path, kind: str) -> str:
    import xxhash

    h = xxhash.xxh3_128() if kind == "xxh3_128" else hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(4 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _hash_all(paths: list[Path], kinds: list[str]) -> list[str]:
    # xxhash and hashlib release the GIL on large buffers: a few threads hash a big checkpoint faster.
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return list(pool.map(_checksum, paths, kinds))


def write_manifest(step_dir: Path) -> int:
    """Record size and checksum of every file of a finalized step; returns the total bytes."""
    files = _files(step_dir)
    digests = _hash_all(files, [WRITTEN_CHECKSUM] * len(files))
    entries = {str(p.relative_to(step_dir)): {"bytes": p.stat().st_size, WRITTEN_CHECKSUM: h}
               for p, h in zip(files, digests)}
    manifest = {"format": "torchlyra-checkpoint-manifest", "version": 1, "files": entries}
    write_atomic(step_dir / MANIFEST_FILE, (json.dumps(manifest, indent=1) + "\n").encode())
    return sum(e["bytes"] for e in entries.values())


# Seconds this process spent verifying manifests (hashing files): a command's start says them.
HASHING = {"seconds": 0.0, "bytes": 0}
_VERIFIED: set = set()      # ((step directory, each file's size and mtime), the folder not hashed) verified


def verify_manifest(step_dir: Path, unhashed: str | None = None) -> None:
    """CheckpointDamaged naming the first missing, resized or altered file (or the absent manifest).
    Files under the folder `unhashed` (one a caller will not read) are checked for presence and
    size only."""
    import time

    started = time.perf_counter()
    try:
        _verify(step_dir, unhashed)
    finally:
        HASHING["seconds"] += time.perf_counter() - started


def _verify(step_dir: Path, unhashed: str | None) -> None:
    path = step_dir / MANIFEST_FILE
    if not path.is_file():
        raise CheckpointDamaged(f"checkpoint {step_dir} is incomplete (no {MANIFEST_FILE}: the process "
                                f"stopped while saving it)")
    try:
        entries = json.loads(path.read_text())["files"]
        kind = {rel: WRITTEN_CHECKSUM if WRITTEN_CHECKSUM in e else "sha256" for rel, e in entries.items()}
        expected = {rel: (int(e["bytes"]), str(e[kind[rel]])) for rel, e in entries.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointDamaged(f"checkpoint {step_dir}: {MANIFEST_FILE} is unreadable ({type(e).__name__})") from None
    stats = []
    for rel, (size, _) in expected.items():
        file = step_dir / rel
        if not file.is_file():
            raise CheckpointDamaged(f"checkpoint {step_dir} is damaged: file {rel} is missing")
        stat = file.stat()
        if stat.st_size != size:
            raise CheckpointDamaged(f"checkpoint {step_dir} is damaged: file {rel} has {stat.st_size} "
                                    f"bytes, expected {size}")
        stats.append((rel, stat.st_size, stat.st_mtime_ns))
    # A step this process verified already, no file written since: one command opens its checkpoint
    # from several places (what it holds, then its weights), and hashes it once.
    files = (str(step_dir.resolve()), tuple(stats))
    if (files, None) in _VERIFIED or (files, unhashed) in _VERIFIED:
        return
    rels = sorted(rel for rel in expected if not (unhashed and rel.startswith(unhashed + "/")))
    HASHING["bytes"] += sum(expected[rel][0] for rel in rels)
    for rel, found in zip(rels, _hash_all([step_dir / r for r in rels], [kind[r] for r in rels])):
        if found != expected[rel][1]:
            raise CheckpointDamaged(f"checkpoint {step_dir} is damaged: file {rel} fails its checksum "
                                    f"({kind[rel]}: altered since it was written)")
    _VERIFIED.add((files, unhashed))


# ---- fault injection (tests) ---------------------------------------------------------------
_saves_done = 0      # checkpoints this process completed (for FAULT_ENV)


def _count_files(step_dir: Path) -> int:
    return sum(1 for p in step_dir.rglob("*") if p.is_file())


def _fault_point(step_dir: Path) -> None:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    files, _, save = spec.partition("@")
    if _saves_done + 1 == int(save or 1) and _count_files(step_dir) >= int(files):
        os.kill(os.getpid(), signal.SIGKILL)


def fault_while_saving(step: int) -> None:
    """The SAVE_FAULT_ENV injection point: called as a save of `step` starts."""
    if os.environ.get(SAVE_FAULT_ENV) == str(step):
        os.kill(os.getpid(), signal.SIGKILL)


def hooked_temporary_path(on_step_written: Callable[[Path], None]):
    """Orbax's atomic-rename temporary path, plus: after a step directory is renamed into place,
    `on_step_written(final_dir)` (the manifest); and the fault-injection points."""
    from orbax.checkpoint._src.path import atomicity

    class ManifestedTemporaryPath(atomicity.AtomicRenameTemporaryPath):
        async def finalize(self, *args, **kwargs):
            tmp, final = Path(self.get()), Path(self.get_final())
            is_step = not final.parent.name.endswith(atomicity.TMP_DIR_SUFFIX)   # items live inside a step
            _fault_point(tmp if is_step else tmp.parent)
            await super().finalize(*args, **kwargs)
            if is_step:
                global _saves_done
                _fault_point(final)
                await asyncio.to_thread(on_step_written, final)
                _fault_point(final)
                _saves_done += 1

    return ManifestedTemporaryPath
