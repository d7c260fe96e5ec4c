"""The torchax/torch 2.13 shim and its faster argument walks, float32 sums of broadcast gradients, the op registry and its op contracts."""
import inspect
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jax_bridge import accumulation, aten_overrides, registry, torchax_compat
from jax_bridge.env import get_env
from jax_bridge import op_contracts
from jax_bridge.op_contracts import CONTRACTS, REQUIRED
from pallas_kernels.attention import attention_reference
from pallas_kernels.moe import moe_experts_reference


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


def test_torchax_walks_op_arguments_as_torchs_pytree_does():
    """jax_bridge/torchax_pytree.py: tuples, lists and dicts walked directly, every other node type
    of torch's pytree (namedtuple, torch.Size, torch.return_types, OrderedDict, deque) handed to
    torch: the same leaves, specs and mapped trees, node type for node type."""
    import collections
    import torch.utils._pytree as torch_pytree

    from jax_bridge import torchax_pytree as fast

    get_env()
    import torchax.tensor

    assert torchax.tensor.torch_pytree.tree_map_only is fast.tree_map_only
    Pair = collections.namedtuple("Pair", "a b")
    t = torch.ones(2)
    trees = [t, None, 3, (t, [1, 2.5, None], {"z": t, "a": (slice(0, 2), torch.float32)}), [],
             (torch.Size([2, 3]), Pair(t, [t, 4]), torch.max(torch.ones(2, 3), dim=1)),
             collections.OrderedDict(b=t, a=[t]), {"q": collections.deque([t, 1])}, ((), {}, [[]])]
    double = lambda x: x * 2
    for tree in trees:
        assert all(a is b for a, b in zip(fast.tree_leaves(tree), torch_pytree.tree_leaves(tree), strict=True))
        leaves, spec = fast.tree_flatten(tree)
        want_leaves, want_spec = torch_pytree.tree_flatten(tree)
        assert spec == want_spec and fast.tree_flatten(tree)[1] == want_spec
        assert len(leaves) == len(want_leaves) and all(a is b for a, b in zip(leaves, want_leaves))
        for mapped, want in [(fast.tree_map_only(torch.Tensor, double, tree),
                              torch_pytree.tree_map_only(torch.Tensor, double, tree)),
                             (fast.tree_map(lambda x: ("leaf", x), tree), torch_pytree.tree_map(lambda x: ("leaf", x), tree))]:
            assert torch_pytree.tree_flatten(mapped)[1] == torch_pytree.tree_flatten(want)[1]
            got_leaves, want_leaves = torch_pytree.tree_leaves(mapped), torch_pytree.tree_leaves(want)
            assert len(got_leaves) == len(want_leaves)
            for a, b in zip(got_leaves, want_leaves):
                assert type(a) is type(b) and (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b)


def test_rng_state_round_trip_works_with_jax_as_accelerator():
    get_env()
    from torch.testing._utils import freeze_rng_state

    with freeze_rng_state():
        a = torch.rand(3)
    assert torch.rand(3).shape == a.shape


def test_broadcast_gradients_of_narrow_floats_sum_in_float32():
    """A bf16 parameter broadcast over 70,000 elements (implicitly, as torchax's elementwise ops do,
    and through broadcast_to): its gradient is the float32 sum rounded once (70,144, the nearest
    bf16), not the bf16 running sum XLA's CPU backend keeps (8,192)."""
    get_env()
    assert accumulation.installed()
    ones = jnp.ones((70_000,), jnp.bfloat16)
    for broadcast in (lambda a: a * ones, lambda a: jnp.broadcast_to(a, ones.shape) * ones):
        for shape in ((1,), ()):
            grad = jax.jit(jax.grad(lambda a: jnp.sum(broadcast(a).astype(jnp.float32))))(jnp.ones(shape, jnp.bfloat16))
            assert grad.dtype == jnp.bfloat16 and float(grad.reshape(())) == 70_144.0
    exact = jax.jit(lambda a: jax.lax.reduce_sum(a, (0,)))(jnp.arange(8, dtype=jnp.int32))   # other dtypes untouched
    assert int(exact) == 28


