"""The parity suite catches what matters: every planted bug of the catalogue fails it in float32
and bfloat16 and a failing check names a tensor where the bug lives; the planted kernel set with
no bug live passes; the bf16 checks see magnitude (a gradient scaled by 0.8 or 1.25 on any one
tensor, a zero update, a doubled learning rate all fail); `torchlyra parity --selftest` reports it.

One self-test run (micro model, one compile of the planted kernel set per dtype, on random init
and on the micro model trained briefly) serves every test; the trained weights also pass bf16
parity on the reference (xla) kernel set.
"""
import argparse
import contextlib
import dataclasses
import io

import numpy as np
import pytest

from parity import planted, selftest
from parity.checks import compare_runs
from parity.inputs import parity_inputs, text_inputs
from parity.report import Report
from parity.run import add_arguments, run
from parity.runs import FAST_COMPILE
from parity.selftest import CONTROL, MICRO, RANDOM, TRAINED, WEIGHTS, run_selftest
from parity.suite import run_parity

DTYPES = ("float32", "bfloat16")


@pytest.fixture(scope="module")
def trained_state():
    return selftest.trained_weights()


@pytest.fixture(scope="module")
def result(trained_state):
    return run_selftest(dtypes=DTYPES, trained_state=trained_state, compiler_options=FAST_COMPILE)


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_planted_kernel_set_without_a_live_bug_passes(result, dtype, weights):
    control = result.outcome(CONTROL, dtype, weights)
    assert not control.caught, control.failing


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bug", [b.name for b in planted.CATALOGUE])
def test_planted_bug_fails_the_suite_and_names_the_tensor_at_fault(result, bug, dtype, weights):
    if dtype not in planted.BUGS[bug].dtypes:
        reason = next(r for b, d, r in result.skipped if b == bug and d == dtype)
        assert reason, "a bug left out of a dtype must say why"
        pytest.skip(reason)
    o = result.outcome(bug, dtype, weights)
    assert o.caught, f"{bug} ({dtype}, {weights}) passed the parity suite"
    assert o.named, f"{bug} ({dtype}, {weights}): failing checks name no tensor where it lives " \
                    f"{planted.BUGS[bug].at_fault}: {o.failing}"


@pytest.mark.parametrize("weights", WEIGHTS)
def test_specific_bugs_are_named_precisely(result, weights):
    for dtype in DTYPES:
        sinks = selftest.failing_tensor_names(result.outcome("sink_grad_x2", dtype, weights))
        assert {"model.layers.0.self_attn.sinks", "model.layers.1.self_attn.sinks"} <= sinks
        assert not any("proj" in n or "expert" in n for n in sinks), sinks   # the sinks, nothing else
        muon = selftest.failing_tensor_names(result.outcome("muon_lr_x2", dtype, weights))
        assert muon and all(n.endswith("proj.weight") or n.endswith("gate_up_proj") or n.endswith("down_proj")
                            for n in muon), muon                            # only Muon's matrices
        expert = selftest.failing_tensor_names(result.outcome("expert_output_x0.9", dtype, weights))
        assert any(n.endswith(f"(expert {planted.SCALED_EXPERT})") for n in expert), expert   # that expert's slice


def test_trained_weights_are_sharp_and_route_unevenly(result):
    """The trained case is the one users bring: sharper logits, uneven expert loads."""
    (random_ref, *_), (trained_ref, *_) = (result.controls[w, "float32"] for w in (RANDOM, TRAINED))
    assert np.abs(trained_ref.logits).max() > 5 * np.abs(random_ref.logits).max()
    assert trained_ref.loss < random_ref.loss - 2.0


def test_trained_checkpoint_passes_bf16_parity_on_the_reference_kernels(result, trained_state):
    """What `torchlyra parity --checkpoint` does after training, on the self-test's trained micro
    model and the reference kernel set (a planted bug on the same weights fails: above)."""
    report = run_parity(MICRO, trained_state, kernel_sets=["xla"], dtypes=("bfloat16",),
                        inputs=text_inputs(selftest.text_tokens(), 2, 80, 0),
                        compiler_options=FAST_COMPILE)
    assert report.passed, "\n" + "\n".join(r.line() for r in report.failures())
    assert report.runs() == [("attention=xla,cross_entropy=xla,moe=xla", "bfloat16")]
    experts = [r for r in report.rows if " (expert " in r.name]
    assert experts and all("tokens" in r.metrics for r in experts)       # the count beside each expert row


