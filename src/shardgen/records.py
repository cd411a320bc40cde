"""The record of a shard's attempts (``<checkpoint>/attempts.jsonl``): one writer, one reader.

Each attempt appends a ``start`` event when it begins and an ``end`` event when it ends with an
outcome (``outputs.ShardCheckpoint.log_attempt``); an attempt killed outright has no end. The
outcome of a failure is the one its error declares (``errors.ShardgenError.outcome``), so a new
kind of failure needs no list here: every outcome but ``committed`` and ``interrupted`` fails the
shard. ``read_attempts`` is the one reader: the next attempt (its memory settings), the stats and
``shardgen status`` all use it.
"""

from __future__ import annotations

import json
from typing import Any

COMMITTED = "committed"
INTERRUPTED = "interrupted"


def is_failure(outcome: str | None) -> bool:
    """Whether an attempt that ended so failed its shard (None: killed without a word, or running)."""
    return outcome not in (None, COMMITTED, INTERRUPTED)


def read_attempts(text: str) -> list[dict[str, Any]]:
    """Each attempt in ``attempts.jsonl``'s text: its start record with its end record's fields
    (``outcome`` None: it was killed without a word, or is running). A line cut by a full disk is
    skipped."""
    out: list[dict[str, Any]] = []
    for line in text.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if not isinstance(event, dict):
            continue
        kind = event.pop("event", None)
        if kind == "start":
            out.append({**event, "outcome": None})
        elif out:
            out[-1].update(event)
    return out
