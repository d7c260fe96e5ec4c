"""`torchlyra COMMAND --help` answers every question about a flag: every flag of every command
(bench's subcommands too) has help text; `train` and `rl` show theirs in groups, each with the
default its config dataclass really has; a flag not given stays unset, so that `--config` and
`--resume` tell the settings given apart from the defaults. `lm-eval` hands its arguments to
lm-eval, which documents them."""
from __future__ import annotations

import argparse
import dataclasses
import re

import pytest

from train.rl.config import RLConfig
from train.run.config import TrainConfig

TRAIN_GROUPS = ("model", "data", "optimization", "parallelism and kernels", "evaluation and samples",
                "checkpoints", "fine-tuning", "profiling and logging", "multi-host")
RL_GROUPS = ("model", "data", "rollouts", "objective", "optimization", "parallelism and kernels", "evaluation",
             "checkpoints", "logging")


@pytest.fixture(scope="module")
def commands() -> dict[str, argparse.ArgumentParser]:
    from train.cli import build_parser

    return subcommands(build_parser())


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return {name: sub for action in parser._actions if isinstance(action, argparse._SubParsersAction)
            for name, sub in action.choices.items()}


def flags_without_help(parser: argparse.ArgumentParser, command: str) -> list[str]:
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                missing += flags_without_help(sub, f"{command} {name}")
        elif not (action.help or "").strip():
            missing.append(f"{command} {'/'.join(action.option_strings) or action.dest}")
    return missing


def groups(parser: argparse.ArgumentParser) -> dict[str, list[argparse.Action]]:
    return {group.title: group._group_actions for group in parser._action_groups}


def field_default(config_type: type, name: str):
    field = {f.name: f for f in dataclasses.fields(config_type)}[name]
    return field.default_factory() if field.default is dataclasses.MISSING else field.default


def shown(value) -> str:
    """A default as the help states it."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"{value:g}" if isinstance(value, float) else str(value)


def test_every_flag_of_every_command_has_help_text(commands):
    assert "bench" in commands and subcommands(commands["bench"]), "bench has subcommands"
    missing = [flag for name, parser in commands.items() if name != "lm-eval"
               for flag in flags_without_help(parser, name)]
    assert not missing, "flags without help text: " + ", ".join(missing)


@pytest.mark.parametrize("command, titles", [("train", TRAIN_GROUPS), ("rl", RL_GROUPS)])
def test_train_and_rl_show_their_flags_in_groups(commands, command, titles):
    found = groups(commands[command])
    for title in titles:
        assert found.get(title), f"{command} --help: group {title!r} missing or empty (groups: {', '.join(found)})"
    ungrouped = [a.option_strings[0] for a in found["options"]
                 if not isinstance(a, argparse._HelpAction) and a.dest != "config"]
    assert not ungrouped, f"{command} --help: flags outside a group: {', '.join(ungrouped)}"
    cluster = {a.dest for a in found.get("multi-host", ())}
    assert command != "train" or {"coordinator", "num_processes", "process_id", "host_timeout_s"} <= cluster


@pytest.mark.parametrize("command, config_type", [("train", TrainConfig), ("rl", RLConfig)])
def test_the_help_shows_each_config_fields_real_default(commands, command, config_type):
    fields = {f.name for f in dataclasses.fields(config_type)}
    checked = 0
    for action in commands[command]._actions:
        if action.dest not in fields or isinstance(action, argparse._StoreConstAction):
            continue                 # --config, the cluster flags; a switch is off unless given
        value = field_default(config_type, action.dest)
        if value is None or value in ("", [], {}):
            assert re.search(r"\((default: [^)]+|required)\)$", action.help), \
                f"{command} {action.option_strings[0]}: no default stated: {action.help!r}"
        else:
            assert action.help.endswith(f"(default: {shown(value)})"), \
                f"{command} {action.option_strings[0]}: {config_type.__name__} says {value!r}; help: {action.help!r}"
        checked += 1
    assert checked >= 30


def help_entries(text: str) -> dict[str, str]:
    """Each flag's entry of a --help text (its lines joined): the option's line starts with two
    spaces and a dash, its help continues on lines indented further."""
    entries, flag = {}, None
    for line in text.splitlines():
        if line.startswith("  -"):
            flag = line.split()[0].rstrip(",")
            entries[flag] = line
        elif flag and line.startswith("   "):
            entries[flag] += line
        else:
            flag = None
    return {flag: " ".join(entry.split()) for flag, entry in entries.items()}


def test_train_help_reads_as_the_config_says(commands):
    entries = help_entries(commands["train"].format_help())

    def stated(flag: str) -> str:
        found = re.search(r"\(default: ([^)]*)\)$", entries[flag])
        assert found, f"train --help: {flag} states no default: {entries[flag]}"
        return found.group(1)

    assert stated("--steps") == str(field_default(TrainConfig, "steps"))
    assert stated("--lr") == f"{field_default(TrainConfig, 'lr'):g}"
    assert stated("--remat") == field_default(TrainConfig, "remat")
    assert stated("--scan-layers") == "on" and field_default(TrainConfig, "scan_layers") is True
    assert stated("--mesh").startswith("every device on fsdp") and field_default(TrainConfig, "mesh") == ""
    assert f"cosine decay to {field_default(TrainConfig, 'min_lr_ratio'):g} of the peak" in entries["--warmup-steps"]
    assert "(default:" not in entries["--resume"]          # a switch: off unless given


@pytest.mark.parametrize("command", ["train", "rl"])
def test_a_flag_not_given_stays_unset_so_the_config_and_resume_see_only_what_was_given(commands, command):
    args = commands[command].parse_args([])
    set_anyway = {a.dest: getattr(args, a.dest) for a in commands[command]._actions
                  if not isinstance(a, argparse._HelpAction) and getattr(args, a.dest) is not None}
    assert not set_anyway, f"{command}: flags with a parser default: {set_anyway}"
    if command == "train":
        from train.run.loop import config_from_args

        cfg, explicit = config_from_args(args)
        assert explicit == {} and cfg == TrainConfig()
        cfg, explicit = config_from_args(commands[command].parse_args(
            ["--steps", "7", "--no-scan-layers", "--freeze", "*.router.*", "--resume"]))
        assert explicit == {"steps": 7, "scan_layers": False, "freeze": ["*.router.*"], "resume": True}
