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
    assert registry.resolve("auto", "cpu") == {"attention": "xla", "cross_entropy": "xla", "moe": "loop"}


@pytest.mark.parametrize("platform", registry.PLATFORMS)
def test_auto_picks_per_op_only_implementations_that_run_on_the_platform(platform):
    resolved = registry.resolve("auto", platform)
    for op, name in resolved.items():
        assert platform in registry.implementations(op)[name].platforms, (op, name)
    expected = {"cpu": {"attention": "xla", "cross_entropy": "xla", "moe": "loop"},   # CPU's fastest GEMMs
                "gpu": {"attention": "pallas", "cross_entropy": "pallas", "moe": "xla"},   # no GPU MoE kernel
                "tpu": {"attention": "pallas", "cross_entropy": "pallas", "moe": "pallas"}}[platform]
    assert resolved == expected


def test_kernel_options_parse_and_are_checked_against_the_implementation():
    opts = registry.parse_kernel_options("attention.pallas.block_q=16,attention.pallas.block_kv=32,"
                                         "moe.pallas.interpret=tpu")
    assert opts == {"attention": {"pallas": {"block_q": 16, "block_kv": 32}}, "moe": {"pallas": {"interpret": "tpu"}}}
    registry.check_options(opts)
    registry.check_options({"attention": {"splash": {"block_kv_dkv": 256}}})   # splash takes its eight tiles
    with pytest.raises(registry.KernelError, match="attention.xla.block_q not accepted by attention=xla"):
        registry.check_options("attention.xla.block_q=16")
    with pytest.raises(registry.KernelError, match="cross_entropy.pallas.block_q .*options: block_compute, block_n, block_v, interpret, vmem_limit_bytes$"):
        registry.check_options("cross_entropy.pallas.block_q=16")
    with pytest.raises(registry.KernelError, match="attention.pallas.platform"):
        registry.check_options("attention.pallas.platform=tpu")
    with pytest.raises(registry.KernelError, match="expected op.implementation.option=value"):
        registry.parse_kernel_options("attention.block_q=16")


@pytest.mark.parametrize("spec,message", [
    ("attention=nope", "unknown implementation attention=nope"),
    ("softmax=xla", "unknown op 'softmax'"),
    ("attention", "expected op=name"),
])
def test_bad_kernel_specs_are_loud(spec, message):
    if spec == "attention":
        spec = "attention,moe=xla"
    with pytest.raises(registry.KernelError, match=message):
        registry.resolve(spec, "cpu")


def test_kernel_that_cannot_run_on_the_platform_is_an_error_not_a_fallback():
    with pytest.raises(registry.KernelError, match="cannot run on platform 'gpu'"):
        registry.resolve("attention=splash", "gpu")
    with pytest.raises(registry.KernelError, match="cannot run on platform 'gpu'"):
        registry.resolve("moe=pallas", "gpu")


def test_user_registered_implementations_are_routed_into_the_model_with_or_without_platform():
    """The README's example (a function without `platform`) and one that takes `platform` and
    an option: both are called, each with what its signature accepts."""
    from pallas_kernels.attention import attention_reference

    calls = []

    def mine(q, k, v, sinks, *, sliding_window, scale):
        calls.append(("mine", sliding_window))
        return attention_reference(q, k, v, sinks, sliding_window=sliding_window, scale=scale)

    def aware(q, k, v, sinks, *, sliding_window, scale, platform, boost=1.0):
        calls.append(("aware", platform, boost))
        return attention_reference(q, k, v, sinks, sliding_window=sliding_window, scale=scale)

    registry.register_implementation("attention", "test-mine", mine, platforms=("cpu", "tpu"))
    registry.register_implementation("attention", "test-aware", aware)
    try:
        from jax_bridge.step import StepConfig, TrainStep
        from torch_model.config import get_preset
        from torch_model.model import GptOssForCausalLM

        model = GptOssForCausalLM(get_preset("tiny").replace(n_layers=2, sliding_window=4))
        tokens = jnp.zeros((1, 2, 9), jnp.int32)
        step = TrainStep(model, step_cfg=StepConfig(kernels="attention=test-mine,cross_entropy=xla,moe=xla"))
        step(step.init_state(), tokens)
        assert calls == [("mine", 4), ("mine", 0)]          # one sliding layer, one full layer, traced once
        calls.clear()
        step = TrainStep(model, step_cfg=StepConfig(kernels="attention=test-aware,cross_entropy=xla,moe=xla",
                                                    kernel_options="attention.test-aware.boost=2"))
        step.evaluate(step.init_state().params, tokens[0])
        assert calls == [("aware", "cpu", 2)] * 2
    finally:
        registry.unregister_implementation("attention", "test-mine")
        registry.unregister_implementation("attention", "test-aware")


def test_registering_for_unknown_op_fails():
    with pytest.raises(registry.KernelError, match="unknown op"):
        registry.register_implementation("softmax", "x", lambda *a: None)


def test_step_defaults_follow_the_platform():
    """Issue 12's backend defaults: bf16 compute with float32 master weights on accelerators,
    float32 on CPU; the model's own matmuls at 'highest' only where compute is float32."""
    from jax_bridge.step import StepConfig

    cpu, gpu, tpu = (StepConfig(platform=p) for p in ("cpu", "gpu", "tpu"))
    assert (cpu.compute_dtype, cpu.matmul_precision) == ("float32", "highest")
    assert (gpu.compute_dtype, gpu.matmul_precision) == ("bfloat16", "default")
    assert (tpu.compute_dtype, tpu.matmul_precision) == ("bfloat16", "default")
    assert StepConfig(platform="tpu", compute_dtype="float32").matmul_precision == "highest"
    assert StepConfig().platform == "cpu"          # this host (tests run with JAX_PLATFORMS=cpu)
    with pytest.raises(ValueError, match="unknown platform 'cuda'"):
        StepConfig(platform="cuda")
    with pytest.raises(ValueError, match="matmul_precision"):
        StepConfig(matmul_precision="bf16")


def test_kernels_never_ask_jax_for_the_backend():
    """The target platform is an input (pallas_kernels/platform.py); only host_platform(), called
    once outside tracing, may read the host's backend."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1] / "pallas_kernels"
    for path in root.glob("*.py"):
        text = path.read_text()
        uses = text.count("jax.default_backend()")
        allowed = {"platform.py": 2, "memory.py": 1}.get(path.name, 0)   # host_platform (+ docstring); a printout
        assert uses <= allowed, f"{path.name} reads jax.default_backend()"
