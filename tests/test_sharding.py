"""Data-parallel sharding over a simulated 4-device CPU mesh gives the single-device result."""
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax, numpy as np, torch
    from jax_bridge import sharding
    from jax_bridge.step import StepConfig, TrainStep
    from torch_model.config import get_preset
    from torch_model.model import GptOssForCausalLM
    assert len(jax.devices()) == 4
    torch.manual_seed(0)
    model = GptOssForCausalLM(get_preset("tiny").replace(n_layers=1, sliding_window=8))
    tokens = np.random.default_rng(0).integers(0, 4096, (1, 8, 17)).astype(np.int32)
    single = TrainStep(model, step_cfg=StepConfig(kernels="xla"))
    s1, m1 = single(single.init_state(), tokens)
    mesh = sharding.make_mesh()
    sharded = TrainStep(model, step_cfg=StepConfig(kernels="xla"), mesh=mesh)
    s4, m4 = sharded(sharded.init_state(), tokens)
    assert len(s4.params["lm_head.weight"].sharding.device_set) == 4
    err = max(float(np.abs(np.asarray(s4.params[n]) - np.asarray(s1.params[n])).max()) for n in s1.params)
    print("loss", float(m1["loss"]), float(m4["loss"]), "max param diff", err)
    assert abs(float(m1["loss"]) - float(m4["loss"])) < 1e-5 and err < 1e-5
""")


def test_data_parallel_step_on_four_simulated_devices_matches_one_device():
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=root, capture_output=True, text=True, timeout=600,
                          env={"PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
