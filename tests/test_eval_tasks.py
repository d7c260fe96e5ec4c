"""Task evaluation: prompt formats, scores of hand-made multiple-choice, language-modelling and
generative tasks against a direct computation with the eager model, centered accuracy, truncation,
the real CORE-6 files (BIG-bench archive fetched once), bad input, and `eval --tasks` end to end."""
import json
from pathlib import Path

import pytest
import tiktoken
import torch

from torch_model.config import get_preset
from torch_model.model import GptOssForCausalLM
from train.data import pinned_download
from train.cli import main
from formats.tokenizer import PAT_STR
from formats.errors import UserError
from train.evaluation.eager_scorer import EagerScorer
from train.evaluation.prompts import PromptBuilder
from train.evaluation.requests import GenerationResult
from train.evaluation.runner import run_task
from train.evaluation.tasks import Example, Task, TaskSettings, read_task_file

WINDOW = 48
CFG = get_preset("tiny").replace(d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16,
                                 n_experts=2, experts_per_token=1, expert_dim=32, sliding_window=16,
                                 max_seq_len=WINDOW)
TEXT = ["The capital of France is Paris.", "Two plus two is four.", "Red, green and blue are colours."] * 20


@pytest.fixture(scope="module")
def tokenizer():
    from formats.tokenizer import train_bpe

    return train_bpe(TEXT, vocab_size=300)       # the harmony chat tokens and <|bos|> included


@pytest.fixture(scope="module")
def model(tokenizer):
    torch.manual_seed(0)
    bos = tokenizer.n_vocab - 1      # every id the model can pick is decodable (as eager greedy assumes)
    m = GptOssForCausalLM(CFG.replace(vocab_size=tokenizer.n_vocab, bos_token_id=bos, eos_token_id=bos))
    return m.float().eval()


def continuation_logprobs(model, ids: list[int], n: int) -> tuple[float, bool]:
    """(sum of log p of the last n ids, all of them argmax) from one direct forward, last WINDOW+1 ids."""
    ids = ids[-(WINDOW + 1):]
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids[:-1]])).float(), -1)[0, -n:]
    target = torch.tensor(ids[-n:])
    return float(logprobs.gather(-1, target[:, None]).sum()), bool((logprobs.argmax(-1) == target).all())


def answer_ids(enc, prefix: str, answer: str) -> tuple[list[int], int]:
    """(all ids after BOS, answer token count): the answer's tokens are what follows the prefix's own."""
    whole = enc.encode_ordinary(prefix + answer)
    return whole, len(whole) - len(enc.encode_ordinary(prefix))


MC = Task(TaskSettings(name="mc", kind="multiple_choice", num_fewshot=1),
          (Example("Colour of the sky:", "blue", ("red", "blue", "green"), 1),
           Example("Capital of France:", "Paris", ("Paris", "Rome", "two"), 0),
           Example("Two plus two:", "four", ("three", "four", "a colour"), 1),
           Example("Sum of one and one:", "two", ("two", "Paris", "blue and green"), 0)))


def test_fewshot_prompt_format(tokenizer, model):
    """Example 1 with one shot: the drawn shot, its answer, a blank line, then the question; the
    context starts with BOS and each choice's tokens follow the context's."""
    import random

    shot = random.Random(1234 + 1).sample([0, 2, 3], 1)[0]
    builder = PromptBuilder(MC, tokenizer, bos=model.cfg.bos_token_id)
    prefix = f"{MC.examples[shot].context} {MC.examples[shot].answer}\n\nCapital of France:"
    assert builder.plain_prefix(1) == prefix
    requests = builder.loglikelihood_requests(1)
    assert len(requests) == 3
    for request, choice in zip(requests, MC.examples[1].choices):
        assert request.context == (model.cfg.bos_token_id, *tokenizer.encode_ordinary(prefix))
        assert tokenizer.decode(list(request.continuation)) == " " + choice
    assert builder.loglikelihood_requests(1) == requests      # the shots are fixed by the seed


