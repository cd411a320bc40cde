"""The shard loop: completions become saved rows, errors count against the budget, progress is
reported, a split gives rows away, and a signal stops it after a last save."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from shardgen.base.progress import progress_bar
from shardgen.data.stats import AttemptCounters
from shardgen.errors import RowError, ShardgenError, error_reason
from shardgen.jobs.feed.engine_loop import Feeder, Turns
from shardgen.jobs.feed.requests import PREPARE_BATCH, RowInputs, order_window, prepared_requests
from shardgen.requests.results import DROPPED, DUPLICATE, ENGINE, STORE, Completion

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from shardgen.base.records import Progress
    from shardgen.config import CheckpointConfig
    from shardgen.data.outputs import ShardCheckpoint
    from shardgen.engines.kinds import Tokenizer
    from shardgen.requests.prompts import PromptRenderer
    from shardgen.requests.tasks import Task


# How often a running shard rewrites its progress.json (what the tests and `shardgen status` read).
PROGRESS_SECONDS = 5.0


class Split(Protocol):
    """What the feed asks of a piece an idle worker may split (``splits.Splitter``), between engine steps."""

    def wanted(self) -> bool:
        """Whether an idle worker asks for a split now."""

    def cut(self, floor: int, stop: int, held: int) -> int | None:
        """Where to cut the rows ``[.., stop)``: never below ``floor``; ``held`` are in flight. None: nowhere."""

    def decide(self, cut: int | None) -> bool:
        """Answer the request: cut at ``cut`` (None: decline); True when the cut was made."""


class TooManyErrors(ShardgenError):
    """More than ``errors.max_rate`` of the shard's rows are per-row errors."""

    outcome = "too_many_errors"


class ErrorBudget:
    """Counts per-row errors and fails the shard as soon as the final rate must exceed ``max_rate``.

    With ``rows`` rows in the shard, more than ``floor(max_rate * rows)`` errors
    means the rate is above the limit whatever the remaining rows give, so the
    shard stops there instead of spending GPU time on a lost cause.
    """

    def __init__(self, shard_id: str, rows: int, max_rate: float, errors: int = 0, first: str | None = None) -> None:
        self.shard_id, self.rows, self.max_rate = shard_id, rows, max_rate
        self.limit = int(max_rate * rows)
        self.errors = errors
        self.reasons: dict[str, int] = {}
        self.first = first
        self.check()

    def narrow(self, rows: int) -> None:
        """The shard now holds ``rows`` rows (a split gave the rest away): its limit is of those."""
        self.rows, self.limit = rows, int(self.max_rate * rows)
        self.check()

    def add(self, index: int, error: str) -> None:
        self.errors += 1
        reason = error_reason(error)
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        if self.first is None:
            self.first = f"row {index}: {error}"
        self.check()

    def check(self) -> None:
        if self.errors > self.limit:
            reasons = ", ".join(f"{k} {v}" for k, v in sorted(self.reasons.items()))
            raise TooManyErrors(
                f"shard {self.shard_id}: {self.errors} of its {self.rows} rows are errors, more than "
                f"errors.max_rate {self.max_rate} allows ({self.limit})"
                + (f" [{reasons}]" if reasons else "")
                + f"; first: {self.first}. Fix the input or prompt.template (or raise errors.max_rate); "
                "finished rows are kept for the next attempt"
            )


# -- One shard --------------------------------------------------------------------------------------


class RowStream:
    """``(index, row)`` of a shard's rows still to do, in input order, up to ``stop``, which a split
    lowers: ``floor`` is the first row a cut may start at (every row below it was pulled, or saved by
    an earlier attempt), ``pulled`` the rows handed out."""

    def __init__(self, rows: Iterable[tuple[int, dict[str, Any]]], stop: int, floor: int) -> None:
        self._rows = iter(rows)
        self.stop, self.floor, self.pulled = stop, floor, 0

    def __iter__(self) -> RowStream:
        return self

    def __next__(self) -> tuple[int, dict[str, Any]]:
        index, row = next(self._rows)
        if index >= self.stop:  # the thief's now
            raise StopIteration
        self.floor = max(self.floor, index + 1)
        self.pulled += 1
        return index, row


