"""The one error type the CLI turns into a one-line message and a non-zero exit."""


class UserError(Exception):
    """Bad input from the user: the message names the problem and the fix, no traceback is shown."""