# ---- magnitude: perturb the control run's numbers and compare again (no compile) -------------------
def only(run_, name):
    """The run restricted to one tensor (compare_runs then checks just it, fast)."""
    return dataclasses.replace(run_, grads={name: run_.grads[name]}, params_after={name: run_.params_after[name]})


# float32 on trained weights adds nothing: its rel <= 1e-4 fails any 3% scaling on any weights.
@pytest.mark.parametrize("dtype, weights", [("float32", RANDOM), ("bfloat16", RANDOM), ("bfloat16", TRAINED)])
@pytest.mark.parametrize("factor", [0.8, 1.25])
def test_one_tensor_gradient_scaled_fails_whichever_tensor(result, dtype, factor, weights):
    reference, control, before, routers = result.controls[weights, dtype]
    missed = []
    for name in reference.grads:
        scaled = dataclasses.replace(only(control, name), grads={name: control.grads[name] * factor})
        rows = compare_runs(only(reference, name), scaled, {name: before[name]}, "perturbed", dtype, routers)
        if not any(r.failed and r.name == name and r.category == "grad" for r in rows):
            missed.append(name)
    assert not missed, f"gradient x{factor} passed for: {missed}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("what, scale", [("zero update", 0.0), ("doubled learning rate", 2.0)])
def test_update_of_wrong_size_fails_every_tensor(result, dtype, what, scale):
    reference, control, before, routers = result.controls[RANDOM, dtype]
    after = {n: before[n] + scale * (p - before[n]) for n, p in control.params_after.items()}
    rows = compare_runs(reference, dataclasses.replace(control, params_after=after), before, "perturbed", dtype, routers)
    passing = [r.name for r in rows if r.category == "param" and not r.failed]
    assert not passing, f"{what} passed for {passing}"


def test_the_self_test_runs_packed_rows_and_its_rope_bug_restarts_with_each_segment(result):
    """The planted attention takes segment ids like every built-in one, so the self-test runs the
    parity matrix's packed rows; its RoPE bug re-rotates each segment from the segment's start."""
    import jax.numpy as jnp

    assert result.report.setup["segmented"] is True
    batch = parity_inputs(MICRO.vocab_size, 2, 80, 0)
    derived = np.asarray(planted.segment_positions(jnp.asarray(batch.segment_ids.numpy())))
    real = batch.segment_ids.numpy() != 0
    assert (derived[real] == batch.positions.numpy()[real]).all() and batch.positions.max() < 60


# ---- the CLI ------------------------------------------------------------------------------------
def cli(argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = run(parser.parse_args(argv))
    return code, out.getvalue()


def test_selftest_cli_prints_the_table_and_exits_by_the_verdict(result, monkeypatch):
    lora = selftest.SelftestReport(   # the LoRA self-test runs for real in test_lora_parity.py
        [selftest.Outcome(CONTROL, "float32", False, False, weights=selftest.LORA_WEIGHTS),
         selftest.Outcome(planted.LORA_SCALING_TWICE, "float32", True, True, ["grad lora_B"],
                          weights=selftest.LORA_WEIGHTS)], [], Report(setup={}))
    monkeypatch.setattr(selftest, "run_lora_selftest", lambda **kw: lora)
    monkeypatch.setattr(selftest, "run_selftest", lambda **kw: result)
    n_outcomes = len(result.outcomes)
    code, table = cli(["--selftest"])
    assert code == 0 and "parity self-test: PASS" in table and "packed rows" in table
    assert len(result.outcomes) == n_outcomes                       # the fixture is left as it was
    for bug in (*planted.CATALOGUE, planted.LORA_BUGS[planted.LORA_SCALING_TWICE]):
        assert bug.name in table
    missed = selftest.SelftestReport([*result.outcomes[:-1], selftest.Outcome("adam_eps_x100", "bfloat16", False, False)],
                                     result.skipped, result.report, result.controls)
    monkeypatch.setattr(selftest, "run_selftest", lambda **kw: missed)
    code, table = cli(["--selftest"])
    assert code == 1 and "MISSED" in table and "parity self-test: FAIL" in table


def test_selftest_table_for_the_record(result):
    print("\n" + result.format())
    assert np.all([o.ok for o in result.outcomes])
