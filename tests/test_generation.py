"""Generation through the compiled prefill + decode loop, on a briefly trained micro checkpoint:
greedy output equals eager PyTorch without a cache and transformers' `generate` on the exported
checkpoint (float32; prompts shorter and longer than the sliding window, batched with mixed
lengths), one compilation per bucket, a second process loads the programs from the persistent
cache, streaming, stop tokens, seeded sampling, and bad requests. Batches of 3-4 prompts share one
bucket (4 rows): each new bucket or sampling mode costs a compilation."""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from parity.generation import compare_greedy, eager_greedy, load_transformers, transformers_greedy
from torch_model.config import get_preset
from torch_model.model import GptOssForCausalLM
from formats.errors import UserError
from train.generation.generator import Generator, generate, load_model
from train.generation.sampling import SamplingConfig

WINDOW, VOCAB, NEW = 8, 128, 24
CFG = get_preset("tiny").replace(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                                 n_experts=4, expert_dim=32, sliding_window=WINDOW, max_seq_len=64,
                                 router_aux_loss_coef=0.01, bos_token_id=0, eos_token_id=0)
GREEDY = SamplingConfig(max_new_tokens=NEW, temperature=0)


def synthetic_batch(rng, rows=16, length=65):
    """Periodic copies (periods 3-12, longer than the window for some) and counting sequences:
    learnable in a few dozen steps, and they need attention to earlier tokens."""
    out = []
    for _ in range(rows):
        if rng.random() < 0.5:
            out.append(np.resize(rng.integers(1, VOCAB, rng.integers(3, 13)), length))
        else:
            out.append((rng.integers(0, VOCAB) + rng.integers(1, 4) * np.arange(length)) % VOCAB)
    return np.stack(out)[None].astype(np.int32)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(checkpoint dir, exported HF dir, eager model) after 60 steps of training."""
    from jax_bridge.lowering import params_to_torch
    from jax_bridge.step import StepConfig, TrainStep
    from formats.hf_export import export_checkpoint
    from torch_model.optim import OptimizerConfig
    from formats.checkpoint import save_checkpoint

    root = tmp_path_factory.mktemp("generation")
    torch.manual_seed(0)
    model = GptOssForCausalLM(CFG)
    step = TrainStep(model, OptimizerConfig(lr=0.02, adam_lr=0.006), StepConfig(kernels="xla"))
    state, rng, losses = step.init_state(), np.random.default_rng(0), []
    for _ in range(60):
        state, metrics = step(state, synthetic_batch(rng), 1.0)
        losses.append(float(metrics["ce"]))
    assert np.mean(losses[-10:]) < np.mean(losses[:10]) - 1.0, "the fixture model did not train"
    save_checkpoint(root / "ck", params_to_torch(state.params), CFG, step=60)
    export_checkpoint(root / "ck", root / "hf")
    return root / "ck", root / "hf", load_model(root / "ck")


@pytest.fixture(scope="module")
def generator(trained):
    return Generator.from_checkpoint(trained[0])


def prompts_around_the_window():
    rng = np.random.default_rng(7)
    pattern = rng.integers(1, VOCAB, 5)
    return [np.resize(pattern, 20).tolist(),                     # longer than the window (8)
            [3, 5, 7, 9, 11],                                    # shorter
            rng.integers(1, VOCAB, 13).tolist(),                 # longer, no pattern
            [42]]                                                # one token


def assert_greedy_equal(got, expected, margins):
    report = compare_greedy(got, expected, margins)
    assert all(r["ok"] for r in report), report
    return report


def test_greedy_batch_equals_eager_pytorch_without_cache_and_transformers_generate(trained, generator):
    _, hf_dir, model = trained
    prompts = prompts_around_the_window()
    result = generator.generate(prompts, GREEDY)
    eager, margins = eager_greedy(model, prompts, NEW)
    report = assert_greedy_equal(result.tokens, eager, margins)
    hf = transformers_greedy(load_transformers(hf_dir), prompts, NEW)
    assert_greedy_equal(hf, eager, margins)
    assert_greedy_equal(result.tokens, hf, margins)
    # The comparison must mean something: the model is trained, most steps are far from ties.
    assert sum(r["first_difference"] is None for r in report) >= 3
    assert np.median([m for row in margins for m in row]) > 0.05


def test_the_pallas_cached_attention_and_moe_generate_the_eager_greedy_tokens(trained):
    """cached_attention=pallas and moe=pallas (TPU's defaults; interpreted here) in prefill and
    decode, where the expert biases enter the loop in the kernels' [E, 1, N]: the eager model's
    greedy tokens, prompts longer than the sliding window included (the ring's chunk). A kernel
    option (`generate --kernel-options`) reaches the programs over the defaults."""
    _, _, model = trained
    prompts = prompts_around_the_window()
    generator = Generator(model, kernels="cached_attention=pallas,moe=pallas", kernel_options="moe.pallas.block_m=16")
    assert generator.decoder.kernel_options["moe"]["pallas"]["block_m"] == 16
    result = generator.generate(prompts, GREEDY)
    assert result.compilations and all(c.program in ("prefill", "decode") for c in result.compilations)
    assert_greedy_equal(result.tokens, *eager_greedy(model, prompts, NEW))


def test_a_kernel_option_the_implementation_does_not_take_is_refused_by_name(trained):
    with pytest.raises(UserError, match="moe.pallas.nonsense not accepted by moe=pallas"):
        Generator(trained[2], kernel_options="moe.pallas.nonsense=1")


def test_one_compilation_per_bucket_whatever_the_lengths(generator):
    """Batches of 3 or 4 prompts up to 32 tokens, up to 32 new tokens: bucket (4, 32, 64)."""
    bucket = (4, 32, 64)
    first = generator.generate(prompts_around_the_window()[:3], SamplingConfig(max_new_tokens=10, temperature=0))
    again = generator.generate([[9] * 30, [4, 5, 6], [1], [2, 2]], SamplingConfig(max_new_tokens=32, temperature=0))
    assert first.bucket == again.bucket == bucket
    greedy = GREEDY.mode(VOCAB)
    compiled = [c.program for c in generator.decoder.compilations
                if (c.program, c.bucket[:4]) in {("prefill", (*bucket, greedy)), ("decode", (4, 64, greedy, 4))}]
    assert sorted(compiled) == ["decode", "prefill"], generator.decoder.compilations
    assert again.compile_seconds == 0 and again.compilations == []
    assert len(again.tokens[0]) == 32 and first.decode_steps == 9


def test_samples_per_prompt_share_one_prefill_and_equal_the_prompts_repeated(trained, generator):
    """G samples per prompt (RL's groups): the prefill runs once per prompt (its rows bucketed from
    the prompt count) and its cache is copied G times; greedy, that equals the prompts repeated."""
    prompts = prompts_around_the_window()[:3]
    repeated = [p for p in prompts for _ in range(2)]
    _, margins = eager_greedy(trained[2], repeated, NEW)
    want = generator.generate(repeated, GREEDY)
    before = len(generator.decoder.compilations)
    got = generator.generate(prompts, GREEDY, samples_per_prompt=2)
    assert_greedy_equal(got.tokens, want.tokens, margins)
    assert got.bucket == want.bucket == (8, 32, 64) and got.rows == 6
    assert [(c.program, c.bucket[0], c.bucket[-1]) for c in generator.decoder.compilations[before:]] == \
        [("prefill", 4, 2)]             # 4 prompt rows, copied twice; the decode loop of 8 rows is reused
    sampled = generator.generate(prompts, SamplingConfig(max_new_tokens=16, temperature=1.0, seed=3),
                                 samples_per_prompt=2).tokens
    assert len(sampled) == 6 and any(sampled[2 * i] != sampled[2 * i + 1] for i in range(3))


def test_a_decode_profile_gives_a_decode_steps_time_by_op_category(generator, tmp_path, capsys):
    """`generate --profile DIR` (train/generation/cli.py): the second generate call traced, the
    decode loop's program saved beside the trace with the iterations it ran, and the profile
    summary per iteration; prefill is another program in the trace, not counted. The call's decode
    time on the host stands beside the program's run, and the device's idle time after the
    prefill beside them."""
    from train.generation.cli import DecodeProfiler

    prompts, sampling = [[3, 5, 7]], SamplingConfig(max_new_tokens=12, temperature=0)
    generator.generate(prompts, sampling)            # compiled and loaded before the trace, as the command does
    profiler = DecodeProfiler(tmp_path)
    result = generator.generate(prompts, sampling)
    profiler.finish(generator, result, sampling)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["module"], summary["runs"], summary["loop_steps"]) == ("jit_decode_loop", 1, 11)
    assert summary["per_step_ms"]["ops"] > 0 and any(r["measured_ms"] > 0 for r in summary["rows"])
    assert "jit_prefill" in {o["module"] for o in summary["other_programs"]}
    call = summary["call"]        # the decode time generate measured, beside the program's run in the trace
    assert call["host_ms"] == pytest.approx(result.decode_seconds * 1e3)
    # Queued behind the prefill, the loop may run before the first token reaches the host: the
    # difference is signed. The device's idle time before it is on the device's own clock.
    assert call["program_ms"] > 0 and call["outside_ms"] == pytest.approx(call["host_ms"] - call["program_ms"])
    assert call["previous_program"] == "jit_prefill" and call["idle_before_ms"] >= 0
    printed = capsys.readouterr().err
    assert "11 loop iterations in all" in printed and "per iteration" in printed and "outside the program" in printed
    assert "between jit_prefill's end and the program's start" in printed


def test_streaming_delivers_every_token_once_in_order(generator):
    chunks = []
    result = generator.generate(prompts_around_the_window()[:3], GREEDY, on_tokens=chunks.append, stream_every=5)
    assert [len(c[0]) for c in chunks] == [1, 5, 5, 5, 5, 3]
    for row in range(3):
        assert sum((c[row] for c in chunks), []) == result.tokens[row]


def test_an_unstreamed_call_queues_its_decode_loop_before_waiting_for_the_first_token(generator, monkeypatch):
    """Unstreamed, the decode loop is dispatched behind the prefill before the host waits for the
    first token, so the device runs the two back to back; streamed, the host sees the first
    token first (its caller may end rows). Both give the same tokens, also when every row stops
    at its first token and the queued loop runs no step."""
    from train.generation import generator as module

    prompts = prompts_around_the_window()[:3]
    generator.generate(prompts, GREEDY)         # compiled and run once (first_run) before anything is logged
    events, host, program = [], module._host, generator.decoder.decode_program
    monkeypatch.setattr(module, "_host", lambda a: events.append("wait") or host(a))

    def logged(*args, **kwargs):
        compiled = program(*args, **kwargs)
        return lambda *a: events.append("decode") or compiled(*a)

    monkeypatch.setattr(generator.decoder, "decode_program", logged)
    queued = generator.generate(prompts, GREEDY)
    assert events == ["decode", "wait", "wait"], events
    events.clear()
    streamed = generator.generate(prompts, GREEDY, on_tokens=lambda new: None)
    assert events == ["wait", "decode", "wait"], events
    assert queued.tokens == streamed.tokens and queued.decode_steps == streamed.decode_steps == NEW - 1
    firsts = tuple(dict.fromkeys(row[0] for row in queued.tokens))
    stopped = generator.generate(prompts, SamplingConfig(max_new_tokens=NEW, temperature=0, stop_tokens=firsts))
    assert stopped.tokens == [row[:1] for row in queued.tokens] and stopped.stopped == [True] * 3
    assert stopped.decode_steps == 0


def test_a_repeated_request_places_no_step_limit_on_the_device_again(generator, monkeypatch):
    """Each chunk's step limit (an int32 scalar) is placed on the device once and kept: streaming
    the same request again transfers the prompt and its sampling values, and nothing per chunk (a
    transfer to the device per call was part of decoding's fixed cost per call)."""
    import jax

    put, limits = jax.device_put, []

    def counted(x, *args, **kwargs):
        limits.extend(int(a) for a in jax.tree.leaves(x) if np.ndim(a) == 0 and np.asarray(a).dtype == np.int32)
        return put(x, *args, **kwargs)

    monkeypatch.setattr(jax, "device_put", counted)
    placed = []
    for _ in range(2):
        limits.clear()
        chunks = []
        generator.generate(prompts_around_the_window()[:3], GREEDY, on_tokens=chunks.append, stream_every=7)
        placed.append(list(limits))
    assert [len(c[0]) for c in chunks] == [1, 7, 7, 7, 2]
    # The decode calls' limits 8, 15, 22 and 24 (24 = NEW and 0, the first run's, where no earlier
    # test placed them), the first time only.
    assert {8, 15, 22} <= set(placed[0]) <= {0, 8, 15, 22, 24} and placed[1] == [], placed


def test_a_stop_token_ends_its_row_and_the_others_continue(generator):
    prompts = prompts_around_the_window()[:3]
    free = generator.generate(prompts, GREEDY).tokens
    stop = free[0][6]
    assert stop not in free[1][:NEW]            # else both rows would stop
    first = free[0].index(stop)
    result = generator.generate(prompts, SamplingConfig(max_new_tokens=NEW, temperature=0, stop_tokens=(stop,)))
    assert result.tokens[0] == free[0][:first + 1] and result.stopped[:2] == [True, False]
    assert result.tokens[1] == free[1]


def test_sampling_is_reproducible_by_seed_and_varies_across_seeds(generator):
    prompts = prompts_around_the_window()[:3]
    settings = dict(max_new_tokens=16, temperature=1.2, top_k=20, top_p=0.95, repetition_penalty=1.2)
    a = generator.generate(prompts, SamplingConfig(seed=1, **settings)).tokens
    b = generator.generate(prompts, SamplingConfig(seed=1, **settings)).tokens
    c = generator.generate(prompts, SamplingConfig(seed=2, **settings)).tokens
    assert a == b and a != c
    assert all(0 <= t < VOCAB for row in a + c for t in row)


def test_generate_takes_sampling_fields_or_a_config(generator):
    prompt = prompts_around_the_window()[1:4]
    want = generator.generate(prompt, SamplingConfig(max_new_tokens=4, temperature=0)).tokens
    assert generate(generator, prompt, max_new_tokens=4, temperature=0).tokens == want
    assert generate(generator, prompt, GREEDY, max_new_tokens=4).tokens == want


@pytest.mark.parametrize("prompts, sampling, message", [
    ([[]], GREEDY, "at least one token"),
    ([[1, VOCAB]], GREEDY, f"token id {VOCAB} is outside"),
    ([[1] * 10], SamplingConfig(max_new_tokens=CFG.max_position_embeddings), "max_position_embeddings"),
])
def test_bad_requests_are_one_line_errors(generator, prompts, sampling, message):
    with pytest.raises(UserError, match=message):
        generator.generate(prompts, sampling)


@pytest.mark.parametrize("field, value", [("temperature", -1), ("top_p", 0), ("top_k", -2), ("max_new_tokens", 0),
                                          ("repetition_penalty", 0)])
def test_sampling_settings_are_validated(field, value):
    with pytest.raises(UserError, match=field):
        SamplingConfig(**{field: value})


def test_a_second_process_loads_the_programs_from_the_persistent_cache(trained, tmp_path):
    """Also the batch-1 programs (matrix-vector layout, MoE one row at a time) against eager torch."""
    prompt = prompts_around_the_window()[0]                  # longer than the window
    script = textwrap.dedent(f"""
        import json, sys
        from train.generation.generator import Generator
        from train.generation.sampling import SamplingConfig
        g = Generator.from_checkpoint({str(trained[0])!r}, compile_cache={str(tmp_path / 'cache')!r})
        r = g.generate([{prompt!r}], SamplingConfig(max_new_tokens={NEW}, temperature=0))
        print(json.dumps({{"tokens": r.tokens, "from_cache": [c.from_cache for c in r.compilations]}}))
    """)
    # Its own cache directory only (not the suite's shared one, where the first run could already hit).
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"} | {"JAX_PLATFORMS": "cpu"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs = [json.loads(subprocess.run([sys.executable, "-c", script], cwd=root, env=env, check=True,
                                      capture_output=True, text=True).stdout.strip().splitlines()[-1])
            for _ in range(2)]
    assert runs[0]["from_cache"] == [False, False] and runs[1]["from_cache"] == [True, True]
    eager, margins = eager_greedy(trained[2], [prompt], NEW)
    for run in runs:
        assert_greedy_equal(run["tokens"], eager, margins)
