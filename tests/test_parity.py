"""The parity suite: every registered kernel set matches eager PyTorch in float32 and bfloat16,
a planted kernel bug fails the suite and is named by parameter, and the CLI writes JSON and
exits non-zero on failure.

The model is `tiny` cut to 2 layers (one sliding, one full attention layer), batch 2 x 32 tokens:
compiling each lowered run dominates the time. The xla set, the planted bug and the CLI run by
default in well under a minute; the matrix of every other registered implementation (Pallas in
interpret mode on CPU) is marked slow.
"""
import argparse
import contextlib
import functools
import io
import json

import jax
import pytest

from jax_bridge import registry
from parity import compare, tolerances
from parity.run import add_arguments, default_kernel_sets, kernel_label, parse_kernel_sets, run, run_parity
from torch_model import config
from train.errors import UserError

BATCH, SEQ = 2, 32
SMALL = config.get_preset("tiny").replace(n_layers=2, sliding_window=16)


def parse(argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def run_cli(argv, tmp_path_factory):
    """run(args) on the small tiny preset; returns (exit code, JSON, printed table)."""
    out = tmp_path_factory.mktemp("parity") / "parity.json"
    stdout = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(stdout):
        mp.setitem(config.PRESETS, "tiny", SMALL)
        code = run(parse(["--preset", "tiny", "--batch", str(BATCH), "--seq-len", str(SEQ), "--json", str(out), *argv]))
    return code, json.loads(out.read_text()), stdout.getvalue()


def parameter_names():
    from torch_model.model import GptOssForCausalLM

    return [n for n, _ in GptOssForCausalLM(SMALL).named_parameters()]


# ---- a planted bug: attention whose sink gradient is doubled ---------------------------------
BUGGY = "test_sinks_grad_doubled"


def attention_with_doubled_sink_grad(q, k, v, sinks, *, sliding_window, scale):
    from pallas_kernels.attention import attention_reference

    ref = functools.partial(attention_reference, sliding_window=sliding_window, scale=scale)

    @jax.custom_vjp
    def attn(q, k, v, sinks):
        return ref(q, k, v, sinks)

    def fwd(q, k, v, sinks):
        return ref(q, k, v, sinks), (q, k, v, sinks)

    def bwd(res, g):
        dq, dk, dv, dsinks = jax.vjp(ref, *res)[1](g)
        return dq, dk, dv, 2 * dsinks

    attn.defvjp(fwd, bwd)
    return attn(q, k, v, sinks)


@contextlib.contextmanager
def registered(op, name, fn):
    registry.register_implementation(op, name, fn, description="test only")
    try:
        yield f"{op}={name}"
    finally:
        registry._TABLE[op].pop(name, None)   # no public unregister: tests clean up after themselves


# ---- cheap checks: kernel sets, input errors, metrics ----------------------------------------
def test_default_kernel_sets_cover_every_registered_implementation_once():
    sets, skipped = default_kernel_sets("cpu")
    assert sets[0] == {op: "xla" for op in registry.OPS}
    covered = [(op, s[op]) for s in sets[1:] for op in registry.OPS if s[op] != "xla"]
    assert all(sum(v != "xla" for v in s.values()) == 1 for s in sets[1:]), "one non-xla op per set"
    expected = [(op, name) for op in registry.OPS for name in registry.implementations(op) if name != "xla"]
    assert sorted(covered) == sorted(expected) and not skipped


def test_kernel_set_strings_name_ops_and_leave_the_rest_at_xla():
    assert parse_kernel_sets("attention=pallas") == [{"attention": "pallas", "cross_entropy": "xla", "moe": "xla"}]
    sets = parse_kernel_sets(["xla; moe=megablox", "cross_entropy=pallas,moe=pallas"])
    assert [kernel_label(s) for s in sets] == ["attention=xla,cross_entropy=xla,moe=xla",
                                               "attention=xla,cross_entropy=xla,moe=megablox",
                                               "attention=xla,cross_entropy=pallas,moe=pallas"]


@pytest.mark.parametrize("spec, message", [("attention=nope", "unknown implementation attention=nope"),
                                           ("flash=xla", "unknown op 'flash'"),
                                           ("attention=pallas,moe", "expected op=name")])
def test_bad_kernel_sets_are_one_line_user_errors(spec, message):
    with pytest.raises(UserError, match=message) as err:
        run_parity(SMALL, kernel_sets=[spec], seq_len=8)
    assert "\n" not in str(err.value)


def test_unknown_preset_and_dtype_are_user_errors():
    with pytest.raises(UserError, match="unknown preset 'nope'"):
        run(parse(["--preset", "nope"]))
    with pytest.raises(UserError, match="float16"):
        run_parity(SMALL, kernel_sets=["xla"], dtypes=("float16",))


def test_metrics_of_identical_and_perturbed_tensors():
    import numpy as np

    x = np.random.default_rng(0).normal(size=(4, 50)).astype(np.float32)
    same = compare.logits_metrics(x, x)
    assert same["max_abs"] == 0 and same["rel"] == 0 and same["top1"] == 1 and abs(same["kl"]) < 1e-15
    flipped = compare.tensor_metrics(-x, x)
    assert flipped["rel"] == pytest.approx(2.0) and flipped["cos"] == pytest.approx(-1.0)
    # a near-tie closer than one bfloat16 ulp counts as agreement in `top1`, not in `top1_exact`
    eager = np.array([[1.0, 1.001, -3.0]])
    lowered = np.array([[1.0, 0.999, -3.0]], dtype=jax.numpy.bfloat16)
    m = compare.logits_metrics(lowered, eager)
    assert m["top1_exact"] == 0 and m["top1"] == 1
    routing = compare.routing_metrics(np.array([[0, 1], [2, 3]]), np.array([[1, 0], [2, 4]]),
                                      np.zeros((2, 5)), np.zeros((2, 5)))
    assert routing["mismatch"] == 0.5            # expert order within the top-k is ignored


def test_tolerances_are_stated_for_every_check_and_dtype():
    checks = {"logits", "loss", "grad", "grad_vector", "grad_norm", "param", "param_vector", "routing", "hf"}
    for dtype in ("float32", "bfloat16"):
        assert set(tolerances.TOLERANCES[dtype]) == checks
    assert str(tolerances.bounds("float32", "param_vector")[0]) == "rel<=1e-05"
    assert str(tolerances.bounds("float32", "param")[0]) == "rel<=0.001"


def test_a_kernel_that_cannot_load_is_an_error_line_and_fails_the_suite():
    with registered("moe", "test_missing", "pallas_kernels.moe:no_such_kernel") as spec:
        report = run_parity(SMALL, kernel_sets=[spec], batch=1, seq_len=8)
    errors = [r for r in report.rows if r.status == "ERROR"]
    assert not report.passed and len(errors) == 1
    assert errors[0].kernels == "attention=xla,cross_entropy=xla,moe=test_missing"
    assert "no_such_kernel" in errors[0].message
    assert "ERROR" in report.format() and "parity: FAIL" in report.format()


# ---- the xla set through the CLI, in float32 and bfloat16 ------------------------------------
@pytest.fixture(scope="module")
def xla_cli(tmp_path_factory):
    return run_cli(["--kernels", "xla", "--dtype", "float32", "bfloat16"], tmp_path_factory)


def test_xla_kernel_set_matches_eager_in_float32_and_bfloat16(xla_cli):
    code, data, table = xla_cli
    failing = [e for e in data["entries"] if not e["passed"]]
    assert code == 0 and data["passed"], "\n".join(f"{e['dtype']} {e['name']} {e['metrics']}" for e in failing)
    assert "parity: PASS" in table


def test_json_has_an_entry_per_tensor_kernel_set_and_dtype(xla_cli):
    _, data, _ = xla_cli
    label = "attention=xla,cross_entropy=xla,moe=xla"
    names = parameter_names()
    for dtype in ("float32", "bfloat16"):
        entries = [e for e in data["entries"] if e["kernels"] == label and e["dtype"] == dtype]
        by_category = {}
        for e in entries:
            by_category.setdefault(e["category"], []).append(e["name"])
            assert set(e) >= {"metrics", "tolerance", "passed", "status"}
            reported_only = dtype == "bfloat16" and e["category"] == "param" and e["name"] != "<all parameters>"
            assert bool(e["tolerance"]) != reported_only and (e["status"] == "INFO") == reported_only
        assert by_category["grad"] == names + ["<all gradients>", "<global norm>"]
        assert by_category["param"] == names + ["<all parameters>"]
        assert by_category["logits"] == ["logits"] and by_category["loss"] == ["loss"]
        assert by_category["routing"] == ["model.layers.0.mlp.router", "model.layers.1.mlp.router"]
    logits32 = next(e for e in data["entries"] if e["category"] == "logits" and e["dtype"] == "float32")
    assert logits32["tolerance"] == [{"metric": "rel", "op": "<=", "limit": 1e-5}]
    assert set(logits32["metrics"]) >= {"max_abs", "rel", "cos", "top1", "kl"}


# ---- a planted bug is caught and named ---------------------------------------------------------
@pytest.fixture(scope="module")
def buggy_cli(tmp_path_factory):
    with registered("attention", BUGGY, attention_with_doubled_sink_grad) as spec:
        return run_cli(["--kernels", spec, "--dtype", "float32"], tmp_path_factory)


def test_wrong_sink_gradient_fails_with_a_nonzero_exit(buggy_cli):
    code, data, table = buggy_cli
    assert code == 1 and not data["passed"]
    assert "parity: FAIL" in table


def test_wrong_sink_gradient_is_named_by_parameter(buggy_cli):
    _, data, table = buggy_cli
    failing_grads = {e["name"] for e in data["entries"] if e["category"] == "grad" and not e["passed"]}
    # the per-parameter rows name exactly the sinks; the whole-vector aggregate fails with them
    assert failing_grads - {"<all gradients>"} == {"model.layers.0.self_attn.sinks", "model.layers.1.self_attn.sinks"}
    failing = {e["name"] for e in data["entries"] if not e["passed"]}
    assert "model.embed_tokens.weight" not in failing and "logits" not in failing
    assert "FAIL  grad    model.layers.0.self_attn.sinks" in table   # listed in full in the table


# ---- every other registered implementation, float32 and bfloat16 (interpret-mode Pallas) --------
OTHER_SETS = [kernel_label(s) for s in default_kernel_sets()[0][1:]]


@pytest.fixture(scope="module")
def matrix():
    """The full `tiny` preset (4 layers: sliding and full attention twice), every kernel set."""
    return run_parity(config.get_preset("tiny"), kernel_sets=OTHER_SETS, dtypes=("float32", "bfloat16"),
                      batch=BATCH, seq_len=SEQ)


@pytest.mark.slow
@pytest.mark.parametrize("kernels", OTHER_SETS)
def test_every_registered_kernel_set_matches_eager(matrix, kernels):
    rows = matrix.select(kernels=kernels)
    assert {r.dtype for r in rows} == {"float32", "bfloat16"}
    failing = [r for r in rows if r.failed]
    assert not failing, "\n" + "\n".join(f"{r.dtype} {r.line()}" for r in failing)
