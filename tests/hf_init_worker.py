"""Runs in a subprocess with simulated CPU devices (tests/test_init_from_hf.py): builds the train
state of a Hugging Face directory straight from its shards (formats/mesh_loader.py) on a mesh and
compares every addressable shard with a full load (parameters read whole on the host, optimizer
state zeros) and its sharding with the trainer's rules; prints what it read as JSON.

usage: python tests/hf_init_worker.py DEVICES HF_DIR@MESH ... [--cluster COORDINATOR,N,ID]
"""
import json
import os
import sys

os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={int(sys.argv[1])}"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402


def full_load_params(hf_dir, layout) -> dict:
    """The reference: every tensor read whole on the host, in the train state's layer layout."""
    from formats import hf_mapping
    from formats.hf_import import read_stored
    from formats.hf_model import open_hf
    from formats.hf_weights import numpy_to_torch

    cfg, weights = open_hf(hf_dir)
    state = {}
    for name in weights.entries:
        state.update(hf_mapping.from_hf_state({name: numpy_to_torch(read_stored(weights, name)).float()}, cfg))
    return layout.stack({k: v.numpy() for k, v in state.items()})


def run(hf_dir: str, spec: str) -> dict:
    from jax_bridge import sharding
    from jax_bridge.step import StepConfig, TrainStep
    from torch_model.model import GptOssForCausalLM
    from formats import init_from_hf, mesh_loader

    cfg, weights = init_from_hf.open_for_init(hf_dir)
    mesh = sharding.make_mesh(spec)
    step_cfg = StepConfig(kernels="xla", scan_layers=True)
    with torch.device("meta"):
        model = GptOssForCausalLM(cfg)
    try:
        step = TrainStep(model, step_cfg=step_cfg, mesh=mesh)
    except ValueError as e:
        return {"refused": str(e)}
    state = mesh_loader.init_state(step, weights)
    reference = full_load_params(hf_dir, step.layer_layout)
    expected = step.state_shardings(state)
    mismatched = []
    for (path, got), sharding in zip(jax.tree_util.tree_leaves_with_path(state), jax.tree.leaves(expected)):
        name = jax.tree_util.keystr(path)
        want = reference[path[-1].key] if path[0].name == "params" else np.zeros(got.shape, got.dtype)
        same = got.sharding.is_equivalent_to(sharding, got.ndim) and got.dtype == np.float32 and all(
            np.array_equal(np.asarray(shard.data), want[shard.index]) for shard in got.addressable_shards)
        if not same:
            mismatched.append(name)
    return {"mismatched": mismatched, "leaves": len(jax.tree.leaves(state)), "bytes_requested": weights.bytes_requested,
            "stored_bytes": sum(e.nbytes for e in weights.entries.values()), "process": jax.process_index()}


if __name__ == "__main__":
    args = sys.argv[2:]
    if "--cluster" in args:
        coordinator, n, i = args[args.index("--cluster") + 1].split(",")
        args = args[:args.index("--cluster")]
        from jax_bridge import distributed
        distributed.initialize(coordinator, int(n), int(i))
    print("RESULT " + json.dumps([run(*a.split("@")) for a in args]))
