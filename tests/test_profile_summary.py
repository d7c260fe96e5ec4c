"""The profile summary's TPU path (train/run/profile_summary.py) on a synthetic trace: a small
program's real optimized HLO (compiled for this CPU) and a device plane written as the TPU's
profiler writes one ("XLA Modules", "XLA Ops" named by each instruction's text), through
jax.profiler.ProfileData's own text-proto reader. The CPU path runs on the reference run of
tests/test_training_loop.py, and its grouping of ops into runs on a synthetic host plane here."""
import json

import pytest

from formats.errors import UserError
from jax_bridge import roofline
from jax_bridge import hlo_text as hlo
from train.cli import main
from train.run import profile_summary as ps

US = 1_000_000      # picoseconds per microsecond


def program_text() -> str:
    """A loop of matmuls (3 trips), then an update under the optimizer's named scope."""
    import jax
    import jax.numpy as jnp

    def f(w, x):
        h = jax.lax.fori_loop(0, 3, lambda i, h: jnp.tanh(h @ w), x)
        with jax.named_scope(roofline.OPTIMIZER_SCOPE):
            w2 = w - 0.1 * (h.T @ h)
        return w2, h.sum()

    return roofline.module_text(jax.jit(f).lower(jnp.ones((64, 64)), jnp.ones((8, 64))).compile())


def entry_and_loop(text: str):
    """(the entry's costed instructions in order, the while loop, its body's and condition's)."""
    comps, entry = hlo.parse_module(text)
    parse = lambda name: [i for i in map(hlo.parse_instruction, comps[name][1]) if i and i.opcode not in
                          ("parameter", "constant", "get-tuple-element", "tuple", "bitcast")]
    top = parse(entry)
    [loop] = [i for i in top if i.opcode == "while"]
    body = parse(__import__("re").search(r"body=%([\w.\-]+)", loop.attrs).group(1))
    cond = parse(__import__("re").search(r"condition=%([\w.\-]+)", loop.attrs).group(1))
    return top, loop, body, cond


def top_name(text: str) -> str:
    return entry_and_loop(text)[0][0].name


def text_proto(modules: list, ops: list) -> str:
    """An XSpace with one TPU device plane: modules [(name, start_us, duration_us)], ops
    [(instruction text, start_us, duration_us)]."""
    names = [name for name, *_ in modules] + [name for name, *_ in ops]
    meta = "".join(f"  event_metadata {{ key: {k + 1} value {{ id: {k + 1} name: {json.dumps(n)} }} }}\n"
                   for k, n in enumerate(names))
    events = lambda items, first: "".join(
        f"events {{ metadata_id: {first + k + 1} offset_ps: {int(s * US)} duration_ps: {int(d * US)} }} "
        for k, (_, s, d) in enumerate(items))
    return (f'planes {{\n  id: 1\n  name: "/device:TPU:0"\n'
            f'  lines {{ id: 1 name: "XLA Modules" timestamp_ns: 0 {events(modules, 0)}}}\n'
            f'  lines {{ id: 2 name: "XLA Ops" timestamp_ns: 0 {events(ops, len(modules))}}}\n{meta}}}\n')