def test_embedding_with_a_padding_row_is_torchs_without_a_scatter():
    """The lowering of aten.embedding (jax_bridge/aten_overrides.py): torch's forward (the padding
    row's value looked up) and gradient (none into the padding row), ids repeating and hitting it;
    installed in the env in place of torchax's (whose padding-row scatter XLA mis-partitions on a
    vocab x hidden split table: tests/test_scale_out.py's Gemma on fsdp=2,tensor=2)."""
    env = get_env()
    assert env._ops[torch.ops.aten.embedding.default].is_user_defined
    weight = torch.randn(10, 4, requires_grad=True)
    ids = torch.tensor([[2, 5, 2, 9], [0, 2, 5, 5]])
    cotangent = torch.randn(2, 4, 4)
    for padding_idx in (2, None):
        weight.grad = None
        out = torch.nn.functional.embedding(ids, weight, padding_idx=padding_idx)
        out.backward(cotangent)
        lowered = lambda w: aten_overrides.embedding(w, jnp.asarray(ids.numpy()), -1 if padding_idx is None else padding_idx)  # noqa: E731
        got, vjp = jax.vjp(lowered, jnp.asarray(weight.detach().numpy()))
        np.testing.assert_allclose(np.asarray(got), out.detach().numpy())
        np.testing.assert_allclose(np.asarray(vjp(jnp.asarray(cotangent.numpy()))[0]), weight.grad.numpy(), rtol=1e-6, atol=1e-7)
    assert float(np.abs(weight.grad.numpy()[2]).sum()) > 0        # without a padding row, row 2 has its gradient
    with pytest.raises(NotImplementedError, match="scale_grad_by_freq=True"):
        aten_overrides.embedding(jnp.ones((3, 2)), jnp.zeros((2,), jnp.int32), -1, True)


def test_topk_is_torchs_with_one_top_k_and_no_sort():
    """The lowering of aten.topk (jax_bridge/aten_overrides.py): torch's values and indices (ties,
    another dim, smallest first) with jax.lax.top_k alone; torchax's sorted and argsorted its
    already sorted result again (two sorts, a reverse, a gather: 12 of the 426 ops of a v5e decode
    step). Installed in the env, so a router's torch.topk lowers to it."""
    env = get_env()                 # the torch 2.13 shim first: a bare torchax import fails
    from torchax.ops import jaten

    assert env._ops[torch.ops.aten.topk.default].is_user_defined
    distinct = torch.randn(6, 7, generator=torch.Generator().manual_seed(0))
    ties = torch.tensor([[0.5, 2.0, 2.0, -1.0, 0.3], [1.0, 1.0, 1.0, 1.0, 0.0]])
    for dim, k, largest in ((-1, 2, True), (-1, 3, False), (0, 1, True), (1, 5, True)):
        want = torch.topk(distinct, k, dim=dim, largest=largest)       # torch breaks ties its own way
        values, indices = aten_overrides.topk(jnp.asarray(distinct.numpy()), k, dim, largest)
        np.testing.assert_array_equal(np.asarray(values), want.values.numpy())
        np.testing.assert_array_equal(np.asarray(indices), want.indices.numpy())
        before = jaten._aten_topk(jnp.asarray(ties.numpy()), k, dim, largest)   # torchax's: the same, ties too
        for a, b in zip(aten_overrides.topk(jnp.asarray(ties.numpy()), k, dim, largest), before):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with env:
        jaxpr = jax.make_jaxpr(lambda h: env.t2j_iso(torch.topk(env.j2t_iso(h) * 2.0, 2, dim=-1).indices))(
            jnp.ones((4, 8)))
    text = str(jaxpr)
    assert text.count("top_k[") == 1 and "sort[" not in text, text

    # A router's gradient compares with the chosen indices (no scatter), equal to torchax's (top_k's).
    rng = np.random.default_rng(1)
    for dim, largest in ((-1, True), (0, False)):
        x = jnp.asarray(rng.normal(size=(6, 7)), jnp.float32)
        cotangent = jnp.asarray(rng.normal(size=(6, 3) if dim == -1 else (3, 7)), jnp.float32)
        ours = jax.grad(lambda x: (aten_overrides.topk(x, 3, dim, largest)[0] * cotangent).sum())
        torchax = jax.grad(lambda x: (jaten._aten_topk(x, 3, dim, largest)[0] * cotangent).sum())
        np.testing.assert_array_equal(np.asarray(ours(x)), np.asarray(torchax(x)))
        assert "scatter" not in str(jax.make_jaxpr(ours)(x))


