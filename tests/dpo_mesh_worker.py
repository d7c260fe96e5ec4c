"""Runs in a subprocess with 2 simulated CPU devices (see test_dpo_step.py): 3 DPO steps of the
tiny pair rows on one device and on a mesh: full fine-tuning on data=2 (the reference in the
batch, split as the rows are) and LoRA on fsdp=2 (the reference: the adapters off); prints the losses and the largest
relative parameter difference from one device as JSON."""
import json
import os
import sys
import time

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(TESTS), TESTS]

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jax_bridge import sharding  # noqa: E402
from jax_bridge.step import StepConfig, TrainStep  # noqa: E402
from test_dpo_step import ROWS, SIGMOID, tiny_model  # noqa: E402
from torch_model.lora import apply_lora, parse_lora_spec  # noqa: E402

STEPS = 3


def run(lora: bool, mesh_spec: str | None):
    model = tiny_model()
    if lora:
        model = apply_lora(model, parse_lora_spec("r=2,alpha=4,targets=all-linear"))
    mesh = sharding.make_mesh(mesh_spec) if mesh_spec else None
    step = TrainStep(model, step_cfg=StepConfig(kernels="xla", compute_dtype="float32", preference=SIGMOID), mesh=mesh)
    state = step.init_state()
    batch = dict(ROWS)
    if step.reference_in_batch:       # full fine-tuning: the reference is the starting model's
        batch["reference"] = np.asarray(step.answer_logps(state.params, ROWS)) - 0.5 * np.arange(2)[None, None, :]
    losses = []
    for _ in range(STEPS):
        state, metrics = step(state, {k: v[None] for k, v in batch.items()}, 1.0)
        losses.append(float(metrics["loss"]))
    return losses, {n: np.asarray(jax.device_get(v)) for n, v in state.params.items()}


def main() -> dict:
    assert len(jax.devices()) == 2
    out = {}
    for lora, spec in ((False, "data=2"), (True, "fsdp=2")):
        start = time.process_time()
        ref_losses, ref_params = run(lora, None)
        losses, params = run(lora, spec)
        worst = max(float(np.abs(params[n] - p).max() / max(np.abs(p).max(), 1e-12)) for n, p in ref_params.items())
        out[f"{'lora' if lora else 'full'}@{spec}"] = {"losses": losses, "reference": ref_losses, "param_rel_err": worst}
        print(f"{'lora' if lora else 'full'}@{spec}: {time.process_time() - start:.1f} s CPU", file=sys.stderr)
    return out


if __name__ == "__main__":
    print("RESULT " + json.dumps(main()))
