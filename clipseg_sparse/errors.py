"""The one base of every error a user can fix (bad input, a missing file, weights or package).

Library code raises a subclass that also derives from the builtin it always was (`ValueError`,
`RuntimeError`, ...), so `except ValueError` in callers keeps working; the CLI catches `UserError` at one
boundary and prints its message as one line with exit code 2.
"""

from __future__ import annotations


class UserError(Exception):
    """Something the user can fix; `str(error)` is the whole one-line explanation."""


class UserValueError(UserError, ValueError):
    """A bad value: an argument, a setting, a file's content (the plain `ValueError` of user input)."""


class UserFileNotFoundError(UserError, FileNotFoundError):
    """A file the user named (an argument, an option, an entry of a list file) that does not exist."""
