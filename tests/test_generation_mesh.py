"""Generation sharded over a device mesh (jax_bridge/decoding.py with `mesh`): on 8 simulated CPU
devices in one subprocess (tests/generation_mesh_worker.py), greedy tokens equal the single-device
ones and the sharded prefill's logits equal eager PyTorch's to float rounding, on fresh random
prompts of odd lengths; the decode loop gathers the weights per token, not once whole; new
parameters already on the mesh are taken without a copy; a mesh that does not fit the devices is
one line at the CLI."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from parity.generation import compare_greedy

from tests.worker_env import PYTHONPATH

ROOT = Path(__file__).resolve().parent.parent
MESH = "fsdp=2,tensor=2,expert=2"        # weights split three ways; the batch over fsdp x expert


def test_sharded_generation_equals_one_device():
    seed = int(np.random.SeedSequence().entropy % 10_000)
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "generation_mesh_worker.py"), str(seed), MESH],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    sharded = out["meshes"][MESH]
    report = compare_greedy(sharded["tokens"], out["one_device"], out["margins"])
    assert all(r["ok"] for r in report), (seed, report)
    assert all(len(t) == 12 for t in out["one_device"])
    assert sharded["logits_max_abs_diff"] <= 1e-5 * max(1.0, sharded["logits_max_abs"]), (seed, sharded)
    # The decode loop gathers the split weights per token: hoisted out of the loop (XLA:CPU's
    # loop-invariant code motion) every device held the whole model while decoding.
    assert sharded["decode_collectives"] and all(
        c["gathered_per_call"] == 0 and c["gathered_per_token"] > 0 for c in sharded["decode_collectives"]), sharded
    # Nor does it copy every local expert for the decode MoE's switch over static slices (1.5 GB
    # at gpt-oss-20b's shapes on tensor=2): each row's expert is sliced as its work item runs.
    assert sharded["decode_switch"] is False, sharded
    # One prompt continued once per batch shard (4): its prefill on every device, its copies split
    shards = len(sharded["grouped_tokens"])
    assert shards == 4 and sharded["grouped_bucket"][0] == 4, sharded["grouped_bucket"]
    report = compare_greedy(sharded["grouped_tokens"], [out["one_device"][1]] * shards, [out["margins"][1]] * shards)
    assert all(r["ok"] for r in report), (seed, report)
    # New parameters already on the mesh (an RL update's) are used in place, and decoded as a
    # decoder of that model decodes (another model: other tokens).
    assert sharded["set_params_same_buffers"] and sharded["set_params_tokens_equal"], (seed, sharded)
    assert sharded["set_params_tokens_changed"], seed
    # Commands that only run a model fold fsdp into tensor as far as the heads (4 query, 2 key/value)
    # divide (MXFP4 experts then split over tensor), except where tensor would hold more per device
    # than fsdp does while gathering its largest weight.
    assert out["inference_meshes"] == {"fsdp=8": "fsdp=4,tensor=2", "data=2,fsdp=4": "data=2,fsdp=2,tensor=2",
                                       "fsdp=2,tensor=2,expert=2": "fsdp=2,tensor=2,expert=2",
                                       "data=4,fsdp=2": "data=4,tensor=2", "mxfp4 fsdp=2": "tensor=2",
                                       "large routers fsdp=2": "fsdp=2"}, out


def test_a_mesh_that_does_not_fit_is_one_line(capsys):
    from train.cli import main

    assert main(["generate", "--checkpoint", str(ROOT / "no-such-checkpoint"), "--mesh", "fsdp=2"]) == 2
    err = capsys.readouterr().err
    assert "fsdp=2 uses 2 devices, but 1 are available" in err and len(err.strip().splitlines()) == 1
