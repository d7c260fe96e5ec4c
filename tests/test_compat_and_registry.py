"""The torchax/torch 2.13 shim and the op registry."""
import jax.numpy as jnp
import pytest
import torch

from jax_bridge import registry, torchax_compat
from jax_bridge.env import get_env


def test_torchax_imports_and_shim_is_gated_on_the_missing_overloads():
    get_env()
    import torchax  # noqa: F401

    missing = "dim_Dimname" not in torch.ops.aten.prod.overloads()
    assert torchax_compat.is_applied() == missing


def test_overload_lookup_is_restored_after_import():
    get_env()
    assert torch._ops.OpOverloadPacket.__getattr__.__name__ == "__getattr__"
    if "dim_Dimname" not in torch.ops.aten.prod.overloads():
        with pytest.raises(AttributeError):
            torch.ops.aten.prod.dim_Dimname


def test_placeholder_only_for_named_tensor_overloads():
    with torchax_compat._tolerate_missing_named_overloads():
        if "dim_Dimname" not in torch.ops.aten.prod.overloads():
            placeholder = torch.ops.aten.prod.dim_Dimname
            assert "dim_Dimname" in repr(placeholder)
            with pytest.raises(RuntimeError):
                placeholder()
        with pytest.raises(AttributeError):
            torch.ops.aten.prod.no_such_overload


def test_rng_state_round_trip_works_with_jax_as_accelerator():
    get_env()
    from torch.testing._utils import freeze_rng_state

    with freeze_rng_state():
        a = torch.rand(3)
    assert torch.rand(3).shape == a.shape


def test_kernel_spec_parsing_and_auto():
    assert registry.parse_kernel_spec("attention=pallas") == {"attention": "pallas", "cross_entropy": "auto",
                                                               "moe": "auto"}
    assert registry.parse_kernel_spec("xla") == {op: "xla" for op in registry.OPS}
    assert registry.resolve("auto", backend="cpu") == {op: "xla" for op in registry.OPS}


@pytest.mark.parametrize("spec,message", [
    ("attention=nope", "unknown implementation attention=nope"),
    ("softmax=xla", "unknown op 'softmax'"),
    ("attention", "expected op=name"),
])
def test_bad_kernel_specs_are_loud(spec, message):
    if spec == "attention":
        spec = "attention,moe=xla"
    with pytest.raises(registry.KernelError, match=message):
        registry.resolve(spec, backend="cpu")


def test_kernel_that_cannot_run_on_backend_is_an_error_not_a_fallback():
    with pytest.raises(registry.KernelError, match="cannot run on backend 'gpu'"):
        registry.resolve("attention=splash", backend="gpu")


def test_user_registered_implementation_is_routed_into_the_model():
    from pallas_kernels.attention import attention_reference

    calls = []

    def mine(q, k, v, sinks, *, sliding_window, scale):
        calls.append((q.shape, sliding_window))
        return attention_reference(q, k, v, sinks, sliding_window=sliding_window, scale=scale)

    registry.register_implementation("attention", "test-mine", mine)
    try:
        from jax_bridge.step import StepConfig, TrainStep
        from torch_model.config import get_preset
        from torch_model.model import GptOssForCausalLM

        model = GptOssForCausalLM(get_preset("tiny").replace(n_layers=2, sliding_window=4))
        step = TrainStep(model, step_cfg=StepConfig(kernels="attention=test-mine,cross_entropy=xla,moe=xla"))
        tokens = jnp.zeros((1, 2, 9), jnp.int32)
        step(step.init_state(), tokens)
        assert [w for _, w in calls] == [4, 0]          # one sliding layer, one full layer, traced once
    finally:
        registry._TABLE["attention"].pop("test-mine")


def test_registering_for_unknown_op_fails():
    with pytest.raises(registry.KernelError, match="unknown op"):
        registry.register_implementation("softmax", "x", lambda *a: None)
