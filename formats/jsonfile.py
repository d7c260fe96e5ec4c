"""Reading JSON that a user handed us: a file (a parse failure is a UserError naming the file), or a
command-line value that must be a JSON object (an argparse type)."""
import json
from pathlib import Path

from formats.errors import UserError


def read_json(path) -> object:
    """The parsed content of `path` (which the caller has checked exists)."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:   # JSONDecodeError is a ValueError
        raise UserError(f"{path}: not valid JSON ({e})") from None


def json_object(text: str) -> dict:
    """A command-line value that is a JSON object (an argparse type): one line naming what is wrong otherwise."""
    import argparse

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e.msg} at character {e.pos}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object {{...}}, found {type(value).__name__}: {text!r}")
    return value