def test_multiple_choice_against_direct_computation(tokenizer, model):
    """Raw and per-token accuracy, the task's pick (per token), baseline 1/3 and centered accuracy
    equal a direct computation from the model's log-probabilities."""
    result = run_task(MC, scorer=EagerScorer(model), generator=None, tokenizer=tokenizer,
                      bos=model.cfg.bos_token_id, progress=False)
    builder = PromptBuilder(MC, tokenizer, bos=model.cfg.bos_token_id)
    raw_hits = norm_hits = 0
    for i, example in enumerate(MC.examples):
        scores = []
        for choice in example.choices:
            ids, n = answer_ids(tokenizer, builder.plain_prefix(i), " " + choice)
            scores.append((continuation_logprobs(model, [model.cfg.bos_token_id, *ids], n)[0], n))
        raw = [s for s, _ in scores]
        norm = [s / n for s, n in scores]
        assert result["per_example"][i]["logprobs"] == pytest.approx(raw, rel=1e-5, abs=1e-5)
        raw_hits += raw.index(max(raw)) == example.gold
        norm_hits += norm.index(max(norm)) == example.gold
    assert result["accuracy_raw"] == raw_hits / 4 and result["accuracy_per_token"] == norm_hits / 4
    assert result["score"] == norm_hits / 4
    assert result["baseline"] == pytest.approx(1 / 3)
    assert result["centered"] == pytest.approx((norm_hits / 4 - 1 / 3) / (2 / 3))
    assert result["examples"] == 4 and result["truncated"] == 0


def test_language_modeling_exact_match_and_truncation(tokenizer, model):
    """Exact match is every continuation token being the argmax: equal to a direct forward; a
    prompt longer than the window loses tokens on the left and is counted."""
    long_context = "Red, green and blue are colours. " * 12 + "The capital of France is"
    examples = (Example("Two plus two is", "four."), Example(long_context, "Paris."), Example("Red", ", green"))
    task = Task(TaskSettings(name="lm", kind="language_modeling"), examples)
    scorer = EagerScorer(model)
    result = run_task(task, scorer=scorer, generator=None, tokenizer=tokenizer, bos=model.cfg.bos_token_id,
                      progress=False)
    for i, e in enumerate(examples):
        ids, n = answer_ids(tokenizer, e.context, " " + e.answer)
        logprob, greedy = continuation_logprobs(model, [model.cfg.bos_token_id, *ids], n)
        assert result["per_example"][i]["logprob"] == pytest.approx(logprob, rel=1e-5, abs=1e-5)
        assert result["per_example"][i]["correct"] == greedy
    long_tokens = 1 + len(tokenizer.encode_ordinary(long_context + " Paris."))
    assert long_tokens > WINDOW + 1 and result["truncated"] == 1
    assert result["baseline"] == 0 and result["centered"] == result["score"]


class ScriptedGenerator:
    """Answers each generation request with a given text (the scoring, not the model, is tested)."""

    def __init__(self, texts):
        self.texts, self.requests = list(texts), []

    def generate(self, requests):
        self.requests += requests
        return [GenerationResult(text=self.texts.pop(0), tokens=(), truncated=0) for _ in requests]


def test_generative_exact_match_after_stop(tokenizer, model):
    """The output is cut before the first stop string and compared stripped with the reference."""
    task = Task(TaskSettings(name="gen", kind="generative", stop=("\n", "."), max_new_tokens=7),
                (Example("Capital of France:", "Paris"), Example("Two plus two:", "four"), Example("Sky:", "blue")))
    generator = ScriptedGenerator([" Paris\nRome", " four. And", "green"])
    result = run_task(task, scorer=None, generator=generator, tokenizer=tokenizer, bos=model.cfg.bos_token_id,
                      progress=False)
    assert [e["correct"] for e in result["per_example"]] == [True, True, False]
    assert result["score"] == pytest.approx(2 / 3)
    first = generator.requests[0]
    assert first.prompt == (model.cfg.bos_token_id, *tokenizer.encode_ordinary("Capital of France:"))
    assert first.stop == ("\n", ".") and first.max_new_tokens == 7


