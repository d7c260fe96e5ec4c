"""The parity suite: every registered kernel set matches eager PyTorch in float32 and bfloat16
on inputs that exercise the sliding window, several kernel blocks, ignored labels, every loss
term and packed rows (segment ids, restarting positions, a padded tail); the report prints the mask cases each set exercised; the CLI writes JSON and exits
non-zero on failure. (Planted bugs: test_parity_selftest.py; trajectory: test_trajectory.py.)

The model is `tiny` cut to 2 layers (one sliding, one full attention layer) with the parity
window (16), batch 2 x 80 tokens and the parity tiles (attention blocks 16/32): compiling each
lowered run dominates the time. The matrix of every other registered implementation (Pallas in
interpret mode on CPU) is marked slow.
"""
import argparse
import contextlib
import io
import json

import jax
import numpy as np
import pytest
import torch

from jax_bridge import registry
from parity import compare, tolerances
from parity.runs import FAST_COMPILE
from parity.inputs import PARITY_LOSS, PARITY_SEQ_LEN, ParityBatch, parity_config, parity_inputs
from parity.kernel_sets import covering_kernel_sets, default_kernel_sets, kernel_label, parse_kernel_sets
from parity.run import add_arguments, run
from parity.suite import run_parity
from torch_model import config
from torch_model.causal_lm import IGNORE_INDEX, PAD_SEGMENT
from formats.errors import UserError

BATCH, SEQ = 2, PARITY_SEQ_LEN
SMALL = parity_config(config.get_preset("tiny").replace(n_layers=2))


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


@contextlib.contextmanager
def registered(op, name, fn, **kwargs):
    registry.register_implementation(op, name, fn, description="test only", **kwargs)
    try:
        yield f"{op}={name}"
    finally:
        registry.unregister_implementation(op, name)   # tests clean up after themselves


# ---- cheap checks: kernel sets, input errors, metrics ----------------------------------------
def test_default_kernel_sets_cover_every_registered_implementation_once():
    sets, skipped = default_kernel_sets("cpu")
    assert sets[0] == {op: "xla" for op in registry.OPS}
    covered = [(op, s[op]) for s in sets[1:] for op in registry.OPS if s[op] != "xla"]
    assert all(sum(v != "xla" for v in s.values()) == 1 for s in sets[1:]), "one non-xla op per set"
    trains = [(op, name) for op in registry.OPS for name, impl in registry.implementations(op).items()
              if name != "xla" and impl.trains]
    assert sorted(covered) == sorted(trains)
    # Generation-only implementations (no backward) are listed as skipped, never dropped silently.
    generation_only = [f"{op}={name}" for op in registry.OPS for name, impl in registry.implementations(op).items()
                       if not impl.trains]
    assert generation_only and all(any(g in r.kernels and "generation only" in r.message for r in skipped)
                                   for g in generation_only)
    assert len(skipped) == len(generation_only)


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
    with pytest.raises(UserError, match="--base-dtype mxfp4: the parity suite has no rows for an MXFP4 expert base"):
        run(parse(["--preset", "tiny", "--base-dtype", "mxfp4"]))
    with pytest.raises(UserError, match="float16"):
        run_parity(SMALL, kernel_sets=["xla"], dtypes=("float16",))


def test_metrics_of_identical_and_perturbed_tensors():
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


def test_a_finished_runs_verdict_lists_its_failing_checks_at_once():
    """The progress under each run names its failing checks (a suite cut short by a time limit
    printed only FAIL on the chip), at most SHOWN_FAILURES of them."""
    from parity.report import SHOWN_FAILURES, Row, run_verdict

    ok = Row("attention=pallas", "float32", "grad", "w", status="PASS")
    bad = [Row("attention=pallas", "float32", "param", f"layers.{i}.w", metrics={"rel": 2e-3}, status="FAIL")
           for i in range(SHOWN_FAILURES + 2)]
    assert run_verdict("attention=pallas", "float32", [ok]) == ["  PASS attention=pallas | float32"]
    lines = run_verdict("attention=pallas", "float32", [ok, *bad])
    assert lines[0] == "  FAIL attention=pallas | float32" and "layers.0.w" in lines[1]
    assert len(lines) == SHOWN_FAILURES + 2 and lines[-1].startswith("  ... and 2 more failing checks")


