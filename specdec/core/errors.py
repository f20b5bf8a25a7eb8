"""Bad input, told apart from a fault in specdec: what the user fixes (a value, a file, a model, a full disk).

A command ends on an `InputError` with its message as `Error: <message>` and status 1
(`reported`), without the traceback that would bury it: the message already says what is wrong and
what to do. Each kind is also the built-in exception that a library caller expects (ValueError,
FileNotFoundError, ModuleNotFoundError, OSError), so code that catches those goes on working.
"""

import contextlib
from collections.abc import Iterator


class InputError(Exception):
    """Bad input; the message says what is wrong and what to do about it."""


class InvalidInput(InputError, ValueError):
    """A value, file or model that is there but cannot work."""


class MissingInput(InputError, FileNotFoundError):
    """A file, directory or model that is not there."""


class MissingPackage(InputError, ModuleNotFoundError):
    """A package that the input needs and the installation lacks."""


class NoSpace(InputError, OSError):
    """No room left to write a run's files (a full disk, a quota): the user frees space or picks
    another folder; what was written before stays as it was."""


def first_line(err: BaseException) -> str:
    """The first line of `err`'s message (the type's name for an empty one): libraries append
    tracebacks, and advice in their own API's terms, below it, which a one-line message leaves out."""
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


def described(err: BaseException) -> str:
    """`Type: first line` of `err` (the type alone for an empty message)."""
    return f"{type(err).__name__}: {first_line(err)}" if str(err).strip() else type(err).__name__


@contextlib.contextmanager
def reported() -> Iterator[None]:
    """Around a command's body: an `InputError` ends the command as `Error: <message>`, status 1.
    SystemExit is not an Exception, so Hydra lets it end the command rather than print a traceback."""
    try:
        yield
    except InputError as err:
        raise SystemExit(f"Error: {err}") from None
