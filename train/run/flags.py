"""The command line over a config dataclass (`train`'s TrainConfig, `rl`'s RLConfig): one table of
flags, each naming a field with its group, kind and help text; the help ends with the field's
default, read from the dataclass. Every flag's parser default is None, so that the settings given
explicitly (beside a `--config` file, or to a `--resume`d run) are told apart from the defaults."""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

VALUE, SWITCH, BOOLEAN, REPEATED = "value", "switch", "boolean", "repeated"


@dataclass(frozen=True)
class Flag:
    """`--field-name` (its dest: the field's name) of a config dataclass."""
    group: str                 # the title of its argument group
    help: str                  # what it does; the default is appended
    type: type = str           # the type of a VALUE (or of each REPEATED one)
    kind: str = VALUE          # VALUE; SWITCH (given: true); BOOLEAN (--x / --no-x); REPEATED (each one appended)
    choices: tuple[str, ...] = ()    # the values accepted, shown as A|B; checked where a --config file's are
    metavar: str | None = None
    unset: str = ""            # what an empty default ("", None, []) means, e.g. "every device on fsdp"
    required: bool = False     # the run needs it, from the flag or the --config file


def field_defaults(config_type: type) -> dict:
    """field name -> its default in the dataclass (a default_factory called)."""
    return {f.name: f.default_factory() if f.default is dataclasses.MISSING else f.default
            for f in dataclasses.fields(config_type)}


def is_empty(value) -> bool:
    return value is None or (isinstance(value, (str, list, tuple, dict)) and not value)


def spec_defaults(spec_type: type) -> str:
    """The defaults of a `key=value,...` spec's dataclass (LoRA's, DPO's) as such a spec, e.g.
    "r=16,alpha=32,dropout=0,targets=all-linear" (lists joined by '+'; empty ones left out)."""
    return ",".join(f"{k}={_spec_value(v)}" for k, v in field_defaults(spec_type).items() if not is_empty(v))


def _spec_value(value) -> str:
    if isinstance(value, (list, tuple)):
        return "+".join(map(str, value))
    return f"{value:g}" if isinstance(value, float) else str(value)


def shown_default(flag: Flag, value) -> str:
    """How the help states a field's default: "(default: 300)", "(default: on)", "(required)";
    "" for a switch (off unless given)."""
    if flag.required:
        return "(required)"
    if flag.kind == SWITCH:
        return ""
    if is_empty(value):
        return f"(default: {flag.unset})"
    if isinstance(value, bool):
        return f"(default: {'on' if value else 'off'})"
    return f"(default: {value:g})" if isinstance(value, float) else f"(default: {value})"


def add_flags(parser: argparse.ArgumentParser, flags: dict[str, Flag], config_type: type,
              groups: dict[str, str | None]) -> dict:
    """One argument group per entry of `groups` (title -> description), in that order, then every
    flag of the table in its group; returns the groups by title."""
    made = {title: parser.add_argument_group(title, description) for title, description in groups.items()}
    defaults = field_defaults(config_type)
    for name, flag in flags.items():
        if name not in defaults:
            raise ValueError(f"flag --{name.replace('_', '-')}: {config_type.__name__} has no field {name!r}")
        if flag.group not in made:
            raise ValueError(f"flag --{name.replace('_', '-')}: no group {flag.group!r}")
        if is_empty(defaults[name]) and not (flag.unset or flag.required or flag.kind == SWITCH):
            raise ValueError(f"flag --{name.replace('_', '-')}: its default is empty; say what that means (unset=)")
        text = " ".join(filter(None, (flag.help, shown_default(flag, defaults[name])))).replace("%", "%%")
        option, group = "--" + name.replace("_", "-"), made[flag.group]
        metavar = flag.metavar or ("|".join(flag.choices) if flag.choices else "N" if flag.type is int else None)
        if flag.kind == VALUE:
            group.add_argument(option, dest=name, type=flag.type, default=None, metavar=metavar, help=text)
        elif flag.kind == REPEATED:
            group.add_argument(option, dest=name, type=flag.type, action="append", default=None, metavar=metavar,
                               help=text)
        elif flag.kind == SWITCH:
            group.add_argument(option, dest=name, action="store_const", const=True, default=None, help=text)
        elif flag.kind == BOOLEAN:
            group.add_argument(option, dest=name, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            raise ValueError(f"flag {option}: unknown kind {flag.kind!r}")
    return made


def given(args, flags: dict[str, Flag]) -> dict:
    """The table's settings given on the command line (a flag not given is None)."""
    return {name: getattr(args, name) for name in flags if getattr(args, name, None) is not None}
