"""The feed of a shard's rows to the engine: prepared a small batch at a time, kept ahead of the
engine, saved as they finish.

Three layers, each with its own state:

- ``prepared_requests``: the shard's remaining rows, rendered and tokenized
  ``PREPARE_BATCH`` at a time (one call of the chat template and one of the
  fast tokenizer per batch, several times cheaper per row than a call per
  row), pulled only when the engine has room. With ``prompt.order: prefix``
  a moving window of up to ``order_window`` prepared requests gives out the
  one whose tokens sort first, so prompts that share a prefix are submitted
  together and hit the prefix cache before it is evicted; the window fills
  while the engine already runs, so nothing waits for a whole block.
- ``Feeder``: keeps ``window`` requests in flight in the engine (more than its
  ``max_num_seqs``, so its scheduler always has requests waiting), and yields
  each completion as soon as it finishes. This is what ``LLM.generate`` does
  internally (``add_request`` + ``step``), minus holding every prompt and
  every output at once.
- ``ShardFeed``: one shard's loop: the task turns completions into output
  rows, finished rows are saved every ``checkpoint.rows`` rows or
  ``checkpoint.seconds`` seconds, errors count against the error budget,
  progress is reported, and SIGTERM/SIGINT stop it after a last save.
"""

from __future__ import annotations

import array
import contextlib
import heapq
import itertools
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from shardgen import sources
from shardgen.errors import RowError, ShardgenError, error_reason
from shardgen.images import row_images
from shardgen.progress import progress_bar
from shardgen.results import DROPPED, Completion, EngineRequest
from shardgen.stats import AttemptCounters

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from shardgen.config import CheckpointConfig, RunConfig
    from shardgen.engine import Tokenizer
    from shardgen.lora import Adapters
    from shardgen.outputs import ShardCheckpoint
    from shardgen.prompts import PromptRenderer
    from shardgen.records import Progress
    from shardgen.sources import Source
    from shardgen.tasks import Task


class Split(Protocol):
    """What the feed asks of a piece an idle worker may split (``splits.Splitter``), between engine steps."""

    def wanted(self) -> bool:
        """Whether an idle worker asks for a split now."""

    def cut(self, floor: int, stop: int, held: int) -> int | None:
        """Where to cut the rows ``[.., stop)``: never below ``floor``; ``held`` are in flight. None: nowhere."""

    def decide(self, cut: int | None) -> bool:
        """Answer the request: cut at ``cut`` (None: decline); True when the cut was made."""


# Rows rendered and tokenized in one go: large enough that the batch calls pay off, small enough
# that the first request goes out at once.
PREPARE_BATCH = 64
# How often a running shard rewrites its progress.json (what the tests and `shardgen status` read).
PROGRESS_SECONDS = 5.0
# prompt.order: prefix sorts no fewer prepared requests than this: one batch.
ORDER_WINDOW_MIN = PREPARE_BATCH
# How long the feeder waits on a rollout's tools at a time when the engine has nothing to run.
TURN_POLL_SECONDS = 0.05
# A piece a split may cut reads ahead to sort no more rows than it finishes in this time.
ORDER_WINDOW_SECONDS = 60.0


def order_window(in_flight: int, rows_per_s: float | None = None) -> int:
    """How many prepared requests ``prompt.order: prefix`` sorts at once: 4 × the requests kept in flight
    (at least 1,024); for a piece an idle worker may split (``rows_per_s``: its rate so far), no more than
    it finishes in ``ORDER_WINDOW_SECONDS`` (at least ``ORDER_WINDOW_MIN``).

    A split gives away only rows its holder has not read (``splits.cut_point``). A window of a fixed size
    read a tail shard of the plan (a quarter of an average shard) to its end at once, and held the
    heaviest shards' rows for a long time (output lengths the plan cannot see, at the end of the run:
    those are the ones split): with the guided tail and splits, 10,000 shards of sigma 1.5 on 256 GPUs
    ended at 1.38× the bound with that window and at 1.07× with this one (``bench/results/scale.md``,
    the ``defaults`` rows). Rows that finish fast, where sharing a prefix saves most of a row's time, keep
    the whole window (a piece finishing 35 rows/s or more); rows of long outputs, whose time is decoding,
    sort fewer (``bench/results/order.md``).
    """
    full = max(4 * in_flight, 1024)
    if rows_per_s is None:
        return full
    return min(full, max(ORDER_WINDOW_MIN, int(rows_per_s * ORDER_WINDOW_SECONDS)))


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


# -- Requests -----------------------------------------------------------------------------------------


