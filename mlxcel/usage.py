"""The one error a bad setting raises before anything starts."""

from __future__ import annotations

EXIT_USAGE = 2


class UsageError(ValueError):
    """A setting stops startup; ``str()`` is the one line printed before exit status 2 (:data:`EXIT_USAGE`)."""
