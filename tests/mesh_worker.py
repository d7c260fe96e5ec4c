"""Runs in a subprocess with 8 simulated CPU devices (see test_scale_out.py): trains a reduced
`tiny` for 5 steps on one device and on several meshes, and prints what the tests check as JSON.

usage: python tests/mesh_worker.py KERNELS@MESH[@REMAT] ...   e.g. xla@data=2,fsdp=4 pallas@fsdp=2,tensor=2,expert=2
A mesh of fewer than 8 devices (fsdp=2,expert=2) runs on the first ones.
The one-device reference runs the plain layer loop; the mesh runs scan the layers.
"""
import json
import math
import os
import sys
import time

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from jax_bridge import sharding  # noqa: E402
from jax_bridge.step import StepConfig, TrainStep  # noqa: E402
from torch_model.config import get_preset  # noqa: E402
from torch_model.model import GptOssForCausalLM  # noqa: E402

STEPS = 5
# 4 layers (two scanned (sliding, full) periods), 8 experts, 4/2 heads: every axis can split.
CONFIG = dict(n_layers=4, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, n_experts=8, experts_per_token=2,
              expert_dim=32, vocab_size=512, sliding_window=8, router_aux_loss_coef=0.01, router_z_loss_coef=1e-3)
KERNELS = {"xla": "xla", "pallas": "attention=pallas,cross_entropy=pallas,moe=pallas"}
# A run named `<family>:<kernels>@<mesh>` trains that transformers family (tests/transformers_configs.py:
# CONFIGS, else the sweep's `family_config`) instead, against its own one-device reference.


def train(model, tokens, kernels: str, mesh, scan: bool = True, remat: str = "none"):
    start = time.process_time()
    step = TrainStep(model, step_cfg=StepConfig(kernels=kernels, scan_layers=scan, remat=remat), mesh=mesh)
    state, losses = step.init_state(), []
    for batch in tokens:
        state, metrics = step(state, batch, 1.0)
        losses.append(float(metrics["loss"]))
    print(f"{kernels} on {sharding.describe(mesh) if mesh else 'one device'}: {time.process_time() - start:.1f} s CPU",
          file=sys.stderr)
    return step, state, losses


def reference(family: str | None):
    """(model, tokens, one-device losses, parameters) of our reduced `tiny` (family None) or of a
    transformers family."""
    torch.manual_seed(0)
    if family is None:
        model = GptOssForCausalLM(get_preset("tiny").replace(**CONFIG))
    else:
        from tests.transformers_configs import CONFIGS, family_config
        from torch_model import transformers_lm

        model = (transformers_lm.build(CONFIGS[family]()) if family in CONFIGS
                 else transformers_lm.TransformersSpec(family_config(family)).build())
    tokens = np.random.default_rng(0).integers(0, model.cfg.vocab_size, (STEPS, 1, 8, 17)).astype(np.int32)
    _, ref_state, ref_losses = train(model, tokens, "xla", None, scan=False)
    return model, tokens, ref_losses, {n: np.asarray(v, np.float64) for n, v in ref_state.params.items()}


def main(runs: list[str]) -> dict:
    assert len(jax.devices()) == 8
    references = {}
    out = {"meshes": {}, "references": {}}
    for run in runs:
        family, _, run_spec = run.rpartition(":")
        kernels, spec, *remat = run_spec.split("@")
        if family not in references:
            references[family] = reference(family or None)
        model, tokens, ref_losses, ref_params = references[family]
        out["references"][family] = ref_losses
        # A mesh smaller than the 8 devices (fsdp=2,expert=2) takes the first devices, as a
        # 4-chip slice would be all its host has.
        size = math.prod(int(part.split("=")[1]) for part in spec.split(","))
        mesh = sharding.make_mesh(spec, devices=jax.devices()[:size])
        step, state, losses = train(model, tokens, KERNELS[kernels], mesh, remat=remat[0] if remat else "none")
        errors = {n: float(np.linalg.norm(np.asarray(v, np.float64) - ref_params[n]) / np.linalg.norm(ref_params[n]))
                  for n, v in step.layer_params(state.params).items()}
        held = sharding.bytes_per_device(state)
        predicted = sum(leaf.nbytes // _split(s.spec, mesh) for leaf, s in
                        zip(jax.tree.leaves(state), jax.tree.leaves(step.state_shardings(state))))
        out["meshes"][run] = {
            "losses": losses, "param_rel_err": errors, "mesh_devices": mesh.size,
            "held_bytes": sorted(set(held.values())), "devices_holding": len(held), "predicted_bytes": predicted,
            "total_bytes": sum(leaf.nbytes for leaf in jax.tree.leaves(state)),
            "specs_match_rules": all(a.sharding.is_equivalent_to(s, a.ndim) for a, s in
                                     zip(jax.tree.leaves(state), jax.tree.leaves(step.state_shardings(state)))),
        }
    out["update_memory"] = update_memory()
    out["lora_step_memory"] = lora_step_memory()
    return out


