"""The engine loop: ``Feeder`` keeps a window of requests in flight in the engine and yields each
completion as it finishes; a rollout's rows come back (``Turns``)."""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from shardgen.errors import RowError
from shardgen.jobs.feed.requests import PREPARE_BATCH, Request
from shardgen.requests.results import ENGINE, Completion, EngineRequest

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    pass


# How long the feeder waits on a rollout's tools at a time when the engine has nothing to run.
TURN_POLL_SECONDS = 0.05


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
    source = getattr(out, "source", ENGINE)
    if source != ENGINE:  # answered without the engine (engines.store): it took no engine time
        return Completion(req.key, req.row, out, len(out.prompt_token_ids or ()), 0, None, None, source=source)
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