@dataclass
class Request:
    """One row's prompt for the engine; ``key`` (the row's index) comes back with its completion."""

    key: int
    prompt_token_ids: list[int]
    params: Any
    row: dict[str, Any] = field(repr=False, default_factory=dict)
    submitted: float = 0.0  # when it was given to the engine (time.time())
    lora: Any = None  # the row's adapter (lora.Adapter), None for the base model
    image_columns: tuple[str, ...] = ()  # decoded only when the request goes to the engine
    prompt: Any = field(repr=False, default=None)  # what was rendered: a text, or a conversation's messages
    turn: int = 0  # a conversation's turn (``Turns``) after its first

    def images(self) -> list[Any]:
        """The row's images, decoded (when it goes to the engine: only the requests in flight hold theirs).

        Raises:
            RowError: an image does not decode, naming its column.
        """
        return row_images(self.image_columns, self.row)


@dataclass
class RowInputs:
    """What a row's request carries beside its tokens: its LoRA adapter and its images; and what its
    source asks of each row before it is a request (``sources.SourceKind``): its checks, and whether a
    row may be one the source drops (``results.DROPPED`` set: not this run's)."""

    adapters: Adapters | None = None
    image_columns: tuple[str, ...] = ()
    checks: tuple[Callable[[dict[str, Any]], None], ...] = ()
    drops_rows: bool = False

    @classmethod
    def for_run(cls, config: RunConfig, source: Source, adapters: Adapters | None = None) -> RowInputs:
        """A run's, over ``source``: what a shard job and the preflight make each row's request with."""
        kind = sources.source_kind(source.kind)
        return cls(adapters, config.prompt.images, sources.row_checks(config, kind), kind.drops_rows)

    def check(self, row: dict[str, Any]) -> None:
        """A row the source drops is dropped; one its source's checks refuse is the row's error.

        Raises:
            RowError: naming the field (``dropped``: the row is not this run's).
        """
        if self.drops_rows and row.get(DROPPED) is not None:
            raise RowError(DROPPED, row[DROPPED])
        for check in self.checks:
            check(row)

    def lora(self, row: dict[str, Any]) -> Any:
        """The row's adapter (``lora.Adapter``; None: the base model).

        Raises:
            RowError: the row names an adapter that is not declared.
        """
        return self.adapters.for_row(row) if self.adapters is not None else None


def prepared_requests(
    rows: Iterator[tuple[int, dict[str, Any]]],
    renderer: PromptRenderer,
    tokenizer: Tokenizer,
    task: Task,
    on_error: Callable[[int, dict[str, Any], RowError], None],
    order_window: Callable[[], int] | None = None,
    inputs: RowInputs | None = None,
    batch_rows: int = PREPARE_BATCH,
) -> Iterator[Request]:
    """The rows as requests, prepared ``PREPARE_BATCH`` at a time as they are pulled.

    A row that cannot become a prompt (a null value, a template error, too
    long, an adapter not declared) goes to ``on_error`` instead. With ``order_window`` (prefix order),
    requests come out of a moving window of prepared ones, smallest prompt tokens first: up to
    ``order_window()`` of them, asked before each read (1 once an idle worker asked for a split: no row
    is then read to be sorted until the window has drained, so the rows not read yet are the ones a
    split can give).
    """
    inputs = inputs or RowInputs()
    batches = (_prepare(batch, renderer, tokenizer, task, on_error, inputs) for batch in _chunks(rows, batch_rows))
    if order_window is None:
        for batch in batches:
            yield from batch
        return
    heap: list[tuple[bytes, int, Request]] = []
    seq = itertools.count()
    exhausted = False
    while True:
        while not exhausted and len(heap) < order_window():
            batch = next(batches, None)
            if batch is None:
                exhausted = True
                break
            for req in batch:
                # token ids as fixed-width bytes: compared by memcmp, and requests that share a
                # token prefix share a byte prefix, so they sort next to each other
                heapq.heappush(heap, (array.array("I", req.prompt_token_ids).tobytes(), next(seq), req))
            if heap:
                break  # give the engine something now; the window fills on the next pulls
        if not heap:
            return
        yield heapq.heappop(heap)[2]


def _chunks(rows: Iterator[tuple[int, dict[str, Any]]], size: int) -> Iterator[list[tuple[int, dict[str, Any]]]]:
    while chunk := list(itertools.islice(rows, size)):
        yield chunk