def test_fmod_is_torchs_in_one_op_and_exact_past_2_24():
    """The lowering of aten.fmod (jax_bridge/aten_overrides.py): torch's values for integers of
    both signs (exact past 2^24, where torchax's float32 division was not) and for floats, as one
    `rem` where torchax ran eleven ops; installed in the env."""
    env = get_env()
    assert env._ops[torch.ops.aten.fmod.Scalar].is_user_defined
    ints = torch.tensor([0, 5, 127, 128, 129, -1, -130, 2**24 + 3, 2**30 + 7], dtype=torch.int32)
    floats = torch.tensor([0.5, -2.75, 7.0, 1e6 + 0.25])
    with env:
        for x, other in ((ints, 128), (ints, -7), (floats, 2.5), (ints, torch.tensor(9, dtype=torch.int32))):
            lowered = env.j2t_iso(jnp.asarray(other.numpy())) if isinstance(other, torch.Tensor) else other
            got = env.t2j_iso(torch.fmod(env.j2t_iso(jnp.asarray(x.numpy())), lowered))
            np.testing.assert_array_equal(np.asarray(got), torch.fmod(x, other).numpy())
        jaxpr = str(jax.make_jaxpr(lambda i: env.t2j_iso(torch.fmod(env.j2t_iso(i), 128)))(jnp.arange(4, dtype=jnp.int32)))
    assert jaxpr.count("rem") == 1 and "floor" not in jaxpr and "div" not in jaxpr, jaxpr


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
    """A function without `platform` (written for attention contract v1: unpacked rows) and one
    that takes `platform`, segment ids and an option: both are called, each with what its
    signature accepts."""
    from pallas_kernels.attention import attention_reference

    calls = []

    def mine(q, k, v, sinks, *, sliding_window, scale):
        calls.append(("mine", sliding_window))
        return attention_reference(q, k, v, sinks, sliding_window=sliding_window, scale=scale)

    def aware(q, k, v, sinks, *, sliding_window, scale, platform, segment_ids=None, boost=1.0):
        calls.append(("aware", platform, boost))
        return attention_reference(q, k, v, sinks, sliding_window=sliding_window, scale=scale)

    registry.register_implementation("attention", "test-mine", mine, platforms=("cpu", "tpu"), contract_version=1)
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


# ---- the op contracts (jax_bridge/op_contracts.py) -------------------------------------------------
def test_builtin_implementations_meet_their_ops_current_contract():
    for op, contract in CONTRACTS.items():
        for name, impl in registry.implementations(op).items():
            impl.load()                                   # a ContractError names the one that does not
            assert impl.contract_version is None and impl._plan.version == contract.version, (op, name)
            assert all(impl.takes(k.name) for k in contract.keywords), (op, name)


def test_contract_tables_in_the_docs_equal_the_declaration():
    page = (pathlib.Path(__file__).resolve().parents[1] / op_contracts.DOCS_PAGE).read_text()
    assert op_contracts.with_tables(page) == page, \
        "docs/kernels.md's op-contract tables differ from the declaration: run python -m jax_bridge.op_contracts"


