"""Inference on several processes: two processes with 2 simulated CPU devices each, one
cluster start for every scenario (tests/cluster_worker.py), against one process on one device.
A released-layout directory is read onto the global mesh slice by slice (each process its own
devices' blocks); greedy generation gives the one-process tokens where the greedy margins are clear,
the compiled scorer and `eval --tasks` the one-process log-likelihoods within 1e-5, `lm-eval` the
same per-example results, and a LoRA run on `fsdp=2,expert=2` the one-process losses within 1e-5;
process 0 alone writes."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster_scenarios import cli_runs, generation, loglikelihoods, prompt_ids, NEW
from tests.worker_env import worker_env

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("lm_eval")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    from helpers import prepare_play_corpus
    from test_lm_eval_backend import write_tasks
    from test_mxfp4 import RELEASED, write_released
    from test_mxfp4_base import decisive_head

    from formats.tokenizer import load_tokenizer, save_tokenizer

    root = tmp_path_factory.mktemp("cluster")
    data = prepare_play_corpus(root)
    write_released(root / "hf", RELEASED.replace(n_experts=4), seed=5)
    decisive_head(root / "hf", 30.0)
    save_tokenizer(load_tokenizer(data), root / "hf" / "tiktoken")
    (root / "plays.jsonl").write_text("".join(
        json.dumps({"context": f"{who}:", "choices": ["But soft", "O Romeo", "To be"], "gold": i}) + "\n"
        for i, who in enumerate(["ROMEO", "JULIET", "HAMLET"])))
    write_tasks(root / "lm_tasks")
    return root


@pytest.fixture(scope="module")
def one_process(root):
    """Every scenario in this process, on one device (no mesh)."""
    return {"tokens": generation(root, None), "logprobs": loglikelihoods(root, None), "cli": cli_runs(root, "one", [])}


@pytest.fixture(scope="module")
def two_processes(root, one_process):
    from test_multihost import free_port, outputs_of

    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "cluster_worker.py"), str(port), str(i), str(root)],
                              cwd=ROOT, env=worker_env(2), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    outputs = outputs_of(procs, timeout=900)
    assert "RESULT " not in outputs[1]
    return json.loads(next(line for line in outputs[0].splitlines() if line.startswith("RESULT "))[7:])


def test_generation_over_two_processes_gives_the_one_process_tokens(root, one_process, two_processes):
    from parity.generation import compare_greedy, eager_greedy
    from train.generation.generator import load_for_generation

    model, _ = load_for_generation(root / "hf")
    eager, margins = eager_greedy(model, prompt_ids(root), NEW)
    assert all(r["ok"] for r in compare_greedy(one_process["tokens"], eager, margins))
    report = compare_greedy(two_processes["tokens"], one_process["tokens"], margins)
    assert all(r["ok"] for r in report), report


def test_scores_over_two_processes_equal_one_process(root, one_process, two_processes):
    for two, one in zip(two_processes["logprobs"], one_process["logprobs"], strict=True):
        assert abs(two - one) <= 1e-5 * max(1.0, abs(one)), (two_processes["logprobs"], one_process["logprobs"])
    one, two = (json.loads((root / f"eval-{n}.json").read_text()) for n in ("one", "two0"))
    assert not (root / "eval-two1.json").exists()                   # process 0 alone writes
    for a, b in zip(one["tasks"], two["tasks"], strict=True):
        assert a["task"] == b["task"] and a["score"] == b["score"], (a, b)


def test_lm_eval_over_two_processes_gives_the_same_examples(root, two_processes):
    from test_lm_eval_backend import logged_samples

    one, two = logged_samples(root / "lm-eval-one"), logged_samples(root / "lm-eval-two")
    for name in ("tl_mc",):
        a, b = (sorted(x[name], key=lambda s: s["doc_id"]) for x in (one, two))
        assert len(a) == len(b) > 0, name
        for x, y in zip(a, b):
            for rx, ry in zip(x["resps"], y["resps"], strict=True):
                assert abs(float(rx[0][0]) - float(ry[0][0])) <= 1e-5 * max(1.0, abs(float(rx[0][0]))), (name, x, y)
                assert str(rx[0][1]) == str(ry[0][1]), (name, x["doc_id"])


def test_a_lora_run_over_two_processes_gives_the_one_process_losses(root, two_processes):
    def losses(run):
        return [r["loss"] for r in map(json.loads, (root / run / "metrics.jsonl").read_text().splitlines())
                if r["kind"] == "train"]

    one, two = losses("lora-one"), losses("lora-two")
    assert len(one) == len(two) == 3
    assert max(abs(a - b) / abs(a) for a, b in zip(one, two)) < 1e-5, (one, two)
