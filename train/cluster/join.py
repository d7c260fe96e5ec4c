"""Any command on several processes (`train`, `generate`, `eval`): the cluster flags, the supervising
parent that turns a lost host into one line and exit 75 (train/cluster/host_supervisor.py), joining
JAX's cluster before anything touches a device, and the end every process reaches together."""
from __future__ import annotations

import contextlib
import sys

from formats.errors import UserError

DEFAULT_HOST_TIMEOUT_S = 30
MULTI_HOST = "multi-host"           # the title of the cluster flags' group, and its description:
MULTI_HOST_HELP = "one command per host; not needed on a TPU pod or under SLURM"


def add_arguments(parser, group=None) -> None:
    """The cluster flags, in `group` (a command's own multi-host group) or a group of their own."""
    cluster = group if group is not None else parser.add_argument_group(MULTI_HOST, MULTI_HOST_HELP)
    cluster.add_argument("--coordinator", help="HOST:PORT of process 0, which every process connects to")
    cluster.add_argument("--num-processes", type=int, help="number of processes (hosts) in the run")
    cluster.add_argument("--process-id", type=int, help="this process's rank, 0 .. num-processes - 1")


def join(args, command: str, *, out: str | None = None, host_timeout_s: int = DEFAULT_HOST_TIMEOUT_S) -> int | None:
    """Join the cluster the flags (or the environment) describe. On several processes the command
    first runs as a supervised child of this process: then the child's exit code (or
    EXIT_HOST_LOST) is returned and this process does nothing else. None: go on (one process, or
    the supervised child, in the cluster)."""
    from jax_bridge import distributed
    from train.cluster import host_fault

    many = (args.num_processes or 1) > 1 or (args.num_processes is None and distributed.detected_cluster())
    if many and not host_fault.supervised():
        from train.cluster.host_supervisor import supervise

        return supervise(args.argv, out, command)
    try:       # before anything touches a device
        distributed.initialize(args.coordinator, args.num_processes, args.process_id, host_timeout_s=host_timeout_s)
    except distributed.ClusterError as e:
        raise UserError(str(e)) from None
    if host_fault.supervised():
        import jax

        host_fault.report(process=jax.process_index(), processes=jax.process_count(),
                          hosts=distributed.process_hosts())
    return None


def command_mesh(spec):
    """The mesh a command's `--mesh` names, as `train` reads it: every device on `fsdp` unless
    named, none on a single device; a spec that does not fit the devices is one line."""
    from jax_bridge.sharding import requested_mesh

    try:
        return requested_mesh(spec)
    except ValueError as e:
        raise UserError(str(e)) from None


def say_inference_mesh(command: str, requested, used) -> None:
    """One line (process 0) when a command runs a model on another split of the mesh it was given
    (jax_bridge.sharding.inference_mesh)."""
    import jax

    from jax_bridge.sharding import describe

    if used is not requested and jax.process_index() == 0:
        print(f"{command}: mesh {describe(requested)} runs as {describe(used)}: the weights split the tensor way, "
              f"none gathered for use (jax_bridge/sharding.py: inference_mesh)", file=sys.stderr, flush=True)


@contextlib.contextmanager
def together(name: str, host_timeout_s: int = DEFAULT_HOST_TIMEOUT_S):
    """The body of a command every process runs in lockstep: on several processes they end
    together (none waits alone at JAX's shutdown), and a failure other than the user's waits for
    the coordination service's verdict (a dead peer ends this process: its parent says who)."""
    import jax

    if jax.process_count() == 1:
        yield
        return
    from jax_bridge.distributed import barrier
    from train.cluster.host_fault import await_verdict

    try:
        yield
        barrier(f"torchlyra: {name} ended", timeout_s=24 * 3600)
    except UserError:
        raise
    except Exception as e:
        await_verdict(e, host_timeout_s)
        raise