@pytest.fixture(scope="module")
def tpu_profile(tmp_path_factory):
    """Two runs of the program (each op 10 us, its loop 3 trips), a 1 us program between them, an
    op the HLO lacks, one it holds as another instruction, and an op outside every run; step.json
    says: compiled for a v5e."""
    from jax.profiler import ProfileData

    text = program_text()
    top, loop, body, cond = entry_and_loop(text)
    line = lambda ins: ins.line.strip().removeprefix("ROOT ")
    ops, modules, clock = [], [], 0.0
    for run in range(2):
        start = clock
        for ins in top:
            if ins is loop:
                inner = [*(list(cond) + list(body)) * 3, *cond]
                ops.append((line(ins), clock, 10.0 * len(inner)))      # spans its body's ops
                for op in inner:
                    ops.append((line(op), clock, 10.0))
                    clock += 10.0
            else:
                ops.append((line(ins), clock, 10.0))
                clock += 10.0
        if run == 0:     # an op the HLO lacks; one it names for another instruction (a stale HLO)
            ops.append(("%mystery.7 = f32[] custom-call(), custom_call_target=\"x\"", clock, 5.0))
            ops.append((f"%{top[0].name} = f32[7]{{0}} {top[0].opcode}(f32[7]{{0}} %p)", clock + 5.0, 3.0))
            clock += 8.0
        modules.append(("jit_f(42)", start, clock - start + 2.0))     # 2 us idle at the end of each run
        clock += 100.0
        modules.append(("jit_convert_element_type(7)", clock, 1.0))
        ops.append(("%convert.1 = f32[] convert(f32[] %p)", clock, 1.0))
        clock += 50.0
    ops.append(("%copy.99 = f32[] copy(f32[] %p)", clock + 500.0, 1.0))     # outside every run
    root = tmp_path_factory.mktemp("tpu_profile")
    trace_dir = root / "profile" / "plugins" / "profile" / "2026_01_01_00_00_00"
    trace_dir.mkdir(parents=True)
    (trace_dir / "host.xplane.pb").write_bytes(ProfileData.text_proto_to_serialized_xspace(text_proto(modules, ops)))
    (root / "profile" / ps.STEP_HLO).write_text(text)
    (root / "profile" / ps.STEP_META).write_text(json.dumps(
        {"module": "jit_f", "platform": "tpu", "generation": "v5e", "steps": [5, 6], "compiled": "test"}))
    costed = len(top) - 1 + 3 * (len(cond) + len(body)) + len(cond)
    return root, text, costed


def test_tpu_trace_by_category_beside_the_roofline(tpu_profile):
    root, text, costed = tpu_profile
    s = ps.summarize(root, top=3)
    assert (s["platform"], s["plane"], s["module"], s["runs"], s["generation"]) == ("tpu", "/device:TPU:0", "jit_f", 2, "v5e")
    per = s["per_step_ms"]
    # Exclusive: the while event (spanning its body) is left out; the unmatched ops count, once in two runs.
    assert per["ops"] == pytest.approx((costed * 10.0 + 8.0 / 2) / 1e3)
    assert sum(r["measured_ms"] for r in s["rows"]) + s["unmatched"]["ms"] == pytest.approx(per["ops"])
    assert s["unmatched"] == {"instructions": 2, "another_instruction": 1, "ms": pytest.approx(4e-3),
                              "examples": ["mystery.7", top_name(text)]}
    assert per["wall"] == pytest.approx(per["ops"] + 2e-3) and per["idle_in_program"] == pytest.approx(2e-3)
    assert per["between_steps"] == pytest.approx(0.148)            # 150 us from one start to the next, less the 2
    assert s["other_programs"] == [{"module": "jit_convert_element_type", "runs": 2, "ms": pytest.approx(2e-3)}]
    assert s["ops_outside_runs"] == 1
    # The prediction is plan --roofline's, row by row, at the v5e's peaks.
    r = roofline.roofline_of_text(text, {}, "v5e")
    predicted = {row["row"]: row["predicted_ms"] for row in s["rows"]}
    assert predicted == {row.category: pytest.approx(row.seconds * 1e3) for row in r.rows}
    assert s["prediction"]["step_ms"] == pytest.approx(r.seconds * 1e3)
    by_row = {row["row"]: row for row in s["rows"]}
    assert by_row["matmul (XLA)"]["events_per_step"] == 3          # the loop's matmul, 3 trips
    assert by_row["optimizer: Newton-Schulz"]["events_per_step"] == 1   # the update's matmul (named scope)
    assert all(row["difference_ms"] == pytest.approx(row["measured_ms"] - row["predicted_ms"]) for row in s["rows"])
    assert len(s["top"]) == 3 and s["top"][0]["difference_ms"] >= s["top"][-1]["difference_ms"]
    table = ps.format_summary(s)
    assert "predicted" in table and "matmul (XLA)" in table and ps.UNMATCHED in table and "mystery.7" in table