def test_float32_post_step_checks_leave_out_entries_inside_the_gradients_noise():
    """AdamW's first step is sign-like, g / (|g| + eps): the chip's float32 gradient noise (a
    bias's entries off by up to 1.3e-7, rel 1.4e-5) set the updates of the entries no larger than
    it and failed the post-step checks (rel 2.4e-3). Those entries are left out of both post-step
    checks in float32 and counted; a wrong update of any other entry still fails."""
    from parity.checks import compare_runs
    from parity.runs import Run

    rng = np.random.default_rng(0)
    lr, eps = 3e-3, 1e-8
    grad = rng.normal(scale=1e-3, size=512)
    grad[:12] = rng.normal(scale=3e-8, size=12)                       # near eps
    weight = rng.normal(size=(64, 64))
    weight_grad = rng.normal(scale=1e-3, size=(64, 64))
    before = {"bias": np.zeros(512), "w": weight}

    def run(bias_grad, w_update_scale=1.0):
        step = lambda p, g: p - lr * g / (np.abs(g) + eps)             # noqa: E731  (Adam's first step)
        grads = {"bias": bias_grad, "w": weight_grad}
        after = {"bias": step(before["bias"], bias_grad), "w": weight - w_update_scale * lr * np.sign(weight_grad)}
        return Run(np.zeros((2, 3)), 1.0, grads, 1.0, after, [])

    ref = run(grad)
    noisy = run(grad + rng.uniform(-1.3e-7, 1.3e-7, size=512))
    rows = {r.name: r for r in compare_runs(ref, noisy, before, "xla", "float32", []) if r.category == "param"}
    assert not any(r.failed for r in rows.values()), [r.line() for r in rows.values()]
    assert rows["bias"].metrics["rounding_zero_entries"] >= 12
    assert rows["<all parameters>"].metrics["rounding_zero_entries"] == rows["bias"].metrics["rounding_zero_entries"]
    # without the rule (the rounding zeros alone) those entries fail the bias, as on the chip
    kept = tolerances.decided_entries(grad)
    assert kept is None or kept[:12].sum() > 0
    # a decided entry updated wrongly, or another tensor's update 0.5% large, still fails
    flipped = noisy.params_after | {"bias": noisy.params_after["bias"] * np.where(np.arange(512) == 100, -1, 1)}
    wrong = [Run(noisy.logits, 1.0, noisy.grads, 1.0, flipped, []), run(grad, w_update_scale=1.005)]
    assert rows_failing(compare_runs(ref, wrong[0], before, "xla", "float32", [])) == {"bias", "<all parameters>"}
    assert "w" in rows_failing(compare_runs(ref, wrong[1], before, "xla", "float32", []))


def rows_failing(rows) -> set[str]:
    return {r.name for r in rows if r.category == "param" and r.failed}


def test_a_probe_that_cannot_compile_fails_at_its_own_run():
    """The suite compiles every run's probe at once (parity/runs.compile_in_parallel); a compile
    error (a tile the TPU refuses, VMEM) is kept and raised by that probe's run, which the suite
    reports as that set's ERROR row, while the others compile."""
    import types

    from parity.runs import LoweredProbe, compile_in_parallel

    def refuse():
        raise RuntimeError("RESOURCE_EXHAUSTED: scoped VMEM")

    bad, good = LoweredProbe.__new__(LoweredProbe), LoweredProbe.__new__(LoweredProbe)
    bad._lowered = types.SimpleNamespace(compile=refuse)
    good._lowered = types.SimpleNamespace(compile=lambda: "executable")
    compile_in_parallel([bad, good])
    assert good._compiled == "executable" and good._lowered is None
    with pytest.raises(RuntimeError, match="scoped VMEM"):
        bad(None, None)


def test_tolerances_are_stated_for_every_check_and_dtype():
    checks = {"logits", "loss", "grad", "grad_scalar", "grad_expert", "grad_vector", "grad_norm", "param", "param_vector",
              "routing", "hf"}
    lora_checks = {"lora_param", "lora_param_vector", "frozen"}          # LoRA parity runs in float32
    assert set(tolerances.TOLERANCES["float32"]) == checks | lora_checks
    assert set(tolerances.TOLERANCES["bfloat16"]) == checks
    assert str(tolerances.bounds("float32", "param_vector")[0]) == "rel<=2e-05"
    assert str(tolerances.bounds("float32", "param")[0]) == "rel<=0.001"


