"""Errors that the CLI turns into one `kdash: ...` line and exit status 2."""


class UserError(Exception):
    """Bad input from the user (a missing file, a dead pid, a bad option): exit 2, no traceback."""


class CaptureError(UserError):
    """A file that is not a readable kdash capture (foreign, truncated, newer schema)."""