def test_chat_task_renders_harmony(tokenizer, model):
    """A chat task: a user turn per question, the shots as assistant `final` replies, the answer
    scored after the reply's channel header."""
    from train.generation import chat

    task = Task(TaskSettings(name="chat", kind="language_modeling", chat=True, num_fewshot=1),
                (Example("Two plus two?", "four"), Example("Capital of France?", "Paris")))
    request = PromptBuilder(task, tokenizer, bos=model.cfg.bos_token_id).loglikelihood_requests(0)[0]
    expected = chat.render(tokenizer, [chat.Message("user", "Capital of France?"),
                                       chat.Message("assistant", "Paris", "final"),
                                       chat.Message("user", "Two plus two?")])
    expected += [chat.special(tokenizer, chat.CHANNEL), *tokenizer.encode_ordinary("final"),
                 chat.special(tokenizer, chat.MESSAGE)]
    assert list(request.context) == expected
    assert list(request.continuation) == tokenizer.encode_ordinary("four")


def test_chat_task_needs_chat_tokenizer(model):
    plain = tiktoken.Encoding(name="bytes", pat_str=r"\S+|\s+", mergeable_ranks={bytes([b]): b for b in range(256)},
                              special_tokens={"<|bos|>": 256})
    task = Task(TaskSettings(name="chat", kind="language_modeling", chat=True), (Example("a", "b"),))
    with pytest.raises(UserError, match="harmony special tokens"):
        PromptBuilder(task, plain, bos=256)


