"""The training process's side of a lost host (under train/cluster/host_supervisor.py): tell the parent who
the processes are and when a collective failed, then wait for JAX's coordination service to end
this process (it does once a dead peer misses heartbeats for host_timeout_s). Imports nothing heavy."""
from __future__ import annotations

import json
import os
import time

# sysexits.h EX_TEMPFAIL: a temporary failure, worth running again (on the hosts that are left).
EXIT_HOST_LOST = 75
# The write end of a pipe to the supervising parent; set only in a supervised training process.
SUPERVISOR_FD_ENV = "TORCHLYRA_SUPERVISOR_FD"
# After a collective fails, how long past host_timeout_s to wait for the service's verdict before
# taking the failure for what it says (not a lost peer) and raising it.
VERDICT_GRACE_S = 10


def supervised() -> bool:
    return SUPERVISOR_FD_ENV in os.environ


def report(**event) -> None:
    """One JSON line to the supervising parent (nothing when not supervised)."""
    fd = os.environ.get(SUPERVISOR_FD_ENV)
    if fd is None:
        return
    try:
        os.write(int(fd), (json.dumps(event) + "\n").encode())
    except OSError:          # the parent is gone: nobody to tell
        pass


def await_verdict(error: BaseException, host_timeout_s: int) -> None:
    """A step of a multi-process run failed: if a peer died, the coordination service ends this
    process within host_timeout_s (the parent then says who). Returns only when it has not."""
    first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
    report(collective_failed=f"{type(error).__name__}: {first_line[:300]}", at=time.time())
    time.sleep(host_timeout_s + VERDICT_GRACE_S)
