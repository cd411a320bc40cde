"""The job's stop flag: SIGTERM and SIGINT (Slurm's time limit, scancel, Ctrl+C) stop a job after a last save.

``StopFlag`` is installed once for a job (its shards, or an elastic worker's) and polled by the feed
loop; where a job waits (an engine's start, a claim's lease) it raises ``Interrupted`` at once. The
command exits with 3 on ``Interrupted``, so Snakemake retries the job, and the next attempt resumes
from the saved rows.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from collections.abc import Iterator
from typing import Any

from shardgen.base import records
from shardgen.errors import ShardgenError

log = logging.getLogger(__name__)


class Interrupted(ShardgenError):
    """The job was asked to stop (SIGTERM, SIGINT); finished rows are saved."""

    outcome = records.INTERRUPTED

    def __init__(self, signum: int, shard_id: str) -> None:
        self.signal_name = signal.Signals(signum).name
        super().__init__(
            f"shard {shard_id}: stopped by {self.signal_name}; finished rows are saved and the next attempt "
            "resumes from them"
        )

    def attempt_fields(self) -> dict[str, Any]:
        return {"signal": self.signal_name}


class StopFlag:
    """Set by SIGTERM/SIGINT while installed; the feed loop polls it."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}
        self._raise_for: str | None = None  # the shard whose engine is starting

    def __call__(self) -> bool:
        return self.signal is not None

    def _handler(self, signum, _frame) -> None:
        if self.signal is None:
            log.warning("received %s: stopping after saving finished rows", signal.Signals(signum).name)
        self.signal = signum
        if self._raise_for is not None:
            shard_id, self._raise_for = self._raise_for, None
            raise Interrupted(signum, shard_id)

    @contextlib.contextmanager
    def raising(self, shard_id: str) -> Iterator[None]:
        """Within: a signal raises ``Interrupted`` at once, and one that came before stops here.

        For the engine's start (minutes on a GPU): Slurm sends SIGKILL KillWait seconds (30 by
        default) after its SIGTERM, and a start that ran on until the feed loop polls the flag
        would be killed with the attempt unrecorded. vLLM's client shuts the engine's processes
        down when its constructor raises (``MPClient.__init__``, ``vllm/v1/engine/core_client.py``),
        as for a Ctrl-C during the start.
        """
        if self.signal is not None:
            raise Interrupted(self.signal, shard_id)
        self._raise_for = shard_id
        try:
            yield
        finally:
            self._raise_for = None

    def sleep(self, seconds: float, shard_id: str) -> None:
        """Wait ``seconds``, or raise ``Interrupted`` as soon as a signal has come."""
        end = time.monotonic() + seconds
        while self.signal is None and (left := end - time.monotonic()) > 0:
            time.sleep(min(left, 0.5))
        if self.signal is not None:
            raise Interrupted(self.signal, shard_id)

    def __enter__(self) -> StopFlag:
        for s in self.SIGNALS:
            self._previous[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)

    def caused(self, error: Exception, grace_s: float = 2.0) -> bool:
        """Whether ``error`` is the signal's doing: Slurm signals every process of a job (scancel, the time
        limit), so vLLM's engine core gets the SIGTERM too and may die before this process's handler
        has run; the engine's death is then the stop, not a failure (seen on the local Slurm)."""
        from shardgen.engines.vllm import engine_died

        deadline = time.time() + grace_s
        while self.signal is None and engine_died(error) and time.time() < deadline:
            time.sleep(0.05)  # the handler runs on this thread, between these sleeps
        return self.signal is not None
