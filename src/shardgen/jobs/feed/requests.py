"""Request preparation: a shard's rows rendered and tokenized a batch at a time, as the engine's
requests, in the order ``prompt.order`` asks (a moving window for ``prefix``)."""

from __future__ import annotations

import array
import heapq
import itertools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from shardgen.data import sources
from shardgen.errors import RowError
from shardgen.requests.images import row_images
from shardgen.requests.results import DROPPED

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from shardgen.config import RunConfig
    from shardgen.data.sources import Source
    from shardgen.engines.kinds import Tokenizer
    from shardgen.requests.lora import Adapters
    from shardgen.requests.prompts import PromptRenderer
    from shardgen.requests.tasks import Task


# Rows rendered and tokenized in one go: large enough that the batch calls pay off, small enough
# that the first request goes out at once.
PREPARE_BATCH = 64
# prompt.order: prefix sorts no fewer prepared requests than this: one batch.
ORDER_WINDOW_MIN = PREPARE_BATCH
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
