"""The records a shard's attempts keep in its checkpoint directory: one type, one writer, one reader.

- ``attempts.jsonl``: each attempt appends an ``AttemptStart`` event when it begins and an
  ``AttemptEnd`` event when it ends with an outcome (``outputs.ShardCheckpoint.log_attempt``); an
  attempt killed outright has no end. ``read_attempts`` is the one reader: the next attempt (its
  memory settings), the shard's stats and ``shardgen status`` all use it, and each ``Attempt`` it
  gives is the start with its end's fields.
- ``progress.json``: a running attempt's ``Progress``, rewritten every few seconds (``feed``);
  ``read_progress`` is its reader (``shardgen status``, the tests).

The outcome of a failure is the one its error declares (``errors.ShardgenError.outcome``), so a new
kind of failure needs no list here: every outcome but ``committed`` and ``interrupted`` fails the
shard. Every record carries ``VERSION``; a reader keeps the fields it knows and ignores the others,
so a record written by a later shardgen is still read, and one it cannot read (a line cut by a full
disk) is skipped.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from dataclasses import dataclass, field
from typing import Any

from shardgen.errors import ShardgenError

# The version of these records' layout; written into each, for the readers of later versions.
VERSION = 1
COMMITTED = "committed"
INTERRUPTED = "interrupted"
OUT_OF_MEMORY = "out_of_memory"


def is_failure(outcome: str | None) -> bool:
    """Whether an attempt that ended so failed its shard (None: killed without a word, or running)."""
    return outcome not in (None, COMMITTED, INTERRUPTED)


def _known(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in data.items() if k in names}


def _line(event: str, record: Any) -> str:
    return json.dumps({"event": event, "v": VERSION, **dataclasses.asdict(record)}, default=str)


@dataclass(frozen=True)
class AttemptStart:
    """What an attempt records as it begins: who runs it, where, and what was done before it."""

    attempt: int  # 1 for the shard's first
    started: str  # ISO time
    host: str
    pid: int
    slurm: dict[str, Any]  # jobinfo.slurm_info(): job id, time limit, ...
    rows_done_before: int  # input rows resumed from checkpoints

    def line(self) -> str:
        return _line("start", self)


@dataclass(frozen=True)
class AttemptEnd:
    """How an attempt ended (``attempt_end``); a memory failure says what ran out and where."""

    outcome: str
    ended: str | None = None
    rows_saved: int | None = None  # input rows in its checkpoint parts when it ended
    rows_generated: int | None = None  # rows the engine finished in this attempt
    signal: str | None = None  # interrupted: SIGTERM or SIGINT
    error: str | None = None
    kind: str | None = None  # out_of_memory: which memory
    stage: str | None = None  # out_of_memory: at the engine's start or while generating
    settings: dict[str, Any] | None = None  # out_of_memory: the memory settings it ran with
    layout: dict[str, Any] | None = None  # out_of_memory: the model, parallelism and GPUs it loaded on

    def line(self) -> str:
        return _line("end", self)


def now() -> str:
    """The time as the records keep it: ISO 8601 in UTC, to the second."""
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def attempt_end(error: BaseException, rows_saved: int, rows_generated: int | None = None) -> AttemptEnd:
    """How an attempt ended, for its entry in ``attempts.jsonl``: the outcome the error declares
    (``ShardgenError.outcome``; any other error is ``failed``) and what the next attempt needs of it
    (``ShardgenError.attempt_fields``: an interrupted attempt's signal, a memory failure's kind,
    stage and settings). (No ClaimLost: a worker that lost its claim writes no end record,
    ``ShardCheckpoint.log_attempt``.)"""
    end = {"ended": now(), "rows_saved": rows_saved, "rows_generated": rows_generated}
    if isinstance(error, ShardgenError):
        return AttemptEnd(error.outcome, **error.attempt_fields(), **end)
    return AttemptEnd("failed", error=f"{type(error).__name__}: {error}"[:1000], **end)


@dataclass(frozen=True)
class Attempt(AttemptEnd, AttemptStart):
    """One attempt as ``read_attempts`` gives it: its start, with its end's fields once it has ended
    (``outcome`` None: it is running, or was killed without a word)."""

    outcome: str | None = None  # type: ignore[assignment]

    @property
    def failed(self) -> bool:
        return is_failure(self.outcome)

    def as_dict(self) -> dict[str, Any]:
        """As the shard's stats keep it (their ``attempts`` list)."""
        return dataclasses.asdict(self)


def read_attempts(text: str) -> list[Attempt]:
    """Each attempt in ``attempts.jsonl``'s text. A line cut by a full disk, or an end without a
    start, is skipped."""
    out: list[Attempt] = []
    for line in text.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if not isinstance(event, dict):
            continue
        kind = event.get("event")
        if kind == "start":
            try:
                out.append(Attempt(**_known(AttemptStart, event)))
            except TypeError:  # a start without its fields: not one of ours
                continue
        elif kind == "end" and out:
            out[-1] = dataclasses.replace(out[-1], **_known(AttemptEnd, event))
    return out


@dataclass(frozen=True)
class Progress:
    """A running attempt's ``progress.json``: whose it is, and how far it got."""

    attempt: int
    host: str
    pid: int
    job_id: str | None
    started: float  # epoch seconds, for the rate
    time: float  # when this was written
    rows: int  # the shard's input rows
    done: int  # input rows done: resumed and generated
    resumed: int  # of which came from earlier attempts' checkpoints
    saved: int  # input rows in checkpoint parts
    error_reasons: dict[str, int] = field(default_factory=dict)

    def text(self) -> str:
        return json.dumps({"v": VERSION, **dataclasses.asdict(self)})


def read_progress(text: str) -> Progress | None:
    """The progress in ``progress.json``'s text; None when it cannot be read."""
    try:
        return Progress(**_known(Progress, json.loads(text)))
    except (ValueError, TypeError):
        return None
