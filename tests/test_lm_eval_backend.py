"""The lm-eval backend: `torchlyra lm-eval` on local JSON tasks (multiple choice, loglikelihood,
loglikelihood_rolling over several windows) gives lm-eval's own `hf` backend's per-example
results and metrics on the same exported model (float32); argument handling and bad input."""
import json
from pathlib import Path

import pytest
import torch

from tests.helpers import PLAY_LINES, lm_eval_reads_only_the_included_tasks
from torch_model.config import get_preset
from torch_model.model import GptOssForCausalLM
from formats.errors import UserError

lm_eval = pytest.importorskip("lm_eval")

MAX_LENGTH = 32
TASKS = {
    "tl_mc": ("multiple_choice", 'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{gold}}"',
              ["acc", "acc_norm"]),
    "tl_ll": ("loglikelihood", 'doc_to_text: "{{context}}"\ndoc_to_target: "{{continuation}}"', ["perplexity", "acc"]),
    "tl_roll": ("loglikelihood_rolling", 'doc_to_text: ""\ndoc_to_target: "{{text}}"', ["word_perplexity"]),
}


def task_docs() -> dict[str, list[dict]]:
    answers = [line.split(": ", 1)[1] for line in PLAY_LINES]
    return {
        "tl_mc": [{"question": line.split(":")[0] + " says:", "choices": answers, "gold": i}
                  for i, line in enumerate(PLAY_LINES)],
        # the last one has an empty context: scored after the prefix token (BOS)
        "tl_ll": [{"context": line[:len(line) // 2], "continuation": line[len(line) // 2:]} for line in PLAY_LINES]
        + [{"context": "", "continuation": "ROMEO: soft"}],
        "tl_roll": [{"text": " ".join(PLAY_LINES)}, {"text": PLAY_LINES[0]}],      # several windows, one
    }


def write_tasks(directory: Path) -> None:
    directory.mkdir()
    for name, docs in task_docs().items():
        data = directory / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        output_type, fields, metrics = TASKS[name]
        metric_list = "".join(f"  - metric: {m}\n" for m in metrics)
        (directory / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
            f"output_type: {output_type}\n{fields}\nmetric_list:\n{metric_list}")


def export_random_model(root: Path, vocab_size: int) -> Path:
    """A Hugging Face dir of a random model with a BPE tokenizer whose BOS is the model's."""
    from formats.hf_export import export_checkpoint
    from formats.checkpoint import save_checkpoint
    from formats.tokenizer import train_bpe

    enc = train_bpe(PLAY_LINES * 30, 320)
    bos = enc._special_tokens["<|bos|>"]
    cfg = get_preset("tiny").replace(vocab_size=vocab_size, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                     head_dim=16, n_experts=4, expert_dim=32, sliding_window=8,
                                     max_seq_len=MAX_LENGTH, bos_token_id=bos, eos_token_id=bos)
    torch.manual_seed(0)
    model = GptOssForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0, 0.1)
    save_checkpoint(root / "ck", model.state_dict(), cfg, step=3, tokenizer=enc)
    assert export_checkpoint(root / "ck", root / "hf")["tokenizer"].startswith("transformers: tokenizer.json")
    return root / "hf"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(Hugging Face dir of a random model, tasks dir)."""
    root = tmp_path_factory.mktemp("lm_eval")
    hf = export_random_model(root, 384)
    write_tasks(root / "tasks")
    return hf, root / "tasks"


def logged_samples(output_path: Path) -> dict[str, list[dict]]:
    return {name: [json.loads(line) for f in output_path.rglob(f"samples_{name}_*.jsonl") for line in f.open()]
            for name in TASKS}


def test_our_backend_gives_the_hf_backends_results_example_by_example(exported, tmp_path, monkeypatch, capsys):
    import re

    from lm_eval.tasks import TaskManager

    from train.cli import main

    hf_dir, tasks = exported
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with lm_eval_reads_only_the_included_tasks():
        assert main(["lm-eval", "--model_args", f"checkpoint={hf_dir},max_length={MAX_LENGTH}", "--tasks",
                     ",".join(TASKS), "--include_path", str(tasks), "--batch_size", "8", "--log_samples",
                     "--output_path", str(tmp_path / "ours")]) == 0
    # Where the command's time went: lm-eval's set-up and our model's loading, then the scoring.
    assert re.search(r"^time [\d.]+ s: imports [\d.]+ s, lm-eval's set-up and loading the model [\d.]+ s, "
                     r"lm-eval's tasks and scoring [\d.]+ s; inside them .*compile [\d.]+ s; compilation cache",
                     capsys.readouterr().out, re.M)
    ours = logged_samples(tmp_path / "ours")
    results = json.loads(next((tmp_path / "ours").rglob("results_*.json")).read_text())["results"]
    theirs = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={hf_dir},dtype=float32,max_length={MAX_LENGTH}", tasks=list(TASKS),
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False), batch_size=8,
        device="cpu", log_samples=True, bootstrap_iters=0)
    for name, docs in task_docs().items():
        mine = sorted(ours[name], key=lambda s: s["doc_id"])
        hf = sorted(theirs["samples"][name], key=lambda s: s["doc_id"])
        assert len(mine) == len(hf) == len(docs), name
        for a, b in zip(mine, hf):
            for ra, rb in zip(a["resps"], b["resps"], strict=True):
                got, want = (ra[0], rb[0]) if name != "tl_roll" else ([ra[0]], [rb[0]])
                assert abs(float(got[0]) - float(want[0])) <= 1e-4 * abs(float(want[0])), (name, a["doc_id"], got, want)
                assert [str(v) for v in got[1:]] == [str(v) for v in want[1:]], (name, a["doc_id"], got, want)  # greedy
            for metric in TASKS[name][2]:
                if metric in b:          # per-example metric values (perplexity aggregates apart)
                    assert a[metric] == pytest.approx(b[metric], rel=1e-4), (name, metric, a["doc_id"])
        for metric in TASKS[name][2]:
            key = f"{metric},none"
            assert results[name][key] == pytest.approx(theirs["results"][name][key], rel=1e-4), (name, metric)


def test_lm_eval_argv_runs_the_torchlyra_model_unless_told_otherwise():
    from train.evaluation.lm_eval_cli import lm_eval_argv

    assert lm_eval_argv(["--tasks", "t"]) == ["lm-eval", "run", "--model", "torchlyra", "--tasks", "t"]
    assert lm_eval_argv(["run", "--model", "hf"]) == ["lm-eval", "run", "--model", "hf"]
    assert lm_eval_argv(["ls", "tasks"]) == ["lm-eval", "ls", "tasks"]
    assert lm_eval_argv(["--help"]) == ["lm-eval", "--help"]


def test_the_backend_is_registered_beside_lm_evals_own():
    from lm_eval.api.registry import get_model

    from train.evaluation.lm_eval_backend import TorchlyraLM, register

    register()
    assert get_model("torchlyra") is TorchlyraLM
    assert get_model("hf").__name__ == "HFLM"


def test_bad_model_arguments_are_one_line_errors(exported):
    from train.evaluation.lm_eval_backend import TorchlyraLM

    with pytest.raises(UserError, match="give --model_args checkpoint=DIR"):
        TorchlyraLM()
    with pytest.raises(UserError, match="takes a number of rows, found 'auto'"):
        TorchlyraLM(checkpoint=str(exported[0]), batch_size="auto")
    # An argument it does not take is named, never ignored; lm-eval's --device too.
    with pytest.raises(UserError, match=r"unknown argument\(s\) base_dtyp, dtype for the torchlyra backend"):
        TorchlyraLM(checkpoint=str(exported[0]), base_dtyp="mxfp4", dtype="float32")
    with pytest.raises(UserError, match="--device cpu: not taken by the torchlyra backend"):
        TorchlyraLM(checkpoint=str(exported[0]), device="cpu")     # lm-eval's default, cuda:0, is "not given"
    with pytest.raises(UserError, match="base_dtype: expected one of compute, mxfp4, found 'fp8'"):
        TorchlyraLM(checkpoint=str(exported[0]), base_dtype="fp8")
    with pytest.raises(UserError, match="released"):          # taken, and the loader names why not this one
        TorchlyraLM(checkpoint=str(exported[0]), base_dtype="mxfp4")
    with pytest.raises(UserError, match="--merge: .* holds no LoRA adapters"):
        TorchlyraLM(checkpoint=str(exported[0]), merge=True)


def test_generate_until_sends_greedy_requests_with_the_stop_strings(exported):
    """The request translation only: generation itself is train.evaluation.greedy's (and its tests')."""
    from lm_eval.api.instance import Instance

    from train.evaluation.lm_eval_backend import TorchlyraLM
    from train.evaluation.requests import GenerationResult

    lm = TorchlyraLM(checkpoint=str(exported[0]), max_length=MAX_LENGTH)
    seen = []
    lm.scorer.generate = lambda requests: seen.extend(requests) or [GenerationResult("out", (1,), 0) for _ in requests]
    ask = lambda context, kwargs: Instance("generate_until", {}, (context, kwargs), 0)
    assert lm.generate_until([ask("ROMEO:", {"until": ["\n"], "max_gen_toks": 5}), ask("", {})]) == ["out", "out"]
    eos = lm.tokenizer.decode([lm.eot_token_id])
    assert seen[0].prompt == tuple(lm.tokenizer.encode("ROMEO:")) and seen[0].max_new_tokens == 5
    assert seen[0].stop == ("\n", eos) and seen[1].prompt == (lm.prefix_token_id,) and seen[1].stop == (eos,)
    with pytest.raises(UserError, match="decodes greedily only"):
        lm.generate_until([ask("ROMEO:", {"do_sample": True, "temperature": 0.7})])


def test_generate_until_gives_the_hf_backends_greedy_text(tmp_path):
    """End to end: the scorer's greedy generation (train.evaluation.greedy) against lm-eval's own
    `hf` backend on the exported model, stop strings and token limits as lm-eval passes them. The
    model's vocabulary is the tokenizer's: ours never picks an id the tokenizer cannot decode, hf
    would."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from train.evaluation.lm_eval_backend import TorchlyraLM

    model_dir = export_random_model(tmp_path, 320)
    ask = lambda context, kwargs: Instance("generate_until", {}, (context, kwargs), 0)
    requests = [ask("ROMEO: But soft", {"until": ["\n\n"], "max_gen_toks": 12}),
                ask("JULIET:", {"until": ["o"], "max_gen_toks": 12}),
                ask("HAMLET: To be, or not", {"until": ["zz"], "max_gen_toks": 6})]
    ours = TorchlyraLM(checkpoint=str(model_dir), max_length=MAX_LENGTH).generate_until(requests)
    hf = HFLM(pretrained=str(model_dir), dtype="float32", batch_size=1, max_length=MAX_LENGTH, device="cpu")
    assert ours == hf.generate_until(requests)
    assert any(text for text in ours)
