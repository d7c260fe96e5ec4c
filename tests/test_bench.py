"""`torchlyra bench kernels` and scripts/gpu_bench.py (its --smoke mode runs on CPU)."""
import ast
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_SCRIPT = os.path.join(ROOT, "scripts", "gpu_bench.py")


def test_bench_kernels_cross_entropy_tiny(tmp_path, capsys):
    from jax_bridge import registry
    from train.cli import main

    out = tmp_path / "bench.json"
    rc = main(["bench", "kernels", "--shapes", "tiny", "--ops", "cross_entropy", "--no-time", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "| op " in printed and "cross_entropy" in printed

    report = json.loads(out.read_text())
    rows = report["rows"]
    impls = set(registry.implementations("cross_entropy"))
    assert {(r["impl"], r["direction"]) for r in rows} == {(i, d) for i in impls for d in ("fwd", "fwd+bwd")}
    assert len(rows) == 2 * len(impls)
    for r in rows:
        assert r["error"] is None, r
        assert isinstance(r["temp_bytes"], int) and r["temp_bytes"] > 0
        assert r["shape"] == "tiny" and r["op"] == "cross_entropy"
        if r["impl"] == "xla":
            assert r["ratio_to_xla"] is None and r["analysed_as"] == "plain"
        else:
            assert r["ratio_to_xla"] == pytest.approx(
                r["temp_bytes"] / next(b["temp_bytes"] for b in rows
                                       if b["impl"] == "xla" and b["direction"] == r["direction"]))
            assert r["saved_pct"] == pytest.approx(100 * (1 - r["ratio_to_xla"]))
            assert r["goal_pct"] == 99.9 and isinstance(r["meets_goal"], bool)
        assert r["time_s"] is None  # --no-time
    pallas = {r["direction"]: r for r in rows if r["impl"] == "pallas"}
    assert pallas["fwd"]["analysed_as"] == "opaque"
    # the tiled kernel never holds [N, V] logits: far less temp memory than the reference
    assert pallas["fwd+bwd"]["ratio_to_xla"] < 0.5
    assert report["settings"]["time"] is False and report["machine"]["nproc"] >= 1


def test_bench_rejects_unknown_op(capsys):
    from train.cli import main

    assert main(["bench", "kernels", "--ops", "softmax", "--no-time"]) == 2
    assert "--ops" in capsys.readouterr().err


def test_gpu_script_imports_only_jax_and_kernels():
    """The GPU image has no torchax / array_record: the script must not reach torch_model,
    jax_bridge or train."""
    tree = ast.parse(open(GPU_SCRIPT).read())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            roots.add(node.module.split(".")[0])
    third_party = roots - set(sys.stdlib_module_names)
    assert third_party <= {"jax", "numpy", "pallas_kernels", "parity"}, third_party


def test_gpu_script_smoke_on_cpu(tmp_path):
    out = tmp_path / "gpu_bench.json"
    # Run as a script, then check that nothing outside jax + pallas_kernels was imported.
    code = (
        "import runpy, sys\n"
        f"sys.argv = [{GPU_SCRIPT!r}, '--smoke', '--parts', 'kernels', {str(out)!r}]\n"
        "rc = 0\n"
        "try:\n"
        f"    runpy.run_path({GPU_SCRIPT!r}, run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    rc = e.code\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'torchax', 'torch_model', 'jax_bridge', 'train', 'array_record'))\n"
        "assert not bad, bad\n"
        "sys.exit(rc)\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("OUT", None)
    proc = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["smoke"] is True
    assert report["checks"] and all(c["ok"] for c in report["checks"]), report["checks"]
    assert {c["op"] for c in report["checks"]} == {"attention", "cross_entropy", "moe"}
    rows = report["rows"]
    assert {(r["op"], r["impl"], r["direction"]) for r in rows} == {
        (op, impl, d) for op, impls in (("attention", ("xla", "pallas")), ("cross_entropy", ("xla", "pallas")),
                                        ("moe", ("xla", "ragged_dot")))
        for impl in impls for d in ("fwd", "fwd+bwd")}
    for r in rows:
        assert r["error"] is None, r
        assert r["time_s"] > 0 and r["temp_bytes"] is not None
        assert (r["ratio_to_xla"] is None) == (r["impl"] == "xla")
    assert "vs xla" in proc.stdout


def test_bench_records_a_failing_implementation(tmp_path):
    """An implementation that raises gets its error in its row; the run still succeeds."""
    from jax_bridge import registry
    from train.cli import main

    def broken(hidden, weight, labels, *, ignore_index=-100, platform):
        raise RuntimeError("kernel exploded")

    registry.register_implementation("cross_entropy", "broken_for_test", broken)
    try:
        out = tmp_path / "bench.json"
        rc = main(["bench", "kernels", "--shapes", "tiny", "--ops", "cross_entropy", "--impls", "broken_for_test",
                   "--no-time", "--json", str(out)])
    finally:
        registry.unregister_implementation("cross_entropy", "broken_for_test")
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["impl"] for r in rows} == {"xla", "broken_for_test"}
    for r in rows:
        if r["impl"] == "broken_for_test":
            assert "kernel exploded" in r["error"] and r["temp_bytes"] is None and r["meets_goal"] is None
        else:
            assert r["error"] is None and r["temp_bytes"] > 0


def use_micro_tiny(monkeypatch, **changes):
    """The `tiny` preset shrunk to a 2-layer micro model (and `changes`) for the bench smoke runs."""
    from torch_model import config

    micro = config.get_preset("tiny").replace(d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16,
                                             n_experts=4, expert_dim=16, sliding_window=8, **changes)
    monkeypatch.setitem(config.PRESETS, "tiny", micro)


def test_bench_generate_runs_every_path_side_by_side(tmp_path, capsys, monkeypatch):
    from train.cli import main

    use_micro_tiny(monkeypatch, vocab_size=256, max_seq_len=16)
    out = tmp_path / "generate.json"
    assert main(["bench", "generate", "--batches", "2", "--prompt-len", "5", "--new-tokens", "6", "--repeats", "1",
                 "--warmup", "0", "--hf-threads", "1", "--json", str(out), "--kernel-options", "moe.pallas.block_m=16"]) == 0
    printed = capsys.readouterr().out
    assert "goal: ours >= 3x transformers' decode tokens/s" in printed
    report = json.loads(out.read_text())
    assert " --kernel-options moe.pallas.block_m=16 " in report["command"]
    rows = {r["path"]: r for r in report["rows"]}
    assert set(rows) == {"ours", "ours-streaming", "hf", "no-cache"}
    for r in rows.values():
        assert r["batch"] == 2 and r["decode_tokens_per_s"] > 0 and r["time_to_first_token_ms"] > 0
        assert r["decode_vs_hf"] == pytest.approx(r["decode_tokens_per_s"] / rows["hf"]["decode_tokens_per_s"])
    assert sorted(c["program"] for c in report["compilations"]) == ["decode", "prefill"]
    assert report["settings"]["new_tokens"] == 6 and report["goal"]["ratio"] == 3.0
    # our paths: the bytes a decode step reads at the least; the HBM floor is a TPU's (none on CPU)
    assert rows["ours"]["decode_bytes_per_step"] > 0 and rows["ours"]["floor_tokens_per_s"] is None
    assert "of floor" in printed and "floor_tokens_per_s" not in rows["hf"]


def test_bench_eval_scores_a_few_shot_task_with_both_backends_alike(tmp_path, capsys, monkeypatch):
    """`bench eval` on a micro model: our lm-eval backend and lm-eval's `hf` backend answer the same
    1-shot multiple-choice requests with the same log-likelihoods and greedy flags, side by side."""
    from train.cli import main

    use_micro_tiny(monkeypatch, vocab_size=320, max_seq_len=256)
    out = tmp_path / "eval.json"
    assert main(["bench", "eval", "--examples", "3", "--choices", "3", "--shots", "1", "--batch-sizes", "2",
                 "--repeats", "1", "--hf-threads", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "goal: torchlyra >= 3x hf's examples/s at every batch size" in printed and "1-shot" in printed
    report = json.loads(out.read_text())
    assert report["requests"] == 9 and report["shots"] == 1
    assert report["mean_context_tokens"] > 2 * report["mean_answer_tokens"]     # the shot is in the context
    (row,) = report["rows"]
    assert row["batch"] == 2 and row["torchlyra_examples_per_s"] > 0 and row["hf_examples_per_s"] > 0
    assert row["max_rel_difference"] <= 1e-4 and row["same_greedy"] == 1.0


# ---- torchlyra bench step (its smoke run is the GPU script's step part, on CPU) -----------------------
def test_gpu_script_step_part_smoke_pairs_child_peers_through_eager(tmp_path):
    """The GPU script's step part on CPU: `torchlyra bench step` at a micro config against eager
    torch, its aot_eager-compiled copy and transformers. The report holds each contender's rounds,
    and a child peer's ratio is (peer / eager)[child] x (eager[parent] / ours), round by round."""
    import statistics

    out = tmp_path / "gpu_bench.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("OUT", None)
    proc = subprocess.run([sys.executable, GPU_SCRIPT, "--smoke", "--parts", "step", str(out)], cwd=str(tmp_path),
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| contender" in proc.stdout and "goal: full step >= 2x our eager model" in proc.stdout
    report = json.loads(out.read_text())["step"]
    assert report["error"] is None and report["device"] == "cpu" and report["compute_dtype"] == "float32"
    rows = {r["contender"]: r for r in report["rows"]}
    assert set(rows) == {"ours", "eager", "compiled", "hf", "eager@child"}
    rounds = report["rounds"]
    for row in rows.values():
        assert len(row["fwdbwd_rounds_s"]) == len(row["step_rounds_s"]) == rounds
        assert all(t > 0 for t in row["fwdbwd_rounds_s"] + row["step_rounds_s"])
        assert row["step_mfu"] > 0
        assert row["step_tokens_per_s"] == pytest.approx(report["tokens_per_step"] / row["step_s"])
    assert len(rows["ours"]["update_rounds_s"]) == rounds and rows["ours"]["compile"]["step_compile_s"] > 0
    ours, eager, child = rows["ours"], rows["eager"], rows["eager@child"]
    for kind in ("fwdbwd", "step"):
        for peer in ("hf", "compiled"):
            expected = [p / c * e / o for p, c, e, o in zip(rows[peer][f"{kind}_rounds_s"], child[f"{kind}_rounds_s"],
                                                            eager[f"{kind}_rounds_s"], ours[f"{kind}_rounds_s"])]
            assert rows[peer][f"{kind}_ours_speedup"] == pytest.approx(statistics.median(expected))
        direct = [e / o for e, o in zip(eager[f"{kind}_rounds_s"], ours[f"{kind}_rounds_s"])]
        assert eager[f"{kind}_ours_speedup"] == pytest.approx(statistics.median(direct))
    parts = statistics.median(s / (f + u) for s, f, u in zip(ours["step_rounds_s"], ours["fwdbwd_rounds_s"],
                                                              ours["update_rounds_s"]))
    goals = report["goals"]
    assert goals["step_over_parts"]["measured"] == pytest.approx(parts)
    assert goals["step_over_parts"]["met"] == (parts <= 1.10)
    assert goals["fwdbwd_vs_hf"]["met"] == (rows["hf"]["fwdbwd_ours_speedup"] >= 2.0)
    assert goals["fwdbwd_vs_hf_compiled"]["met"] is None      # not run: not judged
    assert report["peak_flops"] > 0 and len(report["load_average"]["rounds"]) == rounds


@pytest.mark.parametrize("argv, message", [
    (["--preset", "huge"], "unknown preset"),
    (["--peers", "eager,jit"], "--peers: unknown peer(s) jit"),
    (["--rounds", "0"], "--rounds must be >= 1"),
    (["--model", "d_model=big"], "--model: d_model must be an integer"),
    (["--model", "colour=3"], "--model: expected FIELD=VALUE"),
])
def test_bench_step_rejects_bad_arguments(argv, message, capsys):
    from train.cli import main

    assert main(["bench", "step", *argv]) == 2
    assert message in capsys.readouterr().err


def test_bench_kernels_tune_writes_a_tile_table_the_registry_reads(tmp_path, capsys):
    """--tune times each candidate tile on this device (here the Pallas interpreter: the
    mechanics, not a choice) and keeps the fastest per call shape; --kernel-options TABLE.json
    then binds those tiles to calls of that shape, under explicit options, and a shape the table
    lacks runs its defaults and says so."""
    import jax
    import jax.numpy as jnp

    from helpers import pallas_calls
    from jax_bridge import registry
    from train.cli import main

    table_path = tmp_path / "tiles.json"
    argv = ["bench", "kernels", "--tune", str(table_path), "--shapes", "tiny", "--ops", "cross_entropy",
            "--tune-candidates", "cross_entropy.pallas.block_n=256/1024,cross_entropy.pallas.block_v=512",
            "--repeats", "1", "--warmup", "0"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "2 candidates" in printed and "Pallas interpreted" in printed
    table = json.loads(table_path.read_text())
    assert (table["format"], table["platform"], table["device_kind"]) == ("torchlyra-kernel-tiles", "cpu", "cpu")
    [(key, entry)] = table["entries"]["cross_entropy"]["pallas"].items()
    assert key == "hidden=2048x256 vocab=4096 dtype=float32"
    assert entry["options"]["block_n"] in (256, 1024) and entry["options"]["block_v"] == 512

    # A run's own call shapes (its step's forward traced without weights), merged into the table:
    # the entry above stays, and the key added is the one that run's cross-entropy looks up.
    assert main(["bench", "kernels", "--tune", str(table_path), "--preset", "tiny", "--batch-size", "2",
                 "--seq-len", "64", "--ops", "cross_entropy", "--tune-candidates",
                 "cross_entropy.pallas.block_n=128,cross_entropy.pallas.block_v=512", "--repeats", "1",
                 "--warmup", "0"]) == 0
    assert "1 call shapes of tiny at batch 2 x seq 64: cross_entropy N128 H256 V4096 float32" in capsys.readouterr().out
    merged = json.loads(table_path.read_text())["entries"]["cross_entropy"]["pallas"]
    assert merged[key] == entry and merged["hidden=128x256 vocab=4096 dtype=float32"]["options"] == \
        {"block_n": 128, "block_v": 512}
    table = json.loads(table_path.read_text())

    # The registry binds a table's tiles per call shape (a hand-made table: a choice to check).
    table["entries"]["cross_entropy"]["pallas"][key]["options"] = {"block_n": 256, "block_v": 1024}
    table_path.write_text(json.dumps(table))
    impl = registry.implementations("cross_entropy")["pallas"]

    def grid(options, n):
        fn = impl.bind("cpu", registry.parse_kernel_options(options)["cross_entropy"]["pallas"])
        specs = (jax.ShapeDtypeStruct((n, 256), jnp.float32), jax.ShapeDtypeStruct((4096, 256), jnp.float32),
                 jax.ShapeDtypeStruct((n,), jnp.int32))
        [params] = pallas_calls(lambda h, w, y: fn(h, w, y, ignore_index=-100)[0], *specs)
        return params["grid_mapping"].grid

    assert grid(str(table_path), 2048) == (2048 // 256, 4096 // 1024)
    assert grid(f"{table_path},cross_entropy.pallas.block_v=512", 2048) == (2048 // 256, 4096 // 512)  # explicit wins
    assert grid(str(table_path), 1024) == (1, 4096 // 512)       # not in the table: the defaults (1024 x 512)
    assert "has no entry for cross_entropy=pallas at hidden=1024x256" in capsys.readouterr().err

    # Tuned elsewhere, or not a table: refused by name.
    table["platform"] = "tpu"
    table_path.write_text(json.dumps(table))
    with pytest.raises(registry.KernelError, match="tuned on tpu .* compiles for cpu"):
        impl.bind("cpu", registry.parse_kernel_options(str(table_path))["cross_entropy"]["pallas"])
    table_path.write_text(json.dumps({**table, "version": 7}))
    with pytest.raises(registry.KernelError, match="field 'version' must be 1, found 7"):
        registry.parse_kernel_options(str(table_path))
    table["entries"]["cross_entropy"]["pallas"][key]["options"] = {"block_x": 3}
    table_path.write_text(json.dumps({**table, "version": 1}))
    with pytest.raises(registry.KernelError, match="block_x.*kernel tiles .*tiles.json, entry hidden=2048x256"):
        registry.check_options(str(table_path))


@pytest.mark.parametrize("argv,message", [
    (["--preset", "tiny"], "--preset / --model-config are for --tune"),
    (["--tune", "T.json", "--preset", "tiny", "--seq-len", "64", "--shapes", "tiny"], "give --shapes or a run's shapes"),
    (["--tune", "T.json", "--preset", "tiny"], "give --seq-len and --batch-size >= 1"),
    (["--tune", "T.json", "--preset", "nope", "--seq-len", "64"], "unknown preset 'nope'"),
])
def test_bench_kernels_tune_of_a_run_rejects_bad_arguments(argv, message, capsys, tmp_path, monkeypatch):
    from helpers import one_line_error

    monkeypatch.chdir(tmp_path)
    assert message in one_line_error(capsys, ["bench", "kernels", *argv])
    assert not (tmp_path / "T.json").exists()


def test_tune_of_a_run_keeps_only_the_ops_asked_for_on_a_tpu(monkeypatch):
    """On a v5e every op left on "auto" runs Pallas and looks its tiles up too: `--ops
    cross_entropy` must still tune cross-entropy alone (on the chip it tuned attention and MoE first)."""
    import types

    from jax_bridge import step
    from train.bench import tune

    monkeypatch.setattr(step, "target_generation", lambda platform, generation: "v5e" if platform == "tpu" else None)

    args = types.SimpleNamespace(preset="tiny", model_config=None, seq_len=256, batch_size=2)
    keys = tune.run_keys(tune.run_model(args), ["cross_entropy"], "tpu", 2, 256, "bfloat16")
    assert list(keys) == ["cross_entropy"] and keys["cross_entropy"] == ["hidden=512x256 vocab=4096 dtype=bfloat16"]


def test_kernel_speed_times_each_implementation_forward_and_backward_with_its_useful_flops():
    """`bench kernels` on an accelerator host (train/bench/kernel_speed.py), run here on the CPU's
    device: one row per (implementation, direction) with a time, the FLOPs every implementation
    shares, the xla row as the base of the speed-ups, and the table."""
    import types

    from train.bench import kernel_speed

    args = types.SimpleNamespace(dtype="float32", warmup=1, repeats=1)
    rows = kernel_speed.run(args, ["tiny"], ["cross_entropy"], {"xla"})
    assert [(r["impl"], r["direction"]) for r in rows] == [("xla", "fwd"), ("xla", "fwd+bwd")]
    n, h, v = 2048, 256, 4096
    assert [r["flops"] for r in rows] == [2.0 * n * h * v, 6.0 * n * h * v]
    assert all(r["time_s"] > 0 and r["speedup_vs_xla"] == 1 and r["bytes"] > 0 and r["error"] is None for r in rows)
    assert kernel_speed.visible_pairs(4, 0) == 10 and kernel_speed.visible_pairs(4, 2) == 7
    table = kernel_speed.format_table(rows)
    assert table.splitlines()[0].startswith("| op ") and "1 (base)" in table and table.count("\n") == 3


def test_torchax_peer_script_times_our_step_beside_the_peer(tmp_path, capsys):
    """scripts/torchax_peer_step.py (BENCHMARKS' torchax peer row) at a two-layer Llama on the CPU:
    our step with two micro-batches and the torchax-documented step take the same batch; both are
    timed and the ratio written. The chip's figures come from the same script."""
    import runpy

    config = tmp_path / "llama.json"
    config.write_text(json.dumps({"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
                                  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                  "max_position_embeddings": 128, "tie_word_embeddings": True}))
    out = tmp_path / "peer.json"
    script = runpy.run_path(os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts", "torchax_peer_step.py"))
    assert script["main"](["--model-config", str(config), "--batch-size", "4", "--seq-len", "32", "--steps", "2",
                           "--micro-batches", "2", "--ns-dtype", "bfloat16", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["args"]["ns_dtype"] == "bfloat16" and 0 < report["ours"]["update_s"] < report["ours"]["step_s"]
    assert report["ours"]["step_s"] > 0 and report["peer"]["step_s"] > 0 and report["ours_over_peer"] > 0, report
    assert "2 micro-batches (ours)" in capsys.readouterr().out


@pytest.mark.parametrize("op", ["attention", "moe", "cross_entropy"])
def test_tokamax_peers_solve_the_benchmark_problem(op):
    """`bench kernels`' tokamax rows (train/bench/kernel_peers.py) run the op's problem in
    tokamax's layout: here its plain-XLA implementations, on the peer's converted inputs, equal
    our references (attention without sinks; cross-entropy's loss summed), forward and input
    gradients. On a TPU the same wrappers take its Mosaic kernels (tests/test_tpu_compile.py)."""
    import jax
    import jax.numpy as jnp

    from helpers import rel_err
    from jax_bridge import registry
    from train.bench import kernel_peers
    from train.bench.kernel_cases import concrete_inputs, float_positions, kernel_cases

    assert kernel_peers.version() == "0.0.12"
    peer = kernel_peers.peer_of(op)
    reference = registry.implementations(op)["xla"].load()
    for case in kernel_cases(op, "tiny")[:2]:
        inputs = concrete_inputs(case)
        if op == "attention":       # no sinks: a sink logit of -inf takes no probability
            inputs[3] = jnp.full_like(inputs[3], -jnp.inf)

        def ours(*args):
            out = reference(*args, **case.kwargs)
            return jnp.sum(out[0]) if op == "cross_entropy" else out

        theirs = peer.build(case, kernel_peers.implementation(op, "cpu"))
        peer_inputs = peer.prepare(case, inputs)
        floats, peer_floats = float_positions(case), peer.floats(case)
        got, got_vjp = jax.vjp(lambda *f: theirs(*[dict(zip(peer_floats, f)).get(i, x) for i, x in
                                                   enumerate(peer_inputs)], **case.kwargs),
                               *[peer_inputs[i] for i in peer_floats])
        want, want_vjp = jax.vjp(lambda *f: ours(*[dict(zip(floats, f)).get(i, x) for i, x in enumerate(inputs)]),
                                 *[inputs[i] for i in floats])
        if op == "attention":       # [B, T, H, D] back to ours
            got = got.transpose(0, 2, 1, 3)
        assert rel_err(got, want) < 1e-5, (case.label, rel_err(got, want))
        cot = jax.random.normal(jax.random.PRNGKey(2), want.shape, want.dtype)
        grads_got = got_vjp(cot.transpose(0, 2, 1, 3) if op == "attention" else cot)
        grads_want = want_vjp(cot)
        if op == "attention":
            grads_got = [g.transpose(0, 2, 1, 3) for g in grads_got]
        if op == "cross_entropy":   # the peer's weight gradient is [H, V]
            grads_got = [grads_got[0], grads_got[1].T]
        for g, w in zip(grads_got, grads_want):     # attention: q, k, v (the sinks' gradient is ours alone)
            assert rel_err(g, w) < 1e-4, (case.label, rel_err(g, w))


def test_kernel_speed_adds_the_tokamax_rows_on_a_tpu(monkeypatch):
    """On a TPU host `bench kernels` times tokamax beside the registered implementations, its row
    noting what it leaves out. Here on the CPU's device, with the host taken for a v5e and
    tokamax's XLA implementations standing in for its Mosaic ones."""
    import types

    from jax_bridge import tpu_compile
    from pallas_kernels import platform as kernel_platform
    from train.bench import kernel_peers, kernel_speed

    monkeypatch.setattr(kernel_platform, "host_platform", lambda: "tpu")
    monkeypatch.setattr(tpu_compile, "generation", lambda device: "v5e")
    monkeypatch.setattr(kernel_peers, "implementation", lambda op, platform: "xla")
    args = types.SimpleNamespace(dtype="float32", warmup=1, repeats=1)
    rows = kernel_speed.run(args, ["tiny"], ["cross_entropy"], {"xla", "tokamax"})
    assert [(r["impl"], r["direction"]) for r in rows] == [("xla", "fwd"), ("tokamax", "fwd"), ("xla", "fwd+bwd"),
                                                          ("tokamax", "fwd+bwd")]
    peer = [r for r in rows if r["impl"] == "tokamax"]
    assert all(r["error"] is None and r["speedup_vs_xla"] > 0 and r["note"] == "loss summed; weight [H, V]"
               for r in peer), peer
    assert "loss summed" in kernel_speed.format_table(rows)


def test_mosaic_op_counts_counts_each_kernels_llo_by_unit(tmp_path):
    """scripts/mosaic_op_counts.py: the attention kernels compiled for a v5e by the deviceless
    compiler, each kernel's final LLO counted by unit, and the same counts shown against a
    baseline (the static evidence a CPU host has for a kernel-body change). A child process:
    libtpu reads the dump flag when it starts, which in this one it has."""
    script = os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts", "mosaic_op_counts.py")
    first, again = tmp_path / "a.json", tmp_path / "b.json"
    for argv in (["--json", str(first)], ["--baseline", str(first), "--json", str(again)]):
        proc = subprocess.run([sys.executable, script, "--op", "attention", "--shape", "tiny", *argv],
                              capture_output=True, text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
        assert proc.returncode == 0, proc.stderr[-3000:]
    kernels = json.loads(first.read_text())["kernels"]
    assert set(kernels) == {"attention_fwd", "attention_dq", "attention_dkv"}, set(kernels)
    assert all(k["units"]["mxu"] > 0 and k["units"]["vpu"] > 0 and k["units"]["memory"] > 0 for k in kernels.values())
    assert kernels["attention_fwd"]["units"]["xlu"] > 0          # its row max and sum reduce across lanes
    assert json.loads(again.read_text())["kernels"] == kernels    # the compiler is deterministic
    assert f"{kernels['attention_fwd']['units']['mxu']:>7d} -> " in proc.stdout


def test_float32_accuracy_decode_loop_ops_and_decode_head_bench_scripts_run_here(capsys):
    """The commands beside BENCHMARKS' float32-accuracy and decode-loop figures:
    scripts/float32_accuracy.py (every row printed; on this CPU within a few ulps) and
    scripts/decode_loop_ops.py (the decode loop body priced for a v5e, deviceless: small-o200k at
    one row reads about its 206 MB output matrix, in fewer ops since the expert biases enter the loop
    in the kernels' layout; a transformers config's model too); and
    scripts/decode_head_bench.py at small shapes (its Pallas kernel interpreted, a ragged last block
    and two streams included: the products equal XLA's)."""
    import runpy

    root = os.path.dirname(os.path.dirname(__file__))
    runpy.run_path(os.path.join(root, "scripts", "float32_accuracy.py"), run_name="float32_accuracy")
    printed = capsys.readouterr().out
    assert printed.count("max rel") == 9 and "matmul f32 HIGHEST mosaic" in printed
    script = runpy.run_path(os.path.join(root, "scripts", "decode_loop_ops.py"))
    assert script["main"](["--kernels", "moe=pallas"]) == 0
    [row] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| moe=pallas")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert 200 < float(cells[1].split()[0]) < 260 and int(cells[3]) < 345, cells
    # A transformers config's decode loop (Qwen3-MoE's, tiny): its own row.
    assert script["main"](["--model-config", os.path.join(root, "docs", "models", "qwen3-moe-tiny.json"),
                           "--kernels", "moe=pallas"]) == 0
    printed = capsys.readouterr().out
    assert "qwen3-moe-tiny.json, 1 row(s)" in printed and printed.count("| moe=pallas") == 1, printed
    head = runpy.run_path(os.path.join(root, "scripts", "decode_head_bench.py"))
    assert head["main"](["--vocab", "1000", "--hidden", "128", "--rows", "1,3", "--blocks", "256", "--iters", "2",
                         "--repeats", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| 1 |", "| 3 |"))]
    assert len(rows) == 8 and all(float(r.split("|")[-2]) < 0.01 for r in rows), rows
