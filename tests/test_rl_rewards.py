"""Rewards and prompt records for `rl`: the built-ins, a user's python: function with
the record's other fields, weights with None left out (TRL's nansum) and all None -> 0 counted; a
reward that raises names the record; an unknown reward, a module that does not load and a bad
prompt file are one line each (UserError: the CLI's exit 2)."""
import pytest

from formats.errors import UserError
from train.rl.prompts import read_prompts
from train.rl.rewards import parse_rewards, score


@pytest.fixture(scope="module")
def enc():
    from formats.tokenizer import train_bpe
    return train_bpe(["the quick brown fox jumps over the lazy dog"] * 20, 300)


def test_builtin_rewards_and_weighted_nansum(tmp_path):
    user = tmp_path / "mine.py"
    user.write_text("def length(prompt, completion, record):\n"
                    "    return None if record.get('skip') else float(len(completion)) + record['bonus']\n")
    rewards = parse_rewards(["exact:answer", "regex:^Mac", f"python:{user}:length"], [1.0, 0.5, 0.1])
    got = score(rewards, "Which play?", "  Macbeth \n", {"answer": "Macbeth", "bonus": 1.0}, "p.jsonl:1")
    assert got.values == [1.0, 0.0, pytest.approx(12.0)] and got.total == pytest.approx(1.0 + 1.2)
    got = score(rewards, "q", "Mac beth", {"answer": "Macbeth", "skip": True}, "p.jsonl:2")
    assert got.values == [0.0, 1.0, None] and got.total == 0.5 and not got.all_none
    only_none = parse_rewards([f"python:{user}:length"])
    got = score(only_none, "q", "x", {"skip": True}, "p.jsonl:3")
    assert got.total == 0.0 and got.all_none


def test_humaneval_reward_runs_the_record_tests_in_the_sandbox():
    record = {"prompt": "def add(a, b):\n", "test": "def check(f):\n    assert f(2, 3) == 5\n", "entry_point": "add"}
    reward = parse_rewards(["humaneval"], isolation="guard")
    assert score(reward, record["prompt"], "    return a + b\n", record, "he:1").total == 1.0
    assert score(reward, record["prompt"], "    return a - b\n", record, "he:1").total == 0.0


def test_failures_are_one_line_naming_what(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("import no_such_module_here\n")
    raising = tmp_path / "raises.py"
    raising.write_text("def r(prompt, completion, record):\n    raise KeyError('answer')\n"
                       "def s(prompt, completion, record):\n    return 'yes'\n")
    for spec, words in (("bleu", "unknown reward 'bleu'"), (f"python:{bad}:r", "does not load \\(ModuleNotFoundError"),
                        (f"python:{raising}:nope", "has no function 'nope'"), ("python:missing.py:r", "no file"),
                        ("regex:(", "not a regular expression")):
        with pytest.raises(UserError, match=words):
            parse_rewards([spec])
    with pytest.raises(UserError, match=r"p.jsonl:7: reward python:.*raises.py:r raised KeyError"):
        score(parse_rewards([f"python:{raising}:r"]), "q", "c", {}, "p.jsonl:7")
    with pytest.raises(UserError, match="returned 'yes'; expected a finite float or None"):
        score(parse_rewards([f"python:{raising}:s"]), "q", "c", {}, "p.jsonl:8")
    with pytest.raises(UserError, match="p.jsonl:9: reward exact:answer: the record has no field 'answer'"):
        score(parse_rewards(["exact:answer"]), "q", "c", {"other": 1}, "p.jsonl:9")
    with pytest.raises(UserError, match="2 weights for 1 rewards"):
        parse_rewards(["exact:a"], [1.0, 2.0])


def test_prompt_records_chat_or_text_cut_from_the_left(tmp_path, enc):
    from train.generation import chat

    path = tmp_path / "p.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "the quick brown fox"}], "answer": "dog"}\n'
                    '{"messages": [{"role": "user", "content": "' + "the lazy dog " * 20 + '"}], "answer": "x"}\n')
    prompts = read_prompts(path, enc, budget=24)
    assert prompts[0].chat and prompts[0].record["answer"] == "dog" and not prompts[0].cut
    assert prompts[0].tokens == chat.render(enc, [chat.Message("user", "the quick brown fox")])
    assert prompts[1].cut and len(prompts[1].tokens) == 24
    assert prompts[1].tokens[-2:] == chat.render(enc, [chat.Message("user", "x")])[-2:]   # ends <|start|>assistant
    for text, words in (('{"prompt": 3}\n', "p.jsonl:1: expected a field 'messages'"),
                        ('{"prompt": "a"}\nnot json\n', "p.jsonl:2: not JSON"),
                        ('{"messages": [{"role": "assistant", "content": "a"}]}\n', "the last message is the assistant"),
                        ('{"prompt": "a"}\n{"messages": [{"role": "user", "content": "b"}]}\n', "mixes chat"),
                        ('\n', "no records")):
        path.write_text(text)
        with pytest.raises(UserError, match=words):
            read_prompts(path, enc, budget=24)
    with pytest.raises(UserError, match="no such file"):
        read_prompts(tmp_path / "none.jsonl", enc, budget=24)