@dataclass
class ShardWork:
    """What a shard's feed reads from and writes to (``generate.ShardJob.work`` makes it)."""

    shard_id: str
    rows: int  # the shard's input rows
    resumed: int  # of which are done already, in checkpoints of earlier attempts
    remaining: RowStream  # (index, row) of the others, in input order
    renderer: PromptRenderer
    ckpt: ShardCheckpoint  # where finished rows and progress go
    every: CheckpointConfig  # how often finished rows are saved
    order: str  # prompt.order
    budget: ErrorBudget
    progress: Callable[[int, int, dict[str, int]], Progress]  # (done, saved, error reasons) -> progress.json
    # an elastic worker's piece: an idle worker may ask for the rows it has not read
    split: Split | None = None
    narrow: Callable[[int], None] = lambda stop: None  # the shard now ends at ``stop`` (a split's cut)
    schema: Any = None  # the rows' (a pyarrow.Schema)
    on_save: Callable[[], None] = lambda: None  # before rows are saved: the request store's new answers


class ShardLoop:
    """What a loop over one shard's rows keeps besides its work (``ShardFeed``, and a task's own,
    ``Task.run_rows``): the finished output rows not saved yet, saved every ``checkpoint.rows`` rows or
    ``checkpoint.seconds`` seconds (``_tick``), the shard's progress.json and progress bar; ``_end``
    saves and reports what is left, however the loop ends."""

    def __init__(self, work: ShardWork, counters: AttemptCounters) -> None:
        self.work, self.counters = work, counters
        self._finished: list[dict[str, Any]] = []
        self._last_flush = self._last_progress = time.time()
        self._bar = progress_bar(total=work.rows, initial=work.resumed, desc=f"shard {work.shard_id}")

    def _count_row(self, tokens: int = 0) -> None:
        """An input row of the shard is done (its output rows are in ``_finished``)."""
        self.counters.rows += 1
        self._bar.update(1, tokens=tokens)

    def _tick(self, now: float) -> None:
        """Save, and rewrite progress.json, when it is time."""
        every = self.work.every
        if len(self._finished) >= every.rows or now - self._last_flush >= every.seconds:
            self._flush(now)
        if now - self._last_progress >= PROGRESS_SECONDS:
            self._report_progress(now)

    def _end(self) -> None:
        self._flush(time.time())
        self._report_progress(time.time())  # what is saved now, for shardgen status
        self._bar.close()

    def _flush(self, now: float) -> None:
        self.work.on_save()  # the answers first: a saved row's answer is in the store
        self.work.ckpt.flush(self._finished)
        self._finished.clear()
        self._last_flush = now

    def _report_progress(self, now: float) -> None:
        self._last_progress = now
        work = self.work
        done = work.resumed + self.counters.rows
        work.ckpt.write_progress(work.progress(done, work.ckpt.saved_inputs, work.budget.reasons))