def test_bf16_compute_keeps_the_router_in_float32_in_both_paths():
    """The router's logits, top-k and softmax run in float32 under bf16 compute: the
    lowered step leaves its parameters float32 (per-layer and stacked names) and the model
    upcasts the router's input, so eager bf16 and eager float32 route alike."""
    import jax.numpy as jnp
    import torch

    from jax_bridge.step import cast_params
    from torch_model.model import GptOssForCausalLM

    model = GptOssForCausalLM(SMALL)
    params = {n: jnp.zeros(p.shape, jnp.float32) for n, p in model.named_parameters()}
    params["model.layers.stack0.mlp.router.weight"] = jnp.zeros((2, 3), jnp.float32)   # scanned layout
    cast = cast_params(params, jnp.bfloat16)
    kept = {n for n, p in cast.items() if p.dtype == jnp.float32}
    assert kept == {n for n in params if ".mlp.router." in n} and len(kept) == 2 * SMALL.n_layers + 1
    router = model.model.layers[0].mlp.router
    x = torch.randn(7, SMALL.d_model).to(torch.bfloat16)
    logits, weights, experts = router(x)
    assert logits.dtype == weights.dtype == torch.float32
    with torch.no_grad():
        expected = x.float() @ router.weight.T + router.bias
    torch.testing.assert_close(logits, expected)           # float32 logits of the bf16 input, not bf16 logits
    assert torch.equal(experts, logits.topk(SMALL.experts_per_token).indices)


def test_parity_inputs_ignore_some_labels_and_the_config_weights_every_loss_term():
    plain = parity_inputs(SMALL.vocab_size, BATCH, SEQ, seed=0, segments=False)
    ids, labels = plain.ids, plain.labels
    assert not plain.segmented and plain.model_inputs() == {}
    ignored = (labels == IGNORE_INDEX).sum(1)
    assert ids.shape == labels.shape == (BATCH, SEQ) and (ids >= 0).all()
    assert ((ignored >= 1) & (ignored < SEQ)).all() and ignored.sum() == BATCH * round(0.1 * SEQ)
    assert (labels[labels != IGNORE_INDEX] >= 0).all()
    for name, value in PARITY_LOSS.items():
        assert getattr(SMALL, name) == value > 0
    assert SMALL.sliding_window == 16 < SEQ and SMALL.layer_types == ("sliding_attention", "full_attention")
    # the pair round-trips (what `inputs=(ids, labels)` and the unsegmented full step use)
    again = ParityBatch.from_pairs(ids, labels)
    assert torch.equal(again.ids, ids) and torch.equal(again.labels, labels)


def test_parity_inputs_are_packed_rows_that_train_only_inside_a_segment():
    batch = parity_inputs(SMALL.vocab_size, BATCH, SEQ, seed=0)
    segments, positions = batch.segment_ids, batch.positions
    assert batch.tokens.shape == segments.shape == positions.shape == batch.weights.shape == (BATCH, SEQ + 1)
    real = [sorted(set(row.tolist()) - {PAD_SEGMENT}) for row in segments]
    assert real == [[1, 2, 3], [1, 2]]
    assert (segments[1, -5:] == PAD_SEGMENT).all() and (segments[0] != PAD_SEGMENT).all()   # odd rows: a padded tail
    lengths = [int((segments[0] == s).sum()) for s in (1, 2, 3)]
    assert len(set(lengths)) == 3                                          # conversations of different lengths
    for row_segments, row_positions in zip(segments, positions):
        for s in set(row_segments.tolist()) - {PAD_SEGMENT}:
            assert row_positions[row_segments == s].tolist() == list(range(int((row_segments == s).sum())))
        assert (row_positions[row_segments == PAD_SEGMENT] == 0).all()
    # no label across a boundary or on padding; the random tenth ignored on top (at least one per row)
    crossing = (segments[:, 1:] != segments[:, :-1]) | (segments[:, 1:] == PAD_SEGMENT)
    labels = batch.labels
    assert (labels[crossing] == IGNORE_INDEX).all()
    assert ((labels == IGNORE_INDEX) & ~crossing).sum(1).tolist() == [round(0.1 * SEQ)] * BATCH
    assert torch.equal(labels[labels != IGNORE_INDEX], batch.tokens[:, 1:][labels != IGNORE_INDEX])
    model_inputs = batch.model_inputs()
    assert torch.equal(model_inputs["segment_ids"], segments[:, :-1]) and torch.equal(model_inputs["positions"],
                                                                                        positions[:, :-1])
    step = batch.step_tokens()
    assert set(step) == {"tokens", "weights", "segment_ids", "positions"}
    assert step["tokens"].shape == (1, BATCH, SEQ + 1)
    assert step["weights"][0, :, 1:].sum() == (labels != IGNORE_INDEX).sum()      # the step's denominator
    short = parity_inputs(SMALL.vocab_size, 1, 6, seed=0)                         # too short to split: one segment
    assert set(short.segment_ids[0].tolist()) == {1}
    assert parse([]).segments and not parse(["--no-segments"]).segments          # the CLI's way back


