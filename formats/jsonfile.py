"""Reading a JSON file that a user handed us: a parse failure is a UserError naming the file."""
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
