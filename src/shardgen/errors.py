"""Error types shared by the package."""

from __future__ import annotations

from typing import Any


class ShardgenError(Exception):
    """An error shardgen explains to the user; the CLI prints it without a traceback.

    ``outcome`` is how an attempt that ends with this error is recorded (``records``): each kind of
    failure declares its own, and every outcome but ``committed`` and ``interrupted`` fails a shard.
    """

    outcome = "failed"

    def attempt_fields(self) -> dict[str, Any]:
        """What the record of an attempt that ends with this error keeps of it besides its outcome
        (``records.AttemptEnd``): by default its type and message."""
        return {"error": f"{type(self).__name__}: {self}"[:1000]}


class ConfigError(ShardgenError):
    """The configuration is invalid. The message names the key."""


class InputError(ShardgenError):
    """The input dataset is missing, unreadable or inconsistent. The message names the file or column."""


class MergeError(ShardgenError):
    """The shard outputs do not add up to the plan."""


class RowError(Exception):
    """One row cannot be processed; it becomes that row's ``error`` value.

    Args:
        reason: A short machine-readable reason, counted in the stats.
        message: What went wrong, for the ``error`` column.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.reason}: {self.args[0]}"


def error_reason(error: str) -> str:
    """The reason of an ``error`` value (``"reason: message"``; with list samples ``"sample i: reason: ..."``)."""
    if error.startswith("sample "):
        error = error.split(": ", 1)[1]
    return error.split(":", 1)[0]