def test_full_step_on_packed_rows_matches_eager():
    """--full-step on packed rows: the compiled train step itself (segment ids, positions and its
    loss over the trained tokens of the packed batch) against eager, on the self-test's micro model."""
    from parity.selftest import MICRO

    report = run_parity(MICRO, kernel_sets=["xla"], batch=BATCH, full_step=True, compiler_options=FAST_COMPILE)
    assert report.passed, "\n" + "\n".join(r.line() for r in report.failures())
    assert report.setup["post_step"] == "TrainStep.__call__ (full step)" and report.setup["ignored_labels"] > 2 * 10
    assert report.setup["segments"].startswith("packed: row 0: 3 segments")


def test_mask_coverage_counts_skipped_windowed_diagonal_and_full_tiles():
    from parity.coverage import attention_tiles

    # window 16, q blocks of 16, kv blocks of 32, 80 tokens padded to 96: 6 x 3 tiles
    c = attention_tiles(80, 16, 16, 32)
    assert (c["q_blocks"], c["kv_blocks"], c["partial"]) == (6, 3, 1)
    assert c["skipped"] + c["sliding_masked"] + c["causal_masked"] + c["unmasked"] == 18
    assert (c["skipped"], c["sliding_masked"], c["causal_masked"], c["unmasked"]) == (10, 5, 3, 0)
    causal = attention_tiles(80, 0, 16, 32)
    assert causal["sliding_masked"] == 0 and causal["skipped"] == 6 and causal["unmasked"] == 6
    splash = attention_tiles(80, 16, 128, 128, splash=True)   # splash's smallest tiles: one, nothing skipped
    assert (splash["q_blocks"], splash["skipped"], splash["sliding_masked"], splash["partial"]) == (1, 0, 1, 1)


def test_each_platform_has_its_parity_shape_and_on_tpu_every_tile_case_is_exercised():
    """The CPU's small tiles once broke Mosaic's block rules on a TPU. The suite picks per
    platform (parity.inputs.parity_shape; what is given explicitly wins): the CPU keeps 80 tokens
    in tiles of 16/32; the TPU takes 320 tokens in tiles of 128, where the coverage lines (computed
    here, without a TPU) still show several tiles per kernel, window and causal skips, a partial
    last block and segment skips in both layer kinds, for every kernel set it runs there.
    (That Mosaic accepts these tiles: tests/test_tpu_compile.py.)"""
    from parity import coverage
    from parity.inputs import (PARITY_BATCH, PARITY_TILES, TPU_PARITY_SEQ_LEN, TPU_PARITY_TILES, ParityShape,
                               parity_shape)

    assert parity_shape() == parity_shape("cpu") == ParityShape(PARITY_SEQ_LEN, PARITY_TILES)   # this host: CPU
    tpu = parity_shape("tpu")
    assert tpu == ParityShape(TPU_PARITY_SEQ_LEN, TPU_PARITY_TILES)
    assert parity_shape("tpu", seq_len=256, kernel_options="") == ParityShape(256, "")
    assert parse([]).seq_len is None and parse([]).kernel_options is None      # the CLI leaves it to the platform
    cfg = parity_config(config.get_preset("tiny"))
    data = parity_inputs(cfg.vocab_size, PARITY_BATCH, tpu.seq_len, seed=0)
    options = registry.parse_kernel_options(tpu.kernel_options)
    sets, _ = default_kernel_sets("tpu")
    lines = {kernel_label(s): coverage.describe(s, cfg, PARITY_BATCH, tpu.seq_len, options, data.labels.numpy(),
                                                segment_ids=data.model_inputs()["segment_ids"].numpy())
             for s in [{"attention": "pallas", "cross_entropy": "pallas", "moe": "pallas"}, *sets]}
    assert not [line for per in lines.values() for line in per if "NOT exercised" in line]
    pallas = lines["attention=pallas,cross_entropy=pallas,moe=pallas"]
    text = "\n".join(pallas)
    assert "window 16: blocks q 128 x kv 128, grid 3 x 3 tiles: 4 skipped, 5 sliding masked" in text
    assert "full causal: blocks q 128 x kv 128, grid 3 x 3 tiles: 3 skipped" in text and "partial last block: yes" in text
    assert "window 16: of 10 band tiles (all rows) 1 skipped" in text
    assert "full causal: of 12 band tiles (all rows) 3 skipped" in text
    assert "5 token tiles of 128, 4 vocab tiles of 1024" in text and "row tiles of 128 (10 tiles)" in text
    assert "grid 3 x 3 tiles: 4 skipped" in "\n".join(lines["attention=splash,cross_entropy=xla,moe=xla"])


