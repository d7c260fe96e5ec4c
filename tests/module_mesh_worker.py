"""Runs in a subprocess with 4 simulated CPU devices (tests/test_module_models.py): `train --module`
of each module named on the command line, on the mesh fsdp=2,tensor=2, with the test's settings,
then prints per module its losses and where its block matrices live, as one JSON line.

usage: python tests/module_mesh_worker.py DATA OUT NAME ...
"""
import json
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from test_module_models import ARGS, MODELS, losses, module_args  # noqa: E402
from train.cli import main  # noqa: E402

MESH = "fsdp=2,tensor=2"


def split_over_tensor(name: str) -> list[str]:
    """The parameters of the module's first block that its roles split over `tensor`."""
    import jax
    import numpy as np

    from formats.model_checks import module_record
    from jax_bridge import sharding
    from jax_bridge.module_probe import build_record
    from torch_model.causal_lm import parameter_roles

    model = build_record(module_record(*MODELS[name], 32), meta=True)
    mesh = sharding.make_mesh(MESH)
    params = {n: jax.ShapeDtypeStruct(tuple(p.shape), np.float32) for n, p in model.named_parameters()}
    placed = sharding.state_shardings(params, mesh, parameter_roles(model))
    return sorted(n for n, s in placed.items() if "tensor" in str(s.spec))


if __name__ == "__main__":
    data, out, names = sys.argv[1], sys.argv[2], sys.argv[3:]
    result = {}
    for name in names:
        run = os.path.join(out, name)
        assert main(["train", *module_args(name), "--data", data, *ARGS, "--steps", "4", "--mesh", MESH,
                     "--out", run]) == 0
        from pathlib import Path

        result[name] = {"losses": losses(Path(run)), "tensor": split_over_tensor(name)}
    print(json.dumps(result))