def test_contract_keywords_are_the_torch_ops_trailing_arguments_with_their_defaults():
    """The model's side of each op (torch_model/ops.py) passes exactly the declared keywords."""
    from torch_model.ops import OPS as TORCH_OPS

    for op, contract in CONTRACTS.items():
        arguments = TORCH_OPS[op].default._schema.arguments
        tail = arguments[len(arguments) - len(contract.keywords):]
        assert [a.name for a in tail] == [k.name for k in contract.keywords], op
        assert [a.default_value if a.has_default_value() else REQUIRED for a in tail] == \
            [k.default for k in contract.keywords], op
        if len(arguments) == len(contract.args) + len(contract.keywords):     # not the routed MoE ops
            assert [a.name for a in arguments[:len(contract.args)]] == [a.name for a in contract.args], op


def _attention_v1(q, k, v, sinks, *, sliding_window, scale):
    return attention_reference(q, k, v, sinks, sliding_window=sliding_window, scale=scale)


def _moe_v1(x, group_sizes, gate_up, gate_up_bias, down, down_bias, *, alpha, limit):
    return moe_experts_reference(x, group_sizes, gate_up, gate_up_bias, down, down_bias, alpha=alpha, limit=limit)


def _refusal(op, fn, **kwargs) -> str:
    with pytest.raises(registry.ContractError) as caught:
        registry.register_implementation(op, "test-bad", fn, **kwargs)
    assert "test-bad" not in registry.implementations(op)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"{op}=test-bad does not meet the {op} contract v"), message
    return message


def test_wrong_signatures_are_refused_at_registration_in_one_line():
    def extra_positional(q, k, v, sinks, mask, *, sliding_window, scale, segment_ids=None):
        pass

    def no_scale(q, k, v, sinks, *, sliding_window, segment_ids=None):
        pass

    def three_inputs(q, k, v, *, sliding_window, scale, segment_ids=None):
        pass

    def required_option(hidden, weight, labels, *, ignore_index, block_v):
        pass

    assert "extra required argument(s) mask that the op never passes" in _refusal("attention", extra_positional)
    assert _refusal("attention", no_scale).endswith("v2: lacks keyword(s) scale (v1) that the op passes")
    assert "takes 3 positional argument(s), the op passes 4 (q, k, v, sinks)" in _refusal("attention", three_inputs)
    assert "extra required argument(s) block_v" in _refusal("cross_entropy", required_option)
    assert "claims unknown platform(s) 'cuda' (platforms: cpu, gpu, tpu)" in \
        _refusal("attention", _attention_v1, platforms=("cuda",), contract_version=1)
    assert "versions 1..2, found 3" in _refusal("moe", _moe_v1, contract_version=3)
    assert "versions 1..1, found 2" in _refusal("cached_attention", _attention_v1, contract_version=2)
    # Written for the previous contract, without saying so: refused, with the remedy.
    assert _refusal("moe", _moe_v1) == (
        "moe=test-bad does not meet the moe contract v2: lacks keyword(s) up_shift (v2) that the op passes; if it "
        "was written for v1, register it with contract_version=1: it is then called while up_shift=1.0, and "
        "refused by name otherwise")
    assert "segment_ids (v2)" in _refusal("attention", _attention_v1)
    # A refused registration replaces nothing; a "module:attribute" target is checked when loaded.
    _refusal("attention", three_inputs)
    with pytest.raises(registry.ContractError):
        registry.register_implementation("attention", "xla", three_inputs)
    assert registry.implementations("attention")["xla"].target == "pallas_kernels.attention:attention_xla"
    registry.register_implementation("attention", "test-string", "pallas_kernels.moe:moe_experts_reference")
    try:
        with pytest.raises(registry.ContractError, match=r"^attention=test-string \(pallas_kernels.moe:moe_experts_"
                           r"reference\) does not meet the attention contract v2: extra required argument"):
            registry.resolve("attention=test-string", "cpu")
    finally:
        registry.unregister_implementation("attention", "test-string")