class ShardFeed(ShardLoop):
    """The rows of one shard that are still to do, through the engine, into checkpoint parts.

    Args:
        work: the shard's rows, its checkpoint, its error budget and how it saves.
        task: what the rows become (``tasks.GenerateTask``).
        tokenizer: the engine's.
        engine: the running engine (``Feeder``).
        stop: true once SIGTERM/SIGINT arrived.
        counters: where the attempt's work is counted.
        window: requests kept in flight (tests make it small).
        inputs: what requests carry beside their tokens (a LoRA adapter, images).
    """

    def __init__(
        self,
        work: ShardWork,
        task: Task,
        tokenizer: Tokenizer,
        engine: Any,
        stop: Callable[[], bool],
        counters: AttemptCounters,
        window: int | None = None,
        inputs: RowInputs | None = None,
    ) -> None:
        super().__init__(work, counters)
        self.task, self.tokenizer, self.stop = task, tokenizer, stop
        self.inputs = inputs
        self.feeder = Feeder(engine, window)
        self.order = work.order
        self.turns: Turns | None = None

    @property
    def stats(self) -> dict[str, Any]:
        s = self.feeder.stats
        out = {
            "steps": s.steps,
            "max_in_flight": s.max_in_flight,
            "steps_short": s.steps_short,
            "window": self.feeder.window,
            "order": self.order,
        }
        if self.turns is not None:
            out["rollout"] = {**self.turns.stats(), "engine_idle_on_tools_s": round(s.idle_on_tools_s, 3)}
        return out

    def run(self) -> None:
        """Feed every remaining row; the last save happens however it ends (a signal, an error, the end).

        Raises:
            TooManyErrors: the shard's errors passed ``errors.max_rate``.
        """
        work = self.work
        self._read_ahead = True
        self._started, self._rows_before = time.monotonic(), self.counters.rows
        batch_rows = min(PREPARE_BATCH, self.feeder.window)  # no row read long before the engine takes it (splits)
        window = self._order_window if self.order == "prefix" else None
        requests = prepared_requests(work.remaining, work.renderer, self.tokenizer, self.task, self._row_error,
                                     window, self.inputs, batch_rows)  # fmt: skip
        self._report_progress(time.time())
        self.turns = self.task.turns()  # a rollout's conversations: their turns come back
        try:
            for c in self.feeder.run(requests, should_stop=self._poll, turns=self.turns):
                if c.error is not None:
                    self._row_error(c.key, c.row, c.error, c.prompt_tokens)
                else:
                    self._completed(c)
                self._tick(time.time())
        finally:
            if self.turns is not None:
                self.turns.close()  # the rows whose tools still run are the next attempt's
            self._end()

    def _order_window(self) -> int:
        """prompt.order: prefix: the requests to sort now (``order_window``: for a piece a split may cut,
        what it finishes in ``ORDER_WINDOW_SECONDS`` at its rate so far); 1 once an idle worker asked for a
        split (``_poll``): the rows not read are what the next split gives."""
        if not self._read_ahead:
            return 1
        if self.work.split is None:
            return order_window(self.feeder.window)
        elapsed = time.monotonic() - self._started
        rate = (self.counters.rows - self._rows_before) / elapsed if elapsed > 0 else 0.0
        return order_window(self.feeder.window, rate)

    def _poll(self) -> bool:
        """Between engine steps: whether to stop; first, an idle worker's request for a split is answered
        (``splits``), here, in the thread that pulls the rows, so no row past the cut is pulled after."""
        split, rows = self.work.split, self.work.remaining
        if split is not None and split.wanted():
            self._read_ahead = False  # the end of the run: keep unread what the next split may give
            cut = split.cut(rows.floor, rows.stop, rows.pulled - self.counters.rows)
            if split.decide(cut):
                log.info("shard %s: split at row %d for an idle worker (rows from %d were not read yet)",
                         self.work.shard_id, cut, rows.floor)  # fmt: skip
                self._bar.total -= rows.stop - cut
                rows.stop = cut
                self.work.narrow(cut)
        return self.stop()

    def _completed(self, c: Completion) -> None:
        finished = self.task.finish(c.row, c)
        for row in finished.rows:
            row["result_source"] = c.source
        self._finished.extend(finished.rows)
        n = self.counters
        if c.source == ENGINE:
            n.requests += 1
            n.prompt_tokens += c.prompt_tokens
            n.cached_tokens += c.cached_tokens
            n.generated_tokens += finished.generated_tokens
            for hist, value in ((n.ttft, c.ttft_s), (n.latency, c.latency_s), (n.queue, c.queue_s),
                                (n.ttft_scheduled, c.ttft_scheduled_s)):  # fmt: skip
                if value is not None:
                    hist.add(value)
        else:  # answered without the engine (engines.store): no engine work to count
            n.reused += c.source == STORE
            n.deduplicated += c.source == DUPLICATE
        self._count_row(finished.generated_tokens)
        if finished.error is not None:
            self.work.budget.add(c.key, finished.error)

    def _row_error(self, index: int, row: dict[str, Any], error: RowError, prompt_tokens: int | None = None) -> None:
        if error.reason == DROPPED:  # no error of this run's: its reason stays in the row's `dropped`
            self._finished.extend(self.task.spec.error_rows(row, index, None))  # type: ignore[arg-type]
        else:
            self._finished.extend(self.task.spec.error_rows(row, index, str(error), prompt_tokens))
            self.work.budget.add(index, str(error))
        self._count_row()