def test_a_kernel_that_cannot_load_is_an_error_line_and_fails_the_suite():
    with registered("moe", "test_missing", "pallas_kernels.moe:no_such_kernel") as spec:
        report = run_parity(SMALL, kernel_sets=[spec], batch=1, seq_len=8)
    errors = [r for r in report.rows if r.status == "ERROR"]
    assert not report.passed and len(errors) == 1
    assert errors[0].kernels == "attention=xla,cross_entropy=xla,moe=test_missing"
    assert "no_such_kernel" in errors[0].message
    assert "ERROR" in report.format() and "parity: FAIL" in report.format()


def test_an_attention_without_segment_ids_is_refused_by_its_contract_on_packed_rows():
    """The parity rows are packed by default: a user's attention written for attention contract v1
    (no `segment_ids`) is a REFUSED line naming it and the contract (not an ERROR of the kernel,
    not a silent unsegmented run), and the suite fails."""
    from pallas_kernels.attention import attention_reference

    def plain_attention(q, k, v, sinks, *, sliding_window, scale):
        return attention_reference(q, k, v, sinks, sliding_window=sliding_window, scale=scale)

    from parity.selftest import MICRO

    with registered("attention", "test_plain", plain_attention, contract_version=1) as spec:
        report = run_parity(MICRO, kernel_sets=[spec], batch=1, seq_len=8)
    refused = [r for r in report.rows if r.status == "REFUSED"]
    assert not report.passed and len(refused) == 1 and not [r for r in report.rows if r.status == "ERROR"]
    assert refused[0].category == "contract"
    assert "attention=test_plain cannot run segment-masked (packed) batches" in refused[0].message
    assert "attention contract v1, before segment_ids (v2)" in refused[0].message
    assert "--no-segments" in refused[0].message
    assert "| REFUSED" in report.format() and "parity: FAIL" in report.format()


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
    experts = [f"{n} (expert {e})" for n in names if n.endswith(("experts.gate_up_proj", "experts.down_proj"))
               for e in range(SMALL.n_experts)]
    for dtype in ("float32", "bfloat16"):
        entries = [e for e in data["entries"] if e["kernels"] == label and e["dtype"] == dtype]
        by_category = {}
        for e in entries:
            by_category.setdefault(e["category"], []).append(e["name"])
            assert set(e) >= {"metrics", "tolerance", "passed", "status"}
            # Every check bounded, in both dtypes; only a bf16 expert slice of too few tokens is reported.
            few = dtype == "bfloat16" and e["metrics"].get("tokens", np.inf) < tolerances.EXPERT_MIN_TOKENS
            assert (e["status"], bool(e["tolerance"])) == (("INFO", False) if few else ("PASS", True)), e
        assert by_category["grad"] == names + experts + ["<all gradients>", "<global norm>"]
        # Each expert row shows its token count; per layer they add up to the routed assignments.
        per_layer = {}
        for e in entries:
            if " (expert " in e["name"] and "gate_up_proj" in e["name"]:
                per_layer[e["name"].split(".mlp.")[0]] = per_layer.get(e["name"].split(".mlp.")[0], 0) + e["metrics"]["tokens"]
        assert per_layer and set(per_layer.values()) == {BATCH * SEQ * SMALL.experts_per_token}
        assert by_category["param"] == names + ["<all parameters>"]
        assert by_category["logits"] == ["logits"] and by_category["loss"] == ["loss"]
        assert by_category["routing"] == ["model.layers.0.mlp.router", "model.layers.1.mlp.router"]
    logits32 = next(e for e in data["entries"] if e["category"] == "logits" and e["dtype"] == "float32")
    assert logits32["tolerance"] == [{"metric": "rel", "op": "<=", "limit": 1e-5}]
    assert set(logits32["metrics"]) >= {"max_abs", "rel", "cos", "top1", "kl"}
    grad = next(e for e in data["entries"] if e["category"] == "grad" and e["dtype"] == "bfloat16")
    assert {"norm_ratio", "cos", "rel"} <= set(grad["metrics"])
    param = next(e for e in data["entries"] if e["category"] == "param" and e["dtype"] == "bfloat16")
    assert {"update_ratio", "update_cos"} <= set(param["metrics"])
    packed = parity_inputs(SMALL.vocab_size, BATCH, SEQ, seed=0)
    assert data["setup"]["ignored_labels"] == int((packed.labels == IGNORE_INDEX).sum())
    assert data["setup"]["segments"] == "packed: row 0: 3 segments of 12+52+16; row 1: 2 segments of 44+24 + 12 padding"