@pytest.fixture
def previous_contract_kernels():
    """attention and moe kernels written for their ops' previous contracts (before segment_ids,
    before up_shift), registered as such; the names of the calls they received."""
    calls = []

    def attention_v1(*args, **kwargs):
        calls.append("attention")
        return _attention_v1(*args, **kwargs)

    def moe_v1(*args, **kwargs):
        calls.append("moe")
        return _moe_v1(*args, **kwargs)

    attention_v1.__signature__ = inspect.signature(_attention_v1)
    moe_v1.__signature__ = inspect.signature(_moe_v1)
    registry.register_implementation("attention", "test-v1", attention_v1, contract_version=1)
    registry.register_implementation("moe", "test-v1", moe_v1, contract_version=1)
    try:
        yield calls
    finally:
        registry.unregister_implementation("attention", "test-v1")
        registry.unregister_implementation("moe", "test-v1")


def test_kernels_written_for_the_previous_contract_run_the_ops_old_behaviour_and_refuse_the_new(
        previous_contract_kernels):
    """Through the registry's adapters (the torch ops' schemas): at the new keyword's neutral value
    the old kernels give the current reference's numbers; another value is refused by name before
    the kernel is called, never a TypeError."""
    calls = previous_contract_kernels
    old = registry._adapters({"attention": "test-v1", "cross_entropy": "xla", "moe": "test-v1"}, "cpu", {})
    new = registry._adapters({"attention": "xla", "cross_entropy": "xla", "moe": "ragged_dot"}, "cpu", {})
    keys = jax.random.split(jax.random.key(0), 8)
    q, k, v = (jax.random.normal(key, shape) for key, shape in zip(keys, [(1, 2, 8, 4), (1, 1, 8, 4), (1, 1, 8, 4)]))
    sinks = jnp.zeros(2)
    np.testing.assert_array_equal(old["attention"](q, k, v, sinks, 3, 0.5), new["attention"](q, k, v, sinks, 3, 0.5))
    segments = jnp.array([[0, 0, 0, 1, 1, 1, 1, 1]])
    with pytest.raises(registry.ContractError, match=r"^attention=test-v1 cannot run segment-masked \(packed\) "
                       r"batches: it was written for attention contract v1, before segment_ids \(v2\).*here: "
                       r"segment_ids given\); choose one of: xla, pallas, splash$"):
        old["attention"](q, k, v, sinks, 3, 0.5, segments)
    with pytest.raises(registry.ContractError, match="attention=test-v1 cannot run segment-masked"):
        registry.check_segments({"attention": "test-v1"})          # what train and plan ask before tracing

    x = jax.random.normal(keys[3], (6, 8))
    experts, weights = jnp.array([[0, 1]] * 3 + [[1, 0]] * 3), jnp.full((6, 2), 0.5)
    gate_up, down = jax.random.normal(keys[4], (2, 8, 4)), jax.random.normal(keys[5], (2, 2, 8))
    stacks = (gate_up, jnp.zeros((2, 4)), down, jnp.zeros((2, 8)))
    np.testing.assert_array_equal(old["moe"](x, experts, weights, *stacks, 1.702, 7.0, 1.0),
                                  new["moe"](x, experts, weights, *stacks, 1.702, 7.0, 1.0))
    assert calls == ["attention", "moe"]
    with pytest.raises(registry.ContractError, match=r"^moe=test-v1 cannot run experts whose activation is not "
                       r"GPT-OSS's .*v1, before up_shift \(v2\), so the op calls it only while up_shift=1.0 \(here: "
                       r"up_shift=0.0\); choose one of: xla, loop, ragged_dot, megablox, pallas$"):   # not decode
        old["moe"](x, experts, weights, *stacks, 1.0, float("inf"), 0.0)
    assert calls == ["attention", "moe"]                           # refused before the kernel ran


