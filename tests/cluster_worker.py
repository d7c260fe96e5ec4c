"""One process of a two-process cluster (tests/test_cluster_inference.py): joins the cluster once,
then runs every multi-process scenario over the global mesh of 2 x 2 simulated CPU devices, the
commands through their own CLI entry points: greedy generation and log-likelihoods of a released-
layout directory read onto the mesh slice by slice, `eval --tasks`, `lm-eval` and a LoRA run.
Process 0 prints the generated tokens and log-likelihoods as JSON.

usage: python tests/cluster_worker.py PORT PROCESS ROOT
"""
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jax_bridge import distributed  # noqa: E402

MESH = "fsdp=2,expert=2"


def main(port: int, process: int, root: Path) -> None:
    distributed.initialize(f"127.0.0.1:{port}", 2, process)
    import jax

    from jax_bridge.sharding import make_mesh
    from tests.cluster_scenarios import generation, loglikelihoods, cli_runs

    assert jax.process_count() == 2 and jax.device_count() == 4
    tokens = generation(root, make_mesh(MESH))
    logprobs = loglikelihoods(root, make_mesh(MESH))
    cli_runs(root, "two", ["--mesh", MESH], str(process))
    if process == 0:
        print("RESULT " + json.dumps({"tokens": tokens, "logprobs": logprobs}))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
