"""The one exception type for bad user input: the CLI prints its message on one line and exits 2."""


class UserError(Exception):
    """Bad input from the user (file, field, value). The message must name the problem:
    what was expected and what was found."""
