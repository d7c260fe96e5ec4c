"""Multi-host `train` as a small parent over the training process: when JAX's coordination service
ends it because a peer host died (an abort with a C++ stack trace), the parent holds that back and
says in one line who was lost, the newest complete checkpoint and how to resume (EXIT_HOST_LOST)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from formats.checkpoint_integrity import MANIFEST_FILE
from train.cluster.host_fault import EXIT_HOST_LOST, SUPERVISOR_FD_ENV

# A survivor stops within host_timeout_s + STOP_GRACE_S of a peer's death (the service's
# heartbeat check, the abort, this parent's line).
STOP_GRACE_S = 10
# The start of a line of XLA's C++ log (absl: "E1201 08:35:15.315793 6894 file.cc:1549] ...") or of
# the crash report that follows a fatal one, or of an error a library logs from a background thread
# when the service fails its barrier (Orbax's async save: "ERROR:absl:... Traceback ..."); anywhere,
# as it may follow a progress bar's "\r".
CPP_LOG = re.compile(rb"[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\]|\*\*\* Check failure|terminate called after"
                     rb"|ERROR:absl:|Traceback \(most recent call last\)")
# Such output is held this long: a fatal message ends the process within milliseconds, and what
# ends it is reported in our line instead; output of a process that lives on is passed on.
HOLD_S = 2.0
# What the coordination service writes when it ends a process because a peer is gone.
SERVICE_ENDED = ("JAX distributed service detected fatal errors", "Polled an error from coordination service",
                 "heartbeat timeout", "stopped sending heartbeats")


class StderrRelay:
    """Copies the child's stderr to ours as it comes, holding back C++ log text for HOLD_S;
    keeps the tail of everything for the verdict."""

    def __init__(self, source, sink):
        self.source, self.sink = source, sink
        self.lock = threading.Lock()
        self.held, self.held_since = bytearray(), None
        self.tail = bytearray()

    def run(self) -> None:
        while chunk := os.read(self.source.fileno(), 65536):
            with self.lock:
                self.tail = (self.tail + chunk)[-262144:]
                if self.held_since is None:
                    match = CPP_LOG.search(chunk)
                    if match is None:
                        self._write(chunk)
                        continue
                    self._write(chunk[:match.start()])
                    chunk, self.held_since = chunk[match.start():], time.monotonic()
                self.held += chunk

    def release_if_old(self) -> None:
        with self.lock:
            if self.held_since is not None and time.monotonic() - self.held_since > HOLD_S:
                self.release()

    def release(self) -> None:
        """Pass the held text on (the process lived on, or ended for another reason)."""
        self._write(bytes(self.held))
        self.held, self.held_since = bytearray(), None

    def text(self) -> str:
        return self.tail.decode(errors="replace")

    def _write(self, data: bytes) -> None:
        if data:
            self.sink.write(data)
            self.sink.flush()


class Events:
    """The JSON lines the child reports (train/cluster/host_fault.py): its process table, a failed step."""

    def __init__(self, fd: int):
        self.fd, self.seen = fd, {}

    def run(self) -> None:
        with os.fdopen(self.fd, "rb") as pipe:
            for line in pipe:
                try:
                    self.seen.update(json.loads(line))
                except ValueError:
                    pass


def supervise(argv: list[str], out: str | None, command: str = "train") -> int:
    """Run `torchlyra <argv>` as a child and return its exit code, or EXIT_HOST_LOST after the
    one line when the coordination service ended it because a peer host died. `out`: a training
    run's directory (its newest checkpoint is named), None for a command that writes no run."""
    read_end, write_end = os.pipe()
    child = subprocess.Popen([sys.executable, "-m", "train.cli", *argv], stderr=subprocess.PIPE,
                             env={**os.environ, SUPERVISOR_FD_ENV: str(write_end)}, pass_fds=(write_end,))
    os.close(write_end)
    relay, events = StderrRelay(child.stderr, sys.stderr.buffer), Events(read_end)
    threads = [threading.Thread(target=relay.run, daemon=True), threading.Thread(target=events.run, daemon=True)]
    for t in threads:
        t.start()
    # Ctrl-C reaches the child from the terminal already (one process group); a scheduler's
    # SIGTERM to this process is passed on (the child checkpoints and stops).
    previous = {signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN),
                signal.SIGTERM: signal.signal(signal.SIGTERM, lambda *_: child.send_signal(signal.SIGTERM))}
    try:
        while child.poll() is None:
            relay.release_if_old()
            time.sleep(0.2)
        for t in threads:
            t.join(timeout=5)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    code, text = child.returncode, relay.text()
    if code == 0 or not any(s in text for s in SERVICE_ENDED):
        relay.release()
        return code if code >= 0 else 128 - code
    print("\n" + host_lost_line(events.seen, text, out, command), file=sys.stderr, flush=True)
    return EXIT_HOST_LOST


def lost_process(service_text: str, me: int | None) -> tuple[int | None, str]:
    """(index of the lost process or None, how it was seen) from what the service wrote."""
    found = re.search(r"Task (\d+) heartbeat timeout", service_text)
    if found is None:
        found = re.search(r"stopped sending heartbeats\):\s*(\d+)", service_text)
    if found is not None and int(found.group(1)) != me:
        return int(found.group(1)), "it stopped sending heartbeats"
    if "PollForError" in service_text or "Socket closed" in service_text:
        return 0, "the coordination service it ran stopped answering"
    return None, "the coordination service reported a failed peer"


def newest_complete_checkpoint(out: str) -> Path | None:
    """The newest step directory holding its manifest (written last; --resume verifies it)."""
    root = Path(out) / "checkpoints"
    if not root.is_dir():
        return None
    steps = sorted((int(p.name), p) for p in root.iterdir() if p.name.isdigit() and (p / MANIFEST_FILE).is_file())
    return steps[-1][1] if steps else None


def host_lost_line(seen: dict, service_text: str, out: str | None, command: str = "train") -> str:
    me, hosts = seen.get("process"), seen.get("hosts", {})
    lost, how = lost_process(service_text, me)
    who = "a peer process"
    if lost is not None:
        host = hosts.get(str(lost), {}).get("host", "unknown")
        who = f"process {lost} (host {host})"
    count = seen.get("processes")
    if command != "train":
        return (f"torchlyra {command}: lost {who} of {count or '?'}: {how}; process {me if me is not None else '?'} "
                f"stopped; run the command again on the hosts that are left (on each, --num-processes, "
                f"--process-id and --coordinator for those hosts) [exit {EXIT_HOST_LOST}]")
    step_dir = newest_complete_checkpoint(out)
    saved = (f"newest complete checkpoint {step_dir} (step {step_dir.name})" if step_dir is not None
             else "no complete checkpoint yet (--resume starts a new run)")
    failed = f" after {seen['collective_failed'].split(':')[0]}" if "collective_failed" in seen else ""
    return (f"torchlyra train: lost {who} of {count or '?'}: {how}; process {me if me is not None else '?'} "
            f"stopped{failed}, unable to save (its peers' shards are gone); {saved}; resume on the hosts "
            f"that are left with: torchlyra train --out {out} --resume (on each, --num-processes, --process-id "
            f"and --coordinator for those hosts; --mesh for their devices, else all on fsdp) [exit {EXIT_HOST_LOST}]")