def test_a_kernel_with_kwargs_takes_every_keyword_of_the_version_it_was_written_for():
    seen = []

    def catch_all(q, k, v, sinks, **kwargs):
        seen.append(sorted(kwargs))
        return q

    q, ids = jnp.zeros((1, 1, 4, 2)), jnp.zeros((1, 4), jnp.int32)
    try:
        registry.register_implementation("attention", "test-kwargs", catch_all)
        registry.implementations("attention")["test-kwargs"].bind("cpu", {})(q, q, q, q, sliding_window=0, scale=1.0,
                                                                            segment_ids=ids)
        assert seen == [["platform", "scale", "segment_ids", "sliding_window"]]
        registry.register_implementation("attention", "test-kwargs", catch_all, contract_version=1)
        old = registry.implementations("attention")["test-kwargs"].bind("cpu", {})
        old(q, q, q, q, sliding_window=0, scale=1.0, segment_ids=None)
        assert seen[-1] == ["platform", "scale", "sliding_window"]  # omitted at its default, never passed
        with pytest.raises(registry.ContractError, match="written for attention contract v1, before segment_ids"):
            old(q, q, q, q, sliding_window=0, scale=1.0, segment_ids=ids)
    finally:
        registry.unregister_implementation("attention", "test-kwargs")


def test_step_defaults_follow_the_platform():
    """The backend defaults: bf16 compute with float32 master weights on accelerators,
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


def test_index_copy_is_torchs_without_the_negative_wrap():
    """The lowering of aten.index_copy (jax_bridge/aten_overrides.py): torch's values for indices
    in range along any dimension (the KV cache's writes); an index outside [0, size) writes
    nothing, a negative one included (torch raises; torchax wrapped it to the end), and the
    program holds no wrap (no compare with 0); installed in the env."""
    env = get_env()
    assert env._ops[torch.ops.aten.index_copy.default].is_user_defined
    x = torch.arange(2 * 5 * 3, dtype=torch.float32).reshape(2, 5, 3)
    with env:
        def lowered(dim, index, source):
            return np.asarray(env.t2j_iso(env.j2t_iso(jnp.asarray(x.numpy())).index_copy(
                dim, env.j2t_iso(jnp.asarray(index)), env.j2t_iso(jnp.asarray(source.numpy())))))

        for dim, index in ((1, [4, 0]), (2, [1]), (-1, [2, 0]), (0, [1])):
            shape = list(x.shape)
            shape[dim] = len(index)
            source = -torch.ones(shape)
            expected = x.index_copy(dim, torch.tensor(index), source).numpy()
            np.testing.assert_array_equal(lowered(dim, np.array(index, np.int32), source), expected)
        np.testing.assert_array_equal(lowered(1, np.array([-1, 5], np.int32), -torch.ones(2, 2, 3)), x.numpy())
        jaxpr = str(jax.make_jaxpr(lambda i: env.t2j_iso(env.j2t_iso(jnp.zeros((2, 8))).index_copy(
            1, env.j2t_iso(i), env.j2t_iso(jnp.ones((2, 1))))))(jnp.zeros((1,), jnp.int32)))
    assert "lt" not in jaxpr.split() and "select_n" not in jaxpr, jaxpr


def test_the_run_header_marks_an_op_the_model_never_calls():
    """A module's own experts never reach the `moe` op: the header says its implementation runs
    nothing, and an uncalled Pallas choice does not make the run read as interpreted Pallas."""
    kernels = {"attention": "xla", "cross_entropy": "xla", "moe": "pallas"}
    assert registry.describe(kernels, "cpu") == \
        "attention=xla, cross_entropy=xla, moe=pallas on cpu (Pallas interpreted on CPU)"
    assert registry.describe(kernels, "cpu", {"moe": "its experts are its own code"}) == \
        "attention=xla, cross_entropy=xla, moe=pallas (not called) on cpu"
