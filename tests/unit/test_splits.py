"""Splits (shards.split_seconds): an idle worker asks the holder of the slowest running shard for the rows
it has not read; the pieces of a shard cover its rows exactly once, whoever reads them."""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest

from shardgen.base import records
from shardgen.base.rundir import RunDir
from shardgen.config import RunConfig
from shardgen.data.manifest import Manifest, Segment, Shard
from shardgen.data.stats import AttemptCounters
from shardgen.engines.kinds import EngineSettings
from shardgen.features import splits
from shardgen.jobs import feed, generate
from shardgen.jobs.claims import Claim, ClaimBoard, ClaimLost, Holder
from shardgen.jobs.feed.shard_loop import RowStream, ShardFeed, ShardWork
from shardgen.requests.tasks import make_task

# rows [100, 160) of the input: the last 20 rows of file 0 (rows 80..99 of it), then 40 of file 1
SHARD = Shard("00003", 100, 160, [Segment(0, 80, 100), Segment(1, 0, 40)])


def test_the_pieces_of_a_shard_are_its_rows_once_each_with_their_segments_cut_to_them(tmp_path):
    s = splits.Splits(tmp_path / "splits")
    assert [p.id for p in s.pieces(SHARD)] == ["00003"], "never split: the shard itself"
    for cut in (110, 140, 99, 160, 500):  # cuts outside the shard's rows (an earlier plan's) are no cut
        s.record_cut(splits.clip(SHARD, 100, 160), cut, {})
    (tmp_path / "splits" / "00004.130.cut").write_text("{}")  # another shard's
    pieces = s.pieces(SHARD)
    assert [(p.id, p.start, p.stop) for p in pieces] == [("00003", 100, 110), ("00003-110", 110, 140),
                                                         ("00003-140", 140, 160)]  # fmt: skip
    assert pieces[0].segments == [Segment(0, 80, 90)]
    assert pieces[1].segments == [Segment(0, 90, 100), Segment(1, 0, 20)]
    assert pieces[2].segments == [Segment(1, 20, 40)]
    assert sum(sum(g.stop - g.start for g in p.segments) for p in pieces) == SHARD.rows
    assert splits.parent_id("00003-140") == "00003" and splits.parent_id("00003") == "00003"


def test_a_cut_gives_half_of_the_unfinished_rows_never_a_row_read_and_the_slowest_piece_is_asked():
    assert splits.cut_point(floor=120, stop=160, held=8) == 136  # 40 unread + 8 in flight: 24 go
    assert splits.cut_point(floor=150, stop=160, held=100) == 150  # never below the first unread row
    assert splits.cut_point(floor=159, stop=160, held=0) is None  # one row is no piece
    running = [splits.Running("a", 100, 50.0), splits.Running("b", 100, 400.0), splits.Running("c", 3, 900.0),
               splits.Running("d", 100, None)]  # fmt: skip
    assert splits.victim(running, 60).piece == "b", "most time left, with rows to give, and a known rate"
    assert splits.victim(running, 500) is None
    progress = records.Progress(1, "h", 1, None, started=0.0, time=100.0, rows=60, done=30, resumed=10, saved=0)
    assert splits.seconds_left(progress) == 150.0  # 20 rows in 100 s; 30 left


# -- The holder as it runs: the real shard job (generate.ShardJob) and feed (ShardFeed), on a fake engine ------------

ERROR_ROWS = (3, 7, 11, 50, 55)  # a null topic: the template fails, and the row counts against the error budget
# What a job's task needs of the engine's tokenizer (no labels, no reasoning parser): token ids for the feed.
TOKENIZER = SimpleNamespace(hf=None, encode_batch=lambda prompts: [[1, 2, 3] for _ in prompts])


class FakeEngine:
    """What the feed uses of an engine (``feed.engine_loop.Feeder``: ``submit``, ``step``, ``abort``): each step
    finishes the oldest request. ``on_step`` runs first in each step, that is between two of the
    holder's looks for a split request (``ShardFeed._poll``)."""

    max_num_seqs = 2

    def __init__(self, on_step: Callable[[FakeEngine], None] = lambda engine: None) -> None:
        self.rows: list[int] = []  # the row of each request it was given
        self.queue: list[tuple[str, list[int]]] = []
        self.steps = 0
        self.on_step = on_step

    def submit(self, requests):
        for r in requests:
            self.queue.append((r.request_id, r.prompt["prompt_token_ids"]))
            self.rows.append(int(r.request_id.rsplit("-", 1)[1]))  # the feed's ids end with the row's index
        return [None] * len(requests)

    def step(self):
        self.steps += 1
        self.on_step(self)
        request_id, ids = self.queue.pop(0)
        out = SimpleNamespace(index=0, text=f"text of {request_id}", token_ids=[7, 8], finish_reason="stop",
                              logprobs=None)  # fmt: skip
        return [SimpleNamespace(request_id=request_id, finished=True, outputs=[out], prompt_token_ids=ids,
                                num_cached_tokens=0, metrics=None)]  # fmt: skip

    def abort(self, request_ids):
        self.queue = [q for q in self.queue if q[0] not in request_ids]