def _prepare(batch, renderer, tokenizer, task, on_error, inputs: RowInputs) -> list[Request]:
    prompts, keep = [], []
    for (index, row), prompt in zip(batch, renderer.render_batch([row for _, row in batch]), strict=True):
        try:
            inputs.check(row)
            if isinstance(prompt, RowError):
                raise prompt
            lora = inputs.lora(row)
        except RowError as e:
            on_error(index, row, e)
            continue
        prompts.append(prompt)
        keep.append((index, row, lora))
    out = []
    for (index, row, lora), prompt, ids in zip(keep, prompts, tokenizer.encode_batch(prompts), strict=True):
        try:
            if isinstance(ids, RowError):
                raise ids
            params = task.params(index, row)
        except RowError as e:
            on_error(index, row, e)
            continue
        out.append(Request(index, ids, params, row, lora=lora, image_columns=inputs.image_columns, prompt=prompt))
    return out


# -- The engine's queue ---------------------------------------------------------------------------------


class Turns(Protocol):
    """Rows that come back to the engine: a conversation's next turn is submitted once the tools its
    last turn called have returned (``rollouts.Rollouts``, made by ``Task.turns``). The feeder asks it
    between engine steps, and waits on it when nothing else is in flight."""

    def ended(self, req: Request, c: Completion) -> Completion | None:
        """A turn finished: the row's completion when the row ends with it, None when it goes on."""
        ...

    def ready(self) -> tuple[list[Request], list[Completion]]:
        """The next turns whose tools returned, and the rows that ended once theirs did."""
        ...

    def waiting(self) -> int:
        """Rows whose tools are running."""
        ...

    def wait(self, seconds: float) -> None:
        """Until a tool returns, at most ``seconds``."""
        ...

    def stats(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


@dataclass
class FeedStats:
    """What the feed loop saw.

    ``steps_short`` counts engine steps that ran with fewer than ``window``
    requests in flight while more were still to come: each one is a moment
    the engine's queue was not kept full. A saturated feed has none.
    """

    steps: int = 0
    max_in_flight: int = 0
    steps_short: int = 0
    # with turns (a rollout): seconds the engine had nothing to run while tools ran
    idle_on_tools_s: float = 0.0


class Feeder:
    """Feeds an engine from an iterator of requests, keeping ``window`` requests in flight.

    Args:
        engine: a started engine (``engine.Engine``, or any with its ``submit``, ``step``, ``abort`` and
            ``max_num_seqs``: ``fake_engine.FakeEngine``).
        window: requests kept unfinished in the engine; by default twice its
            ``max_num_seqs``, so its scheduler always has waiting requests to
            admit when a sequence finishes.
    """

    def __init__(self, engine: Any, window: int | None = None) -> None:
        self._engine = engine
        self._feed_id = ""
        self.window = window or 2 * engine.max_num_seqs
        self.stats = FeedStats()

    def _add(self, batch: list[Request]) -> Iterator[tuple[Request, str | None, Exception | None]]:
        """Add requests to the engine; ``(request, request id, None)`` for each one it took,
        ``(request, None, error)`` for each one it refused (vLLM validates each request) or whose
        images do not decode (decoded here, so that only the requests in flight hold theirs)."""
        submitted: list[tuple[Request, EngineRequest]] = []
        for r in batch:
            prompt: dict[str, Any] = {"prompt_token_ids": r.prompt_token_ids}
            if r.image_columns:
                try:
                    prompt["multi_modal_data"] = {"image": r.images()}
                except RowError as e:
                    yield r, None, e
                    continue
            # Ids unique to this feed, so an engine shared by several feeds never
            # hands one feed's output to another.
            request_id = f"{self._feed_id}-{r.key}" + (f".{r.turn}" if r.turn else "")
            submitted.append((r, EngineRequest(request_id, prompt, r.params, r.lora, r.key)))
        if not submitted:
            return
        now = time.time()
        for r, _ in submitted:
            r.submitted = now
        errors = self._engine.submit([e for _, e in submitted])
        for (r, e), error in zip(submitted, errors, strict=True):
            yield (r, None, error) if error is not None else (r, e.request_id, None)

    def run(
        self, requests: Iterable[Request], should_stop: Callable[[], bool] = lambda: False, turns: Turns | None = None
    ) -> Iterator[Completion]:
        """Yield a Completion per request, in finishing order.

        A request the engine refuses (vLLM validates each one) comes back as
        a Completion with ``error`` set; the others go on. When
        ``should_stop()`` turns true, no more requests are added, those in
        flight are aborted, and the iteration ends. With ``turns`` (a rollout),
        a finished request is the row's only when ``turns.ended`` says so; a
        row's next turn goes to the engine as soon as ``turns.ready`` has it,
        before any new row, and a row waiting on its tools holds its place in
        the window.
        """
        self._feed_id = uuid.uuid4().hex[:8]
        it = iter(requests)
        in_flight: dict[str, Request] = {}
        exhausted = False

        def add(batch: list[Request]) -> Iterator[Completion]:
            # every request the engine took is in flight before a refused one's row is handed out: the
            # consumer may raise there (the error budget, a lost claim), and then those are aborted
            added = list(self._add(batch))
            in_flight.update((request_id, req) for req, request_id, _ in added if request_id is not None)
            for req, request_id, e in added:
                if request_id is not None:
                    continue
                error = e if isinstance(e, RowError) else RowError("rejected_by_engine", f"{type(e).__name__}: {e}")
                c = Completion(req.key, req.row, None, len(req.prompt_token_ids), 0, None, None, error)
                if turns is None or (c := turns.ended(req, c)) is not None:  # type: ignore[assignment]
                    yield c

        try:
            while True:
                if turns is not None:
                    nexts, ended = turns.ready()
                    yield from ended
                    if nexts and not should_stop():
                        yield from add(nexts)
                waiting = turns.waiting() if turns is not None else 0
                while not exhausted and len(in_flight) + waiting < self.window and not should_stop():
                    # a prepared batch at a time: the engine core starts on the first while the next is prepared
                    want = min(self.window - len(in_flight) - waiting, PREPARE_BATCH)
                    batch = list(itertools.islice(it, want))
                    exhausted = len(batch) < want
                    yield from add(batch)
                if should_stop():
                    return
                if not in_flight:
                    if not waiting:
                        return
                    t0 = time.monotonic()  # nothing to run until a tool returns
                    turns.wait(TURN_POLL_SECONDS)  # type: ignore[union-attr]
                    self.stats.idle_on_tools_s += time.monotonic() - t0
                    continue
                self.stats.max_in_flight = max(self.stats.max_in_flight, len(in_flight))
                if not exhausted and len(in_flight) + waiting < self.window:
                    self.stats.steps_short += 1
                outputs = self._engine.step()
                self.stats.steps += 1
                now = time.time()
                for out in outputs:
                    if out.finished and out.request_id in in_flight:
                        req = in_flight.pop(out.request_id)
                        if (refused := getattr(out, "error", None)) is not None:  # an engine that answers later
                            error = RowError("rejected_by_engine", refused)
                            c = Completion(req.key, req.row, None, len(req.prompt_token_ids), 0, None, None, error)
                        else:
                            c = _completion(req, out, now)
                        if turns is None or (c := turns.ended(req, c)) is not None:  # type: ignore[assignment]
                            yield c
        finally:
            if in_flight:
                # The engine may be dead already (that may be why we stop); the
                # original error is the one worth raising.
                with contextlib.suppress(Exception):
                    self._engine.abort(list(in_flight))


def _completion(req: Request, out: Any, now: float) -> Completion:
    """The finished request's figures. TTFT from arrival includes the time the request waited in the
    engine's queue, which a saturated feed keeps full on purpose; queue time and TTFT from scheduling
    split it (vllm/v1/metrics/stats.py: RequestStateStats, as update_from_finished_request does).

    A pooling output (``PoolingRequestOutput``) carries no metrics and has no first token: its
    latency is from its submission to the step that returned it (vllm/outputs.py)."""
    metrics = getattr(out, "metrics", None)
    ttft = queue = ttft_scheduled = None
    latency = now - req.submitted if req.submitted else None
    if metrics is not None:
        ttft = metrics.first_token_latency or None
        if metrics.arrival_time:
            latency = now - metrics.arrival_time
        if metrics.scheduled_ts and metrics.queued_ts:
            queue = max(metrics.scheduled_ts - metrics.queued_ts, 0.0)
        if metrics.first_token_ts and metrics.scheduled_ts:
            ttft_scheduled = max(metrics.first_token_ts - metrics.scheduled_ts, 0.0)
    return Completion(
        key=req.key,
        row=req.row,
        output=out,
        prompt_tokens=len(out.prompt_token_ids or ()),
        cached_tokens=out.num_cached_tokens or 0,
        ttft_s=ttft,
        latency_s=latency,
        queue_s=queue,
        ttft_scheduled_s=ttft_scheduled,
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
        self._finished.extend(finished.rows)
        n = self.counters
        n.requests += 1
        n.prompt_tokens += c.prompt_tokens
        n.cached_tokens += c.cached_tokens
        n.generated_tokens += finished.generated_tokens
        for hist, value in ((n.ttft, c.ttft_s), (n.latency, c.latency_s), (n.queue, c.queue_s),
                            (n.ttft_scheduled, c.ttft_scheduled_s)):  # fmt: skip
            if value is not None:
                hist.add(value)
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