def test_profile_command_rewrites_the_summary_and_refuses_a_run_without_profile(tpu_profile, tmp_path, capsys):
    root, _, _ = tpu_profile
    assert main(["profile", str(root), "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "profile: 2 run(s) of jit_f (steps 5-6)" in out and "ops furthest over their prediction" in out
    assert json.loads((root / "profile" / ps.SUMMARY).read_text())["runs"] == 2
    with pytest.raises(UserError, match="no profile"):
        ps.summarize(tmp_path)
    assert main(["profile", str(tmp_path)]) == 2


def test_a_run_that_began_before_the_trace_is_left_out_and_said(tpu_profile, tmp_path):
    """The trace ends after step B, so runs beyond B - A + 1 are the first ones: a step still
    running when the trace began (on a v5e, 2026-12-06: 3 runs for steps 10-11)."""
    import shutil

    root, _, costed = tpu_profile
    shutil.copytree(root / "profile", tmp_path / "profile")
    meta = json.loads((tmp_path / "profile" / ps.STEP_META).read_text())
    (tmp_path / "profile" / ps.STEP_META).write_text(json.dumps({**meta, "steps": [6, 6]}))
    s = ps.summarize(tmp_path)
    assert (s["runs"], s["partial_runs_left_out"]) == (1, 1)
    assert s["per_step_ms"]["ops"] == pytest.approx(costed * 10.0 / 1e3)    # the second run's ops only
    assert s["unmatched"]["instructions"] == 0 and s["per_step_ms"]["between_steps"] is None
    assert "1 earlier run left out: it began before the trace" in ps.format_summary(s)


def test_the_step_program_is_the_one_the_calls_ran_or_says_it_compiled_again(tmp_path):
    """save_step_program takes the step's executable from jax.jit's caches; where they miss, the
    compile is counted and said (the real TrainStep: tests/test_training_loop.py)."""
    import types

    import jax
    import jax.numpy as jnp

    def _step(w, x, s):
        return w * s, x.sum()

    def other():
        def _step(w, x, s):        # the same name, another program: not in the cache
            return w - s, x.max()
        return jax.jit(_step)

    fn = jax.jit(_step, donate_argnums=0)

    def step(ran: bool):
        def compiled(state, tokens, lr_scale):
            args = (state, jnp.asarray(tokens), jnp.asarray(lr_scale, jnp.float32))
            return (fn if ran else other()).lower(*args).compile()
        return types.SimpleNamespace(compiled=compiled, platform="cpu", cfg=types.SimpleNamespace(tpu_generation=None))

    # The call that compiles it, on a placed state (as the trainer's: the same placement finds it)
    state = fn(jax.device_put(jnp.ones(8), jax.devices()[0]), jnp.ones(3), jnp.asarray(0.5, jnp.float32))[0]
    meta = ps.save_step_program(tmp_path, step(True), state, [1.0, 2.0, 3.0], 0.5, steps=[1, 1])
    assert "no second compile" in meta["compiled"] and meta["steps"] == [1, 1] and meta["cost"]["flops"] >= 0
    assert ps.module_name((tmp_path / ps.STEP_HLO).read_text()) == meta["module"] == "jit__step"
    assert json.loads((tmp_path / ps.STEP_META).read_text())["module"] == "jit__step"
    again = ps.save_step_program(tmp_path, step(False), state, [1.0, 2.0, 3.0], 0.5)
    assert again["compiled"].startswith("compiled again in ")


def test_an_async_ops_halves_match_whichever_way_they_are_printed():
    """XLA prints a wrapped slice's halves as slice-start / slice-done (syntax sugar, our HLO) or as
    async-start / async-done: the same instruction either way; another shape is another one."""
    start = "((bf16[16,8]), bf16[4,8], s32[])"
    assert ps._async_neutral(("slice-done", "bf16[4,8]")) == ps._async_neutral(("async-done", "bf16[4,8]"))
    assert ps._async_neutral(("slice-start", start)) == ps._async_neutral(("async-start", start))
    assert ps._async_neutral(("slice-done", "bf16[4,8]")) != ps._async_neutral(("async-done", "bf16[4,9]"))
    assert ps._async_neutral(("slice-done", "bf16[4,8]")) != ps._async_neutral(("async-start", "bf16[4,8]"))
    assert ps._async_neutral(("add", "f32[7]")) == ("add", "f32[7]")


def test_host_runs_are_grouped_by_their_run_id_however_dispatch_and_execution_interleave(tmp_path):
    """XLA:CPU dispatches asynchronously: run 1's ops may start after run 2 was dispatched (a
    loaded host). Its ops carry their execution's run_id, so each run keeps its own ops; split at
    the dispatches, run 1 had none and the test of the reference run counted 2 runs of 3."""
    from jax.profiler import ProfileData

    dispatches = [0.0, 1.0, 2.0]                         # us: PjitFunction(f) on the Python thread
    ops = [("dot.1", 1.5, 1.0, 11), ("add.2", 2.6, 0.2, 11),     # run 11: starts after the second dispatch
           ("dot.1", 3.0, 1.0, 12), ("add.2", 4.0, 0.2, 12), ("dot.1", 4.5, 1.0, 13), ("add.2", 5.5, 0.2, 13)]
    names = ["PjitFunction(f)", "dot.1", "add.2"]
    meta = "".join(f"  event_metadata {{ key: {k + 1} value {{ id: {k + 1} name: {json.dumps(n)} }} }}\n"
                   for k, n in enumerate(names))
    stats = "".join(f"  stat_metadata {{ key: {k + 1} value {{ id: {k + 1} name: {json.dumps(n)} }} }}\n"
                    for k, n in enumerate(["hlo_op", "hlo_module", "run_id"]))
    python = "".join(f"events {{ metadata_id: 1 offset_ps: {int(t * US)} duration_ps: {int(0.1 * US)} }} "
                     for t in dispatches)
    thunks = "".join(
        f"events {{ metadata_id: {names.index(op) + 1} offset_ps: {int(t * US)} duration_ps: {int(d * US)} "
        f"stats {{ metadata_id: 1 str_value: {json.dumps(op)} }} stats {{ metadata_id: 2 str_value: \"jit_f\" }} "
        f"stats {{ metadata_id: 3 int64_value: {run} }} }} " for op, t, d, run in ops)
    text = (f'planes {{\n  id: 1\n  name: "/host:CPU"\n'
            f'  lines {{ id: 1 name: "python" timestamp_ns: 0 {python}}}\n'
            f'  lines {{ id: 2 name: "tf_XLAEigen" timestamp_ns: 0 {thunks}}}\n{meta}{stats}}}\n')
    path = tmp_path / "host.xplane.pb"
    path.write_bytes(ProfileData.text_proto_to_serialized_xspace(text))
    plane, platform, runs, _ = ps.read_trace(path)
    assert (plane, platform) == ("/host:CPU", "cpu")
    assert [[(e.name, e.start_ns) for e in run.ops] for run in runs] == \
        [[(op, t * 1e3) for op, t, _, r in ops if r == run] for run in (11, 12, 13)]
    assert [run.duration_ns for run in runs] == pytest.approx([1300.0, 1200.0, 1200.0])


def test_two_summaries_side_by_side_by_category_and_op_group(tpu_profile, tmp_path, capsys):
    """`profile RUN --against OTHER`: summary.json files (what the chip sends back) or runs, per
    category and per (category, opcode, shape), the largest differences first."""
    root, _, _ = tpu_profile
    a = ps.summarize(root, top=1000)
    b = json.loads(json.dumps(a))
    slow = b["top"][0]
    slow["measured_ms"] += 5.0
    next(r for r in b["rows"] if r["row"] == slow["row"])["measured_ms"] += 5.0
    b["per_step_ms"]["wall"] += 5.0
    b["top"].append({**slow, "name": "extra.1", "opcode": "copy", "shape": "bf16[7,3]", "row": "copies / layout",
                     "measured_ms": 1.0, "events_per_step": 2.0})
    (tmp_path / "b.json").write_text(json.dumps(b))
    c = ps.compare(a, ps.read_summary(tmp_path / "b.json"), top=2)
    assert c["wall_ms"][1] - c["wall_ms"][0] == pytest.approx(5.0)
    assert c["listed_ms"][0] == pytest.approx(a["per_step_ms"]["ops"] - a["unmatched"]["ms"])   # every matched op
    first, second = c["ops"]
    assert (first["row"], first["opcode"], first["shape"]) == (slow["row"], slow["opcode"], slow["shape"])
    assert first["b_ms"] - first["a_ms"] == pytest.approx(5.0)
    assert (second["shape"], second["a_ms"], second["b_ms"], second["b_events"]) == ("bf16[7,3]", 0.0, 1.0, 2.0)
    row = next(r for r in c["rows"] if r["row"] == slow["row"])
    assert row["b_ms"] - row["a_ms"] == pytest.approx(5.0)
    assert main(["profile", str(root), "--against", str(tmp_path / "b.json"), "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "(A - B -5.00 ms)" in out and "bf16[7,3]" in out
    (tmp_path / "bad.json").write_text('{"rows": []}')
    with pytest.raises(UserError, match="bad.json: not a profile summary .*no top, per_step_ms"):
        ps.read_summary(tmp_path / "bad.json")
