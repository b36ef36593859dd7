"""The one exception type jaxpar raises for bad user input.

Every error a user can cause (an unknown axis name, a dimension that does not divide, a
mesh that does not match the device count, an unknown config key, a corrupt checkpoint)
is a :class:`JaxparError` whose message names the culprit. The CLI prints the message
alone, without a traceback.
"""

from __future__ import annotations


class JaxparError(ValueError):
    """A user-facing error: the message says what is wrong and where."""
