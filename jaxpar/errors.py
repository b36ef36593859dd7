"""The exception and warning types jaxpar raises for the user's input.

Every error a user can cause (an unknown axis name, a dimension that does not divide, a
mesh that does not match the device count, an unknown config key, a corrupt checkpoint)
is a :class:`JaxparError` whose message names the culprit. The CLI prints the message
alone, on one line, without a traceback, and exits with status 2. Warnings about the
user's input (an annotation pattern that matched nothing, a checkpoint skipped as
corrupt) are :class:`JaxparWarning` s, which the CLI prints as one line too.
"""

from __future__ import annotations


class JaxparError(ValueError):
    """A user-facing error: the message says what is wrong and where."""


class JaxparWarning(UserWarning):
    """A user-facing warning: the message says what was noticed and what it means."""


class RunStopped(KeyboardInterrupt):
    """A run that stopped early on request (Ctrl-C, SIGTERM) after saving what it should.

    Attributes:
      status: the exit status the CLI returns (130 for SIGINT, 143 for SIGTERM).
    """

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status