def split_run(tmp_path, monkeypatch) -> tuple[RunConfig, RunDir]:
    """A run of 2 workers over one shard of 60 rows, saved every 5 rows, at most a tenth of them errors."""
    from shardgen.data.plan import write_manifest
    from tests.conftest import base_config, write_parquet

    monkeypatch.setattr(splits, "POLL_S", 0.0)  # the holder looks for a request at every poll (one stat)
    # progress.json after every row: the rate the thief reads
    monkeypatch.setattr(feed.shard_loop, "PROGRESS_SECONDS", 0.0)
    run_dir = RunDir(tmp_path / "results")
    rows = [{"id": f"r{i:02d}", "topic": None if i in ERROR_ROWS else f"topic {i}"} for i in range(60)]
    data = write_parquet(tmp_path / "in.parquet", rows)
    config = base_config({"parquet": [str(data)]}, output={"dir": str(run_dir.root)},
                         shards={"rows_per_shard": 60, "workers": 2, "lease_seconds": 60, "split_seconds": 10,
                                 "tail": "none"},
                         prompt={"template": "One sentence about {{ topic }}.", "order": "input"},
                         checkpoint={"rows": 5}, errors={"max_rate": 0.1})  # fmt: skip
    write_manifest(config, run_dir.manifest)
    run_dir.shards.mkdir(parents=True)
    return config, run_dir


def prepare(config: RunConfig, run_dir: RunDir, claim: Claim) -> generate.ShardJob:
    """A worker's attempt at the piece it claimed, as ``generate.run_shard`` prepares it (checkpoints, error
    budget, splitter); started an hour ago, so that its rate makes it worth a split."""
    job = generate.ShardJob.prepare(config, run_dir.manifest, claim.shard, {"source": "test"}, guard=claim.check)
    job.started -= 3600
    return job


def feed_and_commit(job: generate.ShardJob, run_dir: RunDir, engine: FakeEngine, work: ShardWork | None = None):
    """Phases 3 and 4 of ``generate.run_shard``, with ``engine`` in place of vLLM's: the feed, then the commit."""
    counters = AttemptCounters()
    shard_feed = ShardFeed(work or job.work(), make_task(job.config, TOKENIZER, None), TOKENIZER, engine,
                           lambda: False, counters, window=4)  # fmt: skip
    try:
        shard_feed.run()
        run = generate.AttemptRun(EngineSettings(model=dict(job.config.model)), counters)
        return job.commit(run_dir.shard_file(job.shard.id), run_dir.shard_stats(job.shard.id), run)
    except BaseException as e:
        job.record_end(e, counters)
        raise
    finally:
        job.splitter.close()