def test_report_states_the_inputs_and_the_mask_cases(xla_cli):
    _, _, table = xla_cli
    assert "window 16 on 1 sliding + 1 full layers" in table and "32 labels ignored" in table
    assert "segments: packed: row 0: 3 segments" in table
    assert "cover attention=xla, window 16: one [T, T] score matrix, sliding masked" in table
    assert "cover attention=xla, segments (3-3 ids per row): equal-id mask" in table
    assert "cover cross_entropy=xla: 160 tokens, 32 ignored labels" in table


# ---- every other registered implementation, in float32 and bfloat16 -------------------------
# The fewest sets that run every implementation once (our kernels together, then the other
# implementations), in both dtypes: 8 compiled runs instead of 14 (`torchlyra parity` runs every
# set alone in both dtypes). A failing row names its tensor; `torchlyra parity --kernels OP=NAME`
# then names the kernel.
COVERING_SETS = [kernel_label(s) for s in covering_kernel_sets(default_kernel_sets()[0][1:])]


def test_covering_sets_run_every_implementation_once_ours_together_first():
    sets = default_kernel_sets("cpu")[0][1:]
    cover = covering_kernel_sets(sets)
    assert cover[0] == {"attention": "pallas", "cross_entropy": "pallas", "moe": "pallas"}
    used = sorted((op, c[op]) for c in cover for op in c if c[op] != "xla")
    assert used == sorted((op, s[op]) for s in sets for op in s if s[op] != "xla")      # each once
    assert len(cover) == max(sum(s[op] != "xla" for s in sets) for op in registry.OPS)  # as few as can be


@pytest.fixture(scope="module")
def matrix():
    """The 2-layer parity model (sliding + full attention), seq 80: the covering sets in float32
    and bfloat16."""
    return run_parity(SMALL, kernel_sets=COVERING_SETS, dtypes=("float32", "bfloat16"), batch=BATCH, seq_len=SEQ,
                      compiler_options=FAST_COMPILE)


def assert_rows_pass(report, kernels, dtype):
    rows = report.select(kernels=kernels, dtype=dtype)
    assert rows, f"no {dtype} rows for {kernels}"
    failing = [r for r in rows if r.failed]
    assert not failing, "\n" + "\n".join(f"{r.dtype} {r.line()}" for r in failing)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kernels", COVERING_SETS)
def test_covering_kernel_sets_match_eager(matrix, kernels, dtype):
    assert_rows_pass(matrix, kernels, dtype)


@pytest.mark.slow
def test_matrix_exercises_windowed_skipped_and_partial_attention_tiles(matrix):
    cover = matrix.setup["coverage"]
    pallas = cover["attention=pallas,cross_entropy=pallas,moe=pallas"]
    sliding = next(line for line in pallas if "window 16" in line)
    assert "blocks q 16 x kv 32, grid 6 x 3 tiles: 10 skipped, 5 sliding masked" in sliding
    assert "partial last block: yes" in sliding and "NOT exercised" not in " ".join(pallas)
    segment_skips = [line for line in pallas if "segments (3-3 ids per row)" in line]
    assert "window 16: of 16 band tiles (all rows) 1 skipped" in segment_skips[0]
    assert "full causal: of 24 band tiles (all rows) 8 skipped" in segment_skips[1]
    splash = " ".join(cover["attention=splash,cross_entropy=xla,moe=loop"])
    assert "NOT exercised: skipped, multi-block" in splash and "multiples of 128" in splash
    assert "splash SegmentIds mask inside its tiles; tiles skipped by segments: none" in splash
    ce = " ".join(pallas)
    assert "5 token tiles of 32, 4 vocab tiles of 1024" in ce and "32 ignored labels" in ce
    moe = " ".join(pallas)
    assert "row tiles of 16 (20 tiles)" in moe and "expert groups start inside a tile" in moe
    print("\n" + matrix.format())          # the coverage printout, for the record (-s)