def update_memory() -> dict:
    """Temporaries of the optimizer update compiled for an 8-way fsdp mesh, for a model with
    stacks of 4 layers x 8 experts (a batch of matrices that the mesh must spread whole for
    Muon), beside the parameter bytes each device holds."""
    mesh = sharding.make_mesh("fsdp=8")
    with torch.device("meta"):
        model = GptOssForCausalLM(get_preset("tiny").replace(n_layers=8, d_model=256, expert_dim=512))
    step = TrainStep(model, step_cfg=StepConfig(kernels="xla", scan_layers=True), mesh=mesh)
    state = step.abstract_state()
    lr = jax.ShapeDtypeStruct((), np.float32)
    compiled = jax.jit(step.update).lower(state.params, state.params, state.opt_state, lr).compile()
    per_device = sum(np.prod(a.sharding.shard_shape(a.shape)) * 4 for a in jax.tree.leaves(state.params))
    return {"temp_bytes": compiled.memory_analysis().temp_size_in_bytes, "param_bytes_per_device": int(per_device)}


def lora_step_memory() -> dict:
    """Temporaries of a LoRA step compiled on fsdp=2 (2 layers of the small released directory's
    shapes: hidden 2880, 4 experts of width 2880, 1.6 GiB of frozen float32 weights; built on
    `meta`, compiled only) beside the frozen bytes (scripts/mesh_temporaries.py step)."""
    from torch_model.lora import apply_lora, parse_lora_spec

    cfg = get_preset("tiny").replace(n_layers=2, d_model=2880, n_heads=64, n_kv_heads=8, head_dim=64, n_experts=4,
                                     experts_per_token=2, expert_dim=2880, vocab_size=32000, sliding_window=128,
                                     max_seq_len=256)
    with torch.device("meta"):
        model = apply_lora(GptOssForCausalLM(cfg), parse_lora_spec("r=8,alpha=16"))
    step = TrainStep(model, step_cfg=StepConfig(scan_layers=True, compute_dtype="float32"),
                     mesh=sharding.make_mesh("fsdp=2", devices=jax.devices()[:2]))
    state = step.abstract_state()
    step.frozen = step.abstract_frozen()
    compiled = step.lower(state, np.zeros((1, 2, 65), np.int32)).compile()
    frozen = sum(math.prod(a.shape) * a.dtype.itemsize for a in step.frozen.values())
    # The validation pass the trainer runs beside it: a program of its own, over the same mesh.
    from train.evaluation.validation import Evaluator

    tokens = np.zeros((2, 65), np.int32)
    evaluator = Evaluator(step, [tokens], np.ones(cfg.vocab_size, np.int64))
    validation = evaluator.lower(step.full_params(state.params), tokens).compile()
    return {"temp_bytes": compiled.memory_analysis().temp_size_in_bytes, "frozen_bytes": frozen,
            "validation_temp_bytes": validation.memory_analysis().temp_size_in_bytes}


def _split(spec, mesh) -> int:
    axes = [a for part in spec if part for a in (part if isinstance(part, tuple) else (part,))]
    return int(np.prod([mesh.shape[a] for a in axes])) if axes else 1


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(sys.argv[1:])))
