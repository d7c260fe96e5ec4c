"""--init-from a released-layout directory: the train state made slice by slice from the shards on
8 simulated devices (two processes x 4; fsdp=4, expert=2, scanned layers) equals a full load, each
process reading about half of the bytes; an expert count the mesh cannot split is refused clearly."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_mxfp4 import RELEASED, write_released
from tests.test_multihost import free_port, outputs_of
from tests.worker_env import worker_env

ROOT = Path(__file__).resolve().parents[1]
WORKER = str(ROOT / "tests" / "hf_init_worker.py")
# 4 layers: two scanned (sliding, full) periods; 4 experts: the expert axis splits them; hidden
# 160 = 5 MXFP4 blocks, so fsdp=4 cuts gate_up's input inside blocks (as 2880 = 22.5 blocks x 4).
FOUR_EXPERTS = RELEASED.replace(n_layers=4, n_experts=4, d_model=160,
                                layer_types=["sliding_attention", "full_attention"] * 2)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("init_from_hf")
    write_released(root / "four", FOUR_EXPERTS, seed=1)
    write_released(root / "three", RELEASED, seed=2)
    return root


def results(output: str) -> list[dict]:
    line = next(l for l in output.splitlines() if l.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def test_two_processes_read_half_each_and_build_the_state_of_a_full_load(dirs):
    """Two processes x 4 simulated devices = one 8-device mesh fsdp=4, expert=2."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, WORKER, "4", f"{dirs / 'four'}@fsdp=4,expert=2",
                               f"{dirs / 'three'}@fsdp=4,expert=2", "--cluster", f"127.0.0.1:{port},2,{i}"], cwd=ROOT, env=worker_env(4),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outputs = outputs_of(procs)
    reports = [results(out) for out in outputs]
    assert all(three == {"refused": "mesh expert=2 must divide the number of experts (3)"} for _, three in reports)
    for r, _ in reports:
        assert r["mismatched"] == [], r
        share = r["bytes_requested"] / r["stored_bytes"]
        print(f"process {r['process']}: read {r['bytes_requested']:,} of {r['stored_bytes']:,} bytes ({share:.1%})")
        assert 0.4 < share < 0.65, r     # half, plus the small replicated tensors and block-covering reads