def wait_for(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_an_idle_worker_gets_the_rows_the_holder_has_not_read_and_a_holder_with_none_declines(tmp_path, monkeypatch):
    """Worker 0 runs shard 00000; worker 1, with nothing left, asks (its ``ClaimBoard.next`` and ``Thief``)
    while the holder's feed runs. The holder cuts at a row it has not read: its shard job, checkpoints and
    error budget end there, and worker 1 claims and runs the rows past it. Each row is run once, by one."""
    config, run_dir = split_run(tmp_path, monkeypatch)
    s = splits.of_run(config)
    manifest = Manifest.load(run_dir.manifest)
    held = ClaimBoard(run_dir.claims, Holder.here(0), 60, below=run_dir.root).claim("00000")
    job = prepare(config, run_dir, held)
    work = job.work()
    idle = ClaimBoard(run_dir.claims, Holder.here(1), 60, below=run_dir.root, sleep=lambda _: pytest.fail("waited"))
    thief = splits.Thief(s, run_dir, {"worker": 1}, min_seconds=10, sleep=lambda _: time.sleep(0.01))
    taken: list[Claim] = []
    asks: list[threading.Thread] = []
    floors: list[int] = []  # at each ask: the first row the holder has not read

    def idle_worker() -> None:  # nothing unclaimed: it asks the live holder for a split, then claims the piece
        taken.append(idle.next(lambda: ["00000", *s.new_pieces(manifest)], lambda _: False, thief.steal))

    def ask(target) -> None:
        floors.append(work.remaining.floor)
        asks.append(threading.Thread(target=target))
        asks[-1].start()
        wait_for(lambda: s.pending("00000") or not asks[-1].is_alive())  # asked: the holder answers at its next poll

    def between_steps(engine: FakeEngine) -> None:
        rows = work.remaining
        if engine.steps == 10:
            ask(idle_worker)
        elif len(asks) == 1 and rows.floor == rows.stop:  # later, every row before the cut read: it declines
            ask(lambda: thief.steal(["00000"]))

    engine = FakeEngine(between_steps)
    stats = feed_and_commit(job, run_dir, engine, work)
    for t in asks:
        t.join()

    # The holder answers at its poll after the 10th step: rows 0..15 read, 13 of them finished (10 by the
    # engine, rows 3, 7 and 11 errors), 3 in flight. Of the 44 rows not read and the 3 held, 23 go: cut at 37.
    assert floors[0] == 16
    assert [(p.id, p.start, p.stop) for p in s.pieces(manifest.shard("00000"))] == [("00000", 0, 37),
                                                                                   ("00000-37", 37, 60)]  # fmt: skip
    assert max(engine.rows) == 36 and job.splitter.stop_now() == 37, "the holder read no row past the cut"
    assert (job.shard.stop, job.ckpt.stop, job.ckpt.rows) == (37, 37, 37), "its job and checkpoints end there"
    assert (job.budget.rows, job.budget.limit, job.budget.errors) == (37, 3, 3), "its error budget is of its rows"
    assert (stats["rows"], stats["errors"]) == (37, 3)
    assert not s.pending("00000") and set(thief.declined) == {"00000"}, "then, with none left to give, it declined"
    assert floors[1] == 37 and thief.steal(["00000"]) is False, "not asked again: nothing worth asking"
    held.release()  # committed

    (claim,) = taken
    assert (claim.shard, claim.generation) == ("00000-37", 1)
    piece = prepare(config, run_dir, claim)
    assert (piece.shard.start, piece.shard.stop, piece.budget.limit) == (37, 60, 2)
    other = FakeEngine()
    feed_and_commit(piece, run_dir, other)
    claim.release()
    assert sorted(other.rows) == [i for i in range(37, 60) if i not in ERROR_ROWS], "the rows the holder did not read"
    for p in s.pieces(manifest.shard("00000")):
        assert generate.committed(config, manifest, p, run_dir.shard_file(p.id), run_dir.shard_stats(p.id))
    tables = [pq.read_table(run_dir.shard_file(p)) for p in ("00000", "00000-37")]
    assert sorted(i for t in tables for i in t.column("row_index").to_pylist()) == list(range(60)), "each row once"
    assert sorted(i for t in tables for i, e in zip(t["row_index"].to_pylist(), t["error"].to_pylist(), strict=True)
                  if e) == list(ERROR_ROWS)  # fmt: skip


def test_a_holders_commit_raises_claim_lost_when_the_cut_moved(tmp_path, monkeypatch):
    """A cut this attempt did not make (its holder before it decided it, then lost its claim to this one):
    the piece's rows by the cut files are not those this attempt ran, so it is not committed."""
    config, run_dir = split_run(tmp_path, monkeypatch)
    s = splits.of_run(config)
    shard = Manifest.load(run_dir.manifest).shard("00000")
    held = ClaimBoard(run_dir.claims, Holder.here(0), 60, below=run_dir.root).claim("00000")
    job = prepare(config, run_dir, held)

    def earlier_holders_cut(engine: FakeEngine) -> None:
        if engine.steps == 5:
            assert s.record_cut(shard, 40, {"piece": "00000", "cut": 40})

    engine = FakeEngine(earlier_holders_cut)
    with pytest.raises(ClaimLost, match=r"shard 00000: its rows end at 40 by .*, not at 60 as this attempt ran"):
        feed_and_commit(job, run_dir, engine)
    assert max(engine.rows) == 59, "this attempt knew of no cut: it ran every row"
    assert not run_dir.shard_file("00000").exists() and not run_dir.shard_stats("00000").exists()
    assert [(p.start, p.stop) for p in s.pieces(shard)] == [(0, 40), (40, 60)]


def test_an_idle_worker_waits_for_a_rate_of_a_piece_that_has_reported_none_then_ends(tmp_path):
    """A piece whose holder has reported no progress yet (its engine starting) may be the slowest: the
    worker waits for a rate, up to splits.RATE_WAIT_S in all, before it ends."""
    run_dir = RunDir(tmp_path)
    slept = []
    thief = splits.Thief(splits.Splits(run_dir.splits), run_dir, {"worker": 1}, min_seconds=10, sleep=slept.append)
    while thief.steal(["00009"]):
        assert len(slept) <= splits.RATE_WAIT_S / splits.POLL_S
    assert sum(slept) == splits.RATE_WAIT_S and thief.asked == 0


def test_a_worker_with_only_live_claims_left_asks_for_a_split_and_ends_when_none_is_worth_it(tmp_path):
    def renewed(seconds):  # while B watches, A's heartbeat renews its claim
        path = tmp_path / "claims" / "00000.1.claim"
        os.utime(path, (path.stat().st_mtime + seconds, path.stat().st_mtime + seconds))

    a = ClaimBoard(tmp_path / "claims", Holder.here(0), 60.0)
    b = ClaimBoard(tmp_path / "claims", Holder.here(1), 60.0, sleep=renewed)
    a.claim("00000")
    asked: list[list[str]] = []

    def steal(live: list[str]) -> bool:
        asked.append(live)
        return len(asked) < 2  # the first request made a piece, which the next look finds

    claim = b.next(lambda: ["00000", "00000-7"][: len(asked) + 1], lambda _: False, steal)
    assert claim.shard == "00000-7" and asked == [["00000"]]
    claim.release()  # committed
    assert b.next(["00000", "00000-7"], lambda s: s == "00000-7", steal) is None and asked[-1] == ["00000"]


def test_once_asked_the_feed_reads_no_row_ahead_to_sort_so_the_next_split_has_rows_to_give():
    """prompt.order: prefix reads a window of rows ahead to sort them; after a split request the feed
    reads a row only when it has none left to give the engine, so rows past the floor stay unread."""
    from types import SimpleNamespace

    from shardgen.jobs.feed.requests import prepared_requests

    renderer = SimpleNamespace(render_batch=lambda rows: [r["p"] for r in rows])
    tokenizer = SimpleNamespace(encode_batch=lambda prompts: [[len(p)] for p in prompts])
    task = SimpleNamespace(params=lambda index, row: None)
    stream = RowStream(((i, {"p": "x" * (i % 7 + 1)}) for i in range(1000)), 1000, 0)
    window = [64]
    requests = prepared_requests(stream, renderer, tokenizer, task, None, order_window=lambda: window[0], batch_rows=8)
    sent = [next(requests).key for _ in range(10)]
    assert sent[:3] == [0, 7, 14] and stream.floor >= 64, "the shortest prompts first, over the rows read ahead"
    window[0] = 1  # ShardFeed._order_window once asked
    floor = stream.floor
    for _ in range(floor - len(sent)):  # the rows read ahead drain first, and no row more is read
        next(requests)
    assert stream.floor == floor
    next(requests)
    assert stream.floor == floor + 8, "then one batch at a time"


def test_prefix_order_sorts_what_a_piece_finishes_in_a_minute_so_a_split_has_rows_to_give():
    """A tail shard of the plan is a quarter of an average shard (2,500 rows of 10,000): a fixed window of
    2,048 beside 512 in flight read it whole at its start, and a split had nothing to give (issue 38).
    A piece a split may cut sorts what it finishes in ORDER_WINDOW_SECONDS; a run without splits, all."""
    from shardgen.jobs.feed.requests import ORDER_WINDOW_MIN, ORDER_WINDOW_SECONDS, order_window

    assert order_window(512) == 2048 and order_window(8) == 1024, "no splits: the whole window"
    assert order_window(512, 100.0) == 2048, "fast rows: the whole window"
    assert order_window(512, 10.0) == int(10 * ORDER_WINDOW_SECONDS) < 2048
    assert order_window(512, 0.0) == ORDER_WINDOW_MIN > 0, "no rate yet: one batch"
    rows, in_flight = 2_500, 512
    read = in_flight + order_window(in_flight, 10.0)  # 10 rows/s, asked once the window is full
    holder = splits.cut_point(read, rows, held=read)
    assert holder is not None and rows - holder >= 900, (read, holder)
    assert splits.cut_point(in_flight + order_window(in_flight), rows, held=in_flight + 2048) is None, "before"


def test_a_feed_sorts_the_whole_window_unless_a_split_may_cut_its_piece_then_what_it_finishes_in_a_minute():
    """ShardFeed asks order_window with its rate only when an idle worker may split its piece (an elastic
    worker's, with shards.split_seconds > 0: generate.ShardJob.work gives the feed no split otherwise)."""
    import time
    from types import SimpleNamespace

    from shardgen.data.stats import AttemptCounters
    from shardgen.jobs.feed.requests import ORDER_WINDOW_SECONDS
    from shardgen.jobs.feed.shard_loop import ShardFeed

    engine = SimpleNamespace(max_num_seqs=256)

    def feed(split, rows_done: int) -> ShardFeed:
        work = SimpleNamespace(shard_id="00000", rows=10_000, resumed=0, order="prefix", split=split)
        f = ShardFeed(work, None, None, engine, lambda: False, AttemptCounters())  # type: ignore[arg-type]
        f._read_ahead, f._started, f._rows_before = True, time.monotonic() - 100, 0  # 100 s into the piece
        f.counters.rows = rows_done
        return f

    assert feed(None, 100)._order_window() == 2048, "no split: the whole window, whatever the rate"
    window = feed(object(), 500)._order_window()  # 5 rows/s
    assert abs(window - 5 * ORDER_WINDOW_SECONDS) <= 2, window
    asked = feed(object(), 500)
    asked._read_ahead = False
    assert asked._order_window() == 1, "asked for a split: no row more is read to be sorted"


def test_a_holder_closes_the_splits_directory_it_opened_so_a_worker_of_many_pieces_keeps_no_descriptors(tmp_path):
    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    before = open_fds()
    for _ in range(20):  # generate.run_shard closes each piece's splitter when the piece ends
        clock = itertools.count(0, 10).__next__
        holder = splits.Splitter(splits.Splits(RunDir(tmp_path).splits), SHARD, SHARD, lambda: None, clock=clock)
        assert not holder.wanted() and holder.splits._dir is not None, "the look opened the directory"
        holder.close()
    assert open_fds() == before


def test_a_cut_whose_record_cannot_be_written_stays_made_and_ends_the_holders_attempt(tmp_path, monkeypatch):
    """The cut file's name is the cut: a worker may have listed it already, so a failed write (a full
    disk) leaves it, and the holder stops there (its attempt ends; the retry runs the narrowed piece)."""
    s = splits.Splits(tmp_path / "splits")
    holder = splits.Splitter(s, SHARD, SHARD, guard=lambda: None, clock=lambda: 10.0)
    assert s.request(SHARD.id, {"worker": 1})

    def full(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("shardgen.base.io.write_all", full)
    with pytest.raises(OSError, match="No space left"):
        holder.decide(130)
    monkeypatch.undo()
    assert [(p.id, p.start, p.stop) for p in s.pieces(SHARD)] == [("00003", 100, 130), ("00003-130", 130, 160)]
    assert holder.stop_now() == 130, "the holder's piece ends at the cut by the files"


def test_without_split_seconds_a_holder_answers_no_request_but_its_commit_still_sees_the_cuts(tmp_path):
    s = splits.Splits(tmp_path / "splits")
    holder = splits.Splitter(s, SHARD, SHARD, guard=lambda: None, answer=False, clock=lambda: 10.0)
    assert s.request(SHARD.id, {"worker": 1}) and not holder.wanted()
    s.record_cut(SHARD, 140, {})  # an earlier run's holder of the shard, still running
    assert holder.stop_now() == 140
    gone = splits.Splitter(s, SHARD, splits.clip(SHARD, 120, 160), guard=lambda: None)
    with pytest.raises(ValueError, match="has no piece '00003-120'"):
        gone.stop_now()


def test_the_error_budget_of_a_cut_shard_is_of_its_rows_now():
    from shardgen.jobs.feed.shard_loop import ErrorBudget, TooManyErrors

    budget = ErrorBudget("00003", 60, 0.1)  # 6 errors allowed
    for i in range(4):
        budget.add(100 + i, "template: boom")
    budget.narrow(50)  # 5 allowed
    with pytest.raises(TooManyErrors, match="4 of its 30 rows"):
        budget.narrow(30)  # 3 allowed: 4 is too many
