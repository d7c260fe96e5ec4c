"""Scanned decoder layers: the stacked layout round-trips, remat lowers the memory the compiler
plans, and the program no longer grows with depth. (That the scan trains exactly like the layer
loop, with each remat policy, is checked on meshes in test_scale_out.py.)"""
import jax
import numpy as np
import pytest
import torch

from jax_bridge.layer_stack import LayerLayout, layer_period
from jax_bridge.step import StepConfig, TrainStep
from torch_model.config import get_preset
from torch_model.model import GptOssForCausalLM

SMALL = dict(d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, n_experts=4, expert_dim=32, vocab_size=512,
             sliding_window=8)


def small_model(n_layers=4, **changes):
    torch.manual_seed(0)
    return GptOssForCausalLM(get_preset("tiny").replace(n_layers=n_layers, **{**SMALL, **changes}))


def test_layer_period_is_the_repeating_pattern_of_layer_types():
    assert layer_period(["sliding_attention", "full_attention"] * 3) == 2
    assert layer_period(["full_attention"] * 5) == 1
    assert layer_period(["sliding_attention", "sliding_attention", "full_attention"] * 2) == 3
    assert layer_period(["sliding_attention", "full_attention", "full_attention"]) == 3


def test_stacking_round_trips_names_and_values():
    layout = LayerLayout(n_layers=4, stacked=True, groups=((0, 2, 2),))     # period 2, twice
    params = {f"model.layers.{i}.mlp.router.weight": np.full((3, 2), i, np.float32) for i in range(4)}
    params["lm_head.weight"] = np.ones((5, 2), np.float32)
    stacked = layout.stack(params)
    assert sorted(stacked) == ["lm_head.weight", "model.layers.stack0.mlp.router.weight",
                               "model.layers.stack1.mlp.router.weight"]
    assert stacked["model.layers.stack1.mlp.router.weight"][:, 0, 0].tolist() == [1, 3]    # layers 1 and 3
    back = layout.unstack(stacked)
    assert sorted(back) == sorted(params) and all(np.array_equal(back[n], params[n]) for n in params)
    cfg = get_preset("tiny").replace(n_layers=4)
    assert LayerLayout.from_tag(layout.tag, cfg) == layout
    assert LayerLayout.from_tag("per_layer", cfg).unstack(stacked) == stacked
    with pytest.raises(ValueError, match="unknown layer layout"):
        LayerLayout.from_tag("scrambled", cfg)


def grads_temp_bytes(model, remat: str, seq: int = 128) -> int:
    step = TrainStep(model, step_cfg=StepConfig(kernels="xla", scan_layers=True, remat=remat))
    params = jax.eval_shape(lambda: step.init_state().params)
    tokens = jax.ShapeDtypeStruct((4, seq + 1), np.int32)
    return jax.jit(step._grads).lower(params, tokens).compile().memory_analysis().temp_size_in_bytes


def test_remat_policies_lower_the_planned_activation_memory():
    model = small_model(n_layers=4)
    none, matmuls, full = (grads_temp_bytes(model, r) for r in ("none", "save-matmuls", "full"))
    assert full < matmuls < none, f"temporaries: none {none}, save-matmuls {matmuls}, full {full}"


def program_size(n_layers: int, scan: bool) -> int:
    step = TrainStep(small_model(n_layers), step_cfg=StepConfig(kernels="xla", scan_layers=scan))
    state = jax.eval_shape(step.init_state)
    tokens = jax.ShapeDtypeStruct((1, 2, 17), np.int32)
    return len(jax.jit(step._step).lower(state, step.compute_copy_spec(state.params), tokens, np.float32(1)).as_text())


def test_scanned_program_does_not_grow_with_depth():
    assert program_size(6, scan=True) < 1.15 * program_size(2, scan=True)
    assert program_size(6, scan=False) > 2 * program_size(2, scan=False)


def test_scanned_bf16_layers_recompute_float32_intermediates_instead_of_stacking_them():
    """A scan stacks every value its backward reads; under bf16 compute its layers save none of
    the float32 values elementwise ops make (norms, softmax) and recompute them from what they
    save (layer_stack.saves_all_but_float32_elementwise): the same loss and gradients as saving
    them all, in less memory."""
    from jax_bridge.layer_stack import layered_forward

    model = small_model(n_layers=4)
    step = TrainStep(model, step_cfg=StepConfig(kernels="xla", scan_layers=True, compute_dtype="bfloat16"))
    params = step.init_state().params
    tokens = np.random.default_rng(0).integers(0, 512, (4, 129)).astype(np.int32)
    # Bit for bit when XLA rounds every bf16 op as written: by default it may keep a fusion's
    # intermediates in float32, and where fusions begin and end differs between the two programs.
    exact = {"xla_allow_excess_precision": False}
    compiled = {"recomputed": jax.jit(step._grads).lower(params, tokens).compile(exact)}
    step.forward = layered_forward(model, step.layer_layout)       # every value saved, as before
    compiled["saved"] = jax.jit(step._grads).lower(params, tokens).compile(exact)
    temps = {k: c.memory_analysis().temp_size_in_bytes for k, c in compiled.items()}
    ((loss, _), grads), ((want_loss, _), want_grads) = (compiled[k](params, tokens) for k in ("recomputed", "saved"))
    assert float(loss) == float(want_loss)
    for name, g in grads.items():
        np.testing.assert_array_equal(np.asarray(g), np.asarray(want_grads[name]), err_msg=name)
    assert temps["recomputed"] < 0.9 * temps["saved"], temps


def test_the_scanned_policy_recomputes_float32_elementwise_values_and_the_moe_row_gather_only():
    """Saved: the compute dtype's values, reductions, products and every custom call that
    computes (a kernel, the MoE's weighted sum of rows); recomputed: float32 elementwise values and
    the MoE dispatch's gather of rows (a custom-VJP function that only moves data)."""
    import jax.numpy as jnp

    from jax_bridge import moe_dispatch
    from jax_bridge.layer_stack import saves_all_but_float32_elementwise as saves

    def saved(fn, *args):
        """{primitive name: whether the policy saves its output} over fn's top-level equations."""
        return {e.primitive.name: saves(e.primitive, *(v.aval for v in e.invars), **e.params)
                for e in jax.make_jaxpr(fn)(*args).eqns}

    rows, order, copies = jnp.ones((4, 8), jnp.bfloat16), jnp.arange(8), jnp.arange(8).reshape(4, 2)
    assert saved(moe_dispatch.sort_rows, rows, order, copies) == {"custom_vjp_call": False}
    weights = jnp.ones((4, 2), jnp.float32)
    combined = saved(lambda *a: moe_dispatch.combine_rows(*a), jnp.ones((8, 8), jnp.bfloat16), weights, order,
                     copies, weights.reshape(-1))
    assert combined == {"custom_vjp_call": True}
    x = jnp.ones((4, 8), jnp.bfloat16)
    assert saved(lambda x: (x.astype(jnp.float32) * 2).sum(), x) == {"convert_element_type": False, "mul": False,
                                                                     "reduce_sum": True}
    assert saved(lambda x: x * 2 @ x.T, x) == {"mul": True, "transpose": True, "dot_general": True}
