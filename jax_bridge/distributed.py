"""Multi-host start-up: join the JAX cluster (`jax.distributed`) before anything touches a device.

Every host runs the same command. The cluster is described by flags (`--coordinator HOST:PORT
--num-processes N --process-id I`) or found by JAX itself where the scheduler says it: a Cloud
TPU pod slice (its metadata) and SLURM (`SLURM_*` variables). A single process needs nothing.
On CPU hosts (tests, one machine) the collectives go through gloo.
"""
from __future__ import annotations

import os

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
               process_id: int | None = None, *, timeout_s: int = 300) -> bool:
    """Join the cluster; returns True when this run spans several processes."""
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
                                   process_id=process_id, initialization_timeout=timeout_s)
        return True
    if detected_cluster() is None:
        return False
    _cpu_collectives()
    jax.distributed.initialize(initialization_timeout=timeout_s)
    return jax.process_count() > 1


def _cpu_collectives() -> None:
    # Only the CPU backend reads this; TPU and GPU hosts use their own interconnect.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")


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