# ---- task files ----------------------------------------------------------------------------------
def write_lines(path, *records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_task_file_shapes(tmp_path):
    mc = read_task_file(write_lines(tmp_path / "mc.jsonl", {"task": {"num_fewshot": 2, "normalize": "none"}},
                                    {"context": "Q1", "choices": ["a", "b"], "gold": 1},
                                    {"type": "multiple_choice", "context": "Q2", "choices": ["a", "b", "c", "d"], "gold": 0}))
    assert (mc.name, mc.settings.kind, mc.settings.num_fewshot, mc.settings.normalize) == ("mc", "multiple_choice", 2, "none")
    assert mc.examples[0] == Example("Q1", "b", ("a", "b"), 1)
    assert mc.baseline == pytest.approx((1 / 2 + 1 / 4) / 2)
    lm = read_task_file(write_lines(tmp_path / "lm.jsonl", {"context": "c", "continuation": "d"}))
    gen = read_task_file(write_lines(tmp_path / "gen.jsonl", {"prompt": "p", "reference": "r"}))
    assert (lm.settings.kind, gen.settings.kind) == ("language_modeling", "generative")


@pytest.mark.parametrize("lines, expected", [
    (['{"context": "c", "continuation": "d"}', '{"context": "c", "continuation": '], r"bad\.jsonl:2: not a JSON object"),
    (['{"context": "c", "choices": ["a", "b"], "gold": 2}'], r"bad\.jsonl:1: field 'gold' expected an index in \[0, 2\)"),
    (['{"context": "c", "continuation": "d"}', '{"prompt": "p", "reference": "r"}'], r"bad\.jsonl:2: type generative in a language_modeling task"),
    (['{"question": "q"}'], r"bad\.jsonl:1: cannot tell the task type"),
    (['{"task": {"shots": 3}}', '{"prompt": "p", "reference": "r"}'], r"bad\.jsonl:1: field 'task' expected an object"),
])
def test_malformed_task_file_names_the_line(tmp_path, lines, expected):
    with pytest.raises(UserError, match=expected):
        read_task_file(write_lines(tmp_path / "bad.jsonl", *lines))


# ---- the command ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer, model):
    """(checkpoint with the chat-capable BPE, checkpoint whose tokenizer has no chat tokens)."""
    from formats.checkpoint import save_checkpoint

    root = tmp_path_factory.mktemp("evaltasks")
    plain = tiktoken.Encoding(name="bytes", pat_str=PAT_STR,
                              mergeable_ranks={bytes([b]): b for b in range(256)}, special_tokens={"<|bos|>": 256})
    chat_ck = save_checkpoint(root / "chat", model.state_dict(), model.cfg, step=7, tokenizer=tokenizer,
                              extra={"train_config": {"micro_batches": 1, "batch_size": 4, "seq_len": 32}})
    plain_model = GptOssForCausalLM(model.cfg.replace(bos_token_id=256, eos_token_id=256))
    plain_ck = save_checkpoint(root / "plain", plain_model.state_dict(), plain_model.cfg, step=0, tokenizer=plain)
    return chat_ck, plain_ck


def one_error_line(capsys, argv, expected):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err, err


def test_bad_inputs_one_line_exit_2(tmp_path, capsys, checkpoints):
    chat_ck, plain_ck = checkpoints
    one_error_line(capsys, ["eval", "--checkpoint", str(chat_ck), "--tasks", "core,mmlu"],
                   "unknown task 'mmlu'; known: core, humaneval, qa_wikidata")
    bad = write_lines(tmp_path / "bad.jsonl", {"context": "c", "continuation": "d"}, "{oops")
    one_error_line(capsys, ["eval", "--checkpoint", str(chat_ck), "--tasks", str(bad), "--scorer", "eager"],
                   f"{bad}:2: not a JSON object")
    chat_task = write_lines(tmp_path / "chat.jsonl", {"task": {"chat": True}}, {"context": "c", "continuation": "d"})
    one_error_line(capsys, ["eval", "--checkpoint", str(plain_ck), "--tasks", str(chat_task), "--scorer", "eager"],
                   "chat needs a tokenizer with the harmony special tokens")


def test_eval_tasks_end_to_end(tmp_path, capsys, checkpoints, tokenizer, model):
    """`eval --tasks FILE.jsonl,... --json --report` on the compiled scorer and generator: the
    per-example log-likelihoods equal the eager runner's (float32, 1e-4), the generated text the
    eager greedy tokens' (cut at the stop string); the report card has one row per task and the
    model's step and tokens seen."""
    from parity.generation import eager_greedy
    from train.evaluation.greedy import cut_at_stop

    chat_ck, _ = checkpoints
    records = [{"context": e.context, "choices": list(e.choices), "gold": e.gold} for e in MC.examples]
    mc = write_lines(tmp_path / "mc.jsonl", {"task": {"num_fewshot": 1}}, *records)
    lm = write_lines(tmp_path / "lm.jsonl", {"context": "Two plus two is", "continuation": "four."},
                     {"context": "Red, green and blue are colours. " * 12, "continuation": "Red"})
    gen = write_lines(tmp_path / "gen.jsonl", {"task": {"stop": ["."], "max_new_tokens": 6}},
                      {"prompt": "The capital of France is", "reference": "Paris"},
                      {"prompt": "Two plus two", "reference": "is four"})
    out, card = tmp_path / "eval.json", tmp_path / "card.md"
    assert main(["eval", "--checkpoint", str(chat_ck), "--tasks", f"{mc},{lm},{gen}", "--json", str(out),
                 "--report", str(card), "--no-progress", "--batch-size", "4"]) == 0
    evaluation = json.loads(out.read_text())
    assert [t["task"] for t in evaluation["tasks"]] == ["mc", "lm", "gen"] and evaluation["scorer"] == "compiled"
    got = {t["task"]: t for t in evaluation["tasks"]}
    lm_task = read_task_file(lm)
    for task in (MC, lm_task):
        expected = run_task(task, scorer=EagerScorer(model), generator=None, tokenizer=tokenizer,
                            bos=model.cfg.bos_token_id, progress=False)
        for mine, ref in zip(got[task.name]["per_example"], expected["per_example"]):
            key = "logprobs" if task is MC else "logprob"
            assert mine[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-4)
            assert mine["correct"] == ref["correct"]
        assert got[task.name]["truncated"] == expected["truncated"]
    assert got["lm"]["truncated"] == 1
    bos = model.cfg.bos_token_id
    prompts = [[bos, *tokenizer.encode_ordinary(p)] for p in ("The capital of France is", "Two plus two")]
    eager, _ = eager_greedy(model, prompts, 6)
    texts = [cut_at_stop(tokenizer.decode([t for t in ids if t != bos]), (".",))[0] for ids in eager]
    assert [e["output"] for e in got["gen"]["per_example"]] == texts
    assert evaluation["model"]["step"] == 7 and evaluation["model"]["tokens_seen"] == 7 * 4 * 32
    text = card.read_text()
    assert "step 7, tokens seen 896" in text and "every example of each task" in text
    rows = [line for line in text.splitlines() if line.startswith(("| mc ", "| lm ", "| gen "))]
    assert len(rows) == 3 and f"{100 * got['mc']['score']:.1f}%" in rows[0] and "33.3%" in rows[0]
    # Where the command's time went: loading the model, then scoring (its compiles inside).
    import re

    assert re.search(r"^  time [\d.]+ s: imports [\d.]+ s, loading the model [\d.]+ s, scoring [\d.]+ s; "
                     r"inside them hashing .*compile [\d.]+ s; compilation cache", capsys.readouterr().out, re.M)


def test_a_second_eval_process_loads_every_scoring_program_from_the_persistent_cache(tmp_path, checkpoints):
    """`eval --tasks` puts its programs in the compilation cache (as generate does): a second process
    compiles nothing and scores the same."""
    import os
    import re
    import subprocess
    import sys

    chat_ck, _ = checkpoints
    records = [{"context": e.context, "choices": list(e.choices), "gold": e.gold} for e in MC.examples]
    mc = write_lines(tmp_path / "mc.jsonl", {"task": {"num_fewshot": 1}}, *records)
    # Its own cache directory only (not the suite's shared one, where the first run could already hit).
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR", "TORCHLYRA_COMPILE_CACHE")}
    root = Path(__file__).resolve().parent.parent
    runs = []
    for i in range(2):
        out = tmp_path / f"eval{i}.json"
        proc = subprocess.run([sys.executable, "-m", "train.cli", "eval", "--checkpoint", str(chat_ck), "--tasks", str(mc),
                               "--json", str(out), "--no-progress", "--batch-size", "4",
                               "--compile-cache", str(tmp_path / "cache")],
                              cwd=root, env={**env, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        found = re.search(r"compilation cache (\S+): (\d+) programs loaded, (\d+) compiled", proc.stdout)
        assert found and found.group(1) == str(tmp_path / "cache"), proc.stdout[-2000:]
        runs.append((int(found.group(2)), int(found.group(3)), json.loads(out.read_text())["tasks"][0]["per_example"]))
    (loaded0, compiled0, first), (loaded1, compiled1, second) = runs
    assert loaded0 == 0 and compiled0 > 0
    assert compiled1 == 0 and loaded1 == compiled0
    assert second == first


# ---- CORE-6 from the BIG-bench archive -----------------------------------------------------------
# The user's cache as the process started, read at collection: the `cache_dir` fixture (conftest,
# one per pytest run) may point $TORCHLYRA_CACHE at a temporary directory later.
USER_CACHE = str(pinned_download.cache_dir())


@pytest.fixture
def bigbench_cache(monkeypatch):
    """The cache `torchlyra eval --tasks core` itself uses ($TORCHLYRA_CACHE, else
    ~/.cache/torchlyra): the 358 MB archive is downloaded once per machine (verified by sha256
    whenever it is read), not once per clone or run."""
    monkeypatch.setenv("TORCHLYRA_CACHE", USER_CACHE)
    return USER_CACHE


def test_core6_files_parse_with_expected_counts(bigbench_cache):
    from train.evaluation.core import core_tasks

    try:
        tasks = {t.name: t for t in core_tasks()}
    except UserError as e:      # the registry, not the code: said in the summary as a skip, with pip's words
        if "could not download bigbench" not in str(e):
            raise
        pytest.skip(f"CORE-6's archive cannot be fetched on this machine: {e}")
    counts = {name: len(t.examples) for name, t in tasks.items()}
    assert counts == {"qa_wikidata": 20442, "dyck_languages": 1000, "operators": 211, "repeat_copy_logic": 32,
                      "cs_algorithms": 320 + 1000, "language_identification": 10000}
    lid = tasks["language_identification"]
    assert lid.settings.kind == "multiple_choice" and all(len(e.choices) == 11 for e in lid.examples)
    assert lid.baseline == pytest.approx(1 / 11)
    assert all(t.settings.num_fewshot == 10 and t.baseline == 0 for n, t in tasks.items() if n != "language_identification")
    assert tasks["operators"].examples[0] == Example(
        "Given the definition of the op operator, compute the result.\nop i is i.\nop 17 =", "17")
    assert tasks["cs_algorithms"].examples[320].answer in ("Valid", "Invalid")


# ---- periodic task evaluation in training --------------------------------------------------------
def tensorboard_scalars(run_dir) -> dict:
    """{(tag, step): value} from the run's TensorBoard event files (TFRecord frames of Event protos)."""
    import struct

    from tensorboardX.proto.event_pb2 import Event

    out = {}
    for path in (run_dir / "tensorboard").iterdir():
        data, at = path.read_bytes(), 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at:at + 8])
            event = Event.FromString(data[at + 12:at + 12 + length])
            at += 12 + length + 4
            for value in event.summary.value:
                out[(value.tag, event.step)] = value.simple_value
    return out


def test_training_writes_task_scores_to_metrics_and_tensorboard(tmp_path, capsys):
    """`train --eval-tasks FILE --eval-every 1`: each eval record holds the task's score, equal to
    `eval --tasks` on the checkpoint of that step; TensorBoard gets the same scalars."""
    from helpers import prepare_play_corpus

    data = prepare_play_corpus(tmp_path)
    mc = write_lines(tmp_path / "plays.jsonl",
                     *[{"context": f"{who}:", "choices": ["But soft", "O Romeo", "To be"], "gold": i}
                       for i, who in enumerate(["ROMEO", "JULIET", "HAMLET"])])
    config = {"model": {"n_layers": 1, "d_model": 32, "n_heads": 2, "n_kv_heads": 1, "head_dim": 16,
                        "n_experts": 2, "expert_dim": 32, "sliding_window": 16, "vocab_size": 384}}
    (tmp_path / "run.json").write_text(json.dumps(config))
    out = tmp_path / "run"
    assert main(["train", "--config", str(tmp_path / "run.json"), "--data", data, "--out", str(out), "--steps", "2",
                 "--batch-size", "2", "--seq-len", "32", "--eval-every", "1", "--eval-batches", "1", "--eval-tasks",
                 str(mc), "--samples", "0", "--tensorboard"]) == 0
    evals = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 1, 2] and all(set(r["tasks"]) == {"plays"} for r in evals)
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(out), "--tasks", str(mc), "--json", str(tmp_path / "e.json"),
                 "--no-progress", "--scorer", "eager"]) == 0
    final = json.loads((tmp_path / "e.json").read_text())["tasks"][0]
    assert evals[-1]["tasks"]["plays"] == final["score"]
    assert evals[-1]["tasks_centered"]["plays"] == pytest.approx(final["centered"])
    scalars = tensorboard_scalars(out)
    assert scalars[("eval/tasks/plays", 2)] == pytest.approx(final["score"])
