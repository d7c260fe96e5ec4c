"""Multi-host start-up: join the JAX cluster (`jax.distributed`) before anything touches a device.

Every host runs the same command. The cluster is described by flags (`--coordinator HOST:PORT
--num-processes N --process-id I`) or found by JAX itself where the scheduler says it: a Cloud
TPU pod slice (its metadata) and SLURM (`SLURM_*` variables). A single process needs nothing.
On CPU hosts (tests, one machine) the collectives go through gloo. The coordination service's
heartbeat and shutdown timeouts are the run's `host_timeout_s`: a process silent that long is
declared dead and the service ends every other process (see train/cluster/host_supervisor.py).
"""
from __future__ import annotations

import json
import os
import socket

import jax


class ClusterError(ValueError):
    """The cluster description is incomplete or contradictory."""


def detected_cluster(environ=os.environ) -> str | None:
    """Which multi-host environment this process runs in, if any JAX can configure itself."""
    if int(environ.get("SLURM_NTASKS", "1") or 1) > 1 and "SLURM_JOB_ID" in environ:
        return "slurm"
    hosts = environ.get("TPU_WORKER_HOSTNAMES", "")
    if "," in hosts or int(environ.get("MEGASCALE_NUM_SLICES", "1") or 1) > 1:
        return "tpu-pod"
    return None


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, timeout_s: int = 300, host_timeout_s: int = 30) -> bool:
    """Join the cluster; returns True when this run spans several processes. `timeout_s` bounds
    the wait for the others to join, `host_timeout_s` how long a silent peer counts as alive."""
    timeouts = dict(initialization_timeout=timeout_s, heartbeat_timeout_seconds=host_timeout_s,
                    shutdown_timeout_seconds=host_timeout_s)
    given = {"--coordinator": coordinator, "--num-processes": num_processes, "--process-id": process_id}
    if any(v is not None for v in given.values()):
        missing = [k for k, v in given.items() if v is None]
        if missing:
            raise ClusterError(f"multi-host: {', '.join(missing)} missing (give --coordinator, --num-processes "
                               f"and --process-id together, or none on a TPU pod / under SLURM)")
        if not 0 <= process_id < num_processes:
            raise ClusterError(f"multi-host: --process-id must be in 0..{num_processes - 1}, found {process_id}")
        if num_processes == 1:
            return False
        _cpu_collectives()
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                   process_id=process_id, **timeouts)
        return True
    if detected_cluster() is None:
        return False
    _cpu_collectives()
    jax.distributed.initialize(**timeouts)
    return jax.process_count() > 1


def _cpu_collectives() -> None:
    # Only the CPU backend reads this; TPU and GPU hosts use their own interconnect.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")


def _coordination_client():
    # jax keeps the client of the coordination service here (jax.experimental.multihost_utils
    # and Orbax read it the same way); its key-value store and barriers need no device.
    from jax._src import distributed as jax_distributed

    return jax_distributed.global_state.client


def process_hosts(timeout_s: int = 300) -> dict[int, dict]:
    """{process index: {"host", "pid"}} of every process, exchanged once through the coordination
    service's key-value store (every process must call it)."""
    client, me = _coordination_client(), jax.process_index()
    mine = {"host": socket.gethostname(), "pid": os.getpid()}
    client.key_value_set(f"torchlyra/hosts/{me}", json.dumps(mine))
    return {i: mine if i == me else json.loads(client.blocking_key_value_get(f"torchlyra/hosts/{i}", timeout_s * 1000))
            for i in range(jax.process_count())}


def barrier(name: str, timeout_s: int) -> None:
    """Wait until every process reaches `name` (the coordination service's barrier, no device)."""
    _coordination_client().wait_at_barrier(name, timeout_s * 1000)


def is_main_process() -> bool:
    """Process 0 prints progress and writes metrics, plots and summaries."""
    return jax.process_index() == 0


def sum_over_processes(values):
    """Element-wise sum of a numpy array over all processes (the array itself with one)."""
    if jax.process_count() == 1:
        return values
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(values).sum(0)


def say(*args, **kwargs) -> None:
    """print, on process 0 only."""
    if is_main_process():
        print(*args, **kwargs)


def describe() -> str:
    if jax.process_count() == 1:
        return f"1 process, {jax.local_device_count()} {jax.default_backend()} device(s)"
    return (f"process {jax.process_index()} of {jax.process_count()}, {jax.local_device_count()} local / "
            f"{jax.device_count()} {jax.default_backend()} devices")
