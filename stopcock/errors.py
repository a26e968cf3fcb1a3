"""The error type for mistakes a user can fix: shown as one line naming the fix, never a traceback."""

from __future__ import annotations

__all__ = ["UsageError", "UserError", "first_line"]


class UserError(Exception):
    """A mistake the user can fix (a model that cannot be loaded, a path that cannot be written).

    The CLI prints it as one line and exits with :attr:`exit_code`; the server answers it as a
    4xx or refuses to start.
    """

    exit_code = 1


class UsageError(UserError):
    """An argument that is wrong for this model, found once it is loaded (e.g. more steps than its
    scheduler can plan): exit code 2, as for the arguments the parser refuses."""

    exit_code = 2


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type name if it has none)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
