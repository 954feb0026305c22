"""The one error type a user sees: a single line naming the problem and the fix."""


class UserError(Exception):
    """Bad input from the user. CLIs print `str(err)` on one line and exit with code 2."""

    exit_code = 2
