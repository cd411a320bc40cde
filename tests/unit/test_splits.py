"""Splits (shards.split_seconds): an idle worker asks the holder of the slowest running shard for the rows
it has not read; the pieces of a shard cover its rows exactly once, whoever reads them."""

from __future__ import annotations

import itertools
import os
import threading
import time

import pytest

from shardgen import records, splits
from shardgen.claims import ClaimBoard, Holder
from shardgen.feed import RowStream
from shardgen.plan import Shard
from shardgen.rundir import RunDir
from shardgen.sources import Segment

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


def test_an_idle_worker_gets_the_rows_the_holder_has_not_read_and_a_holder_with_none_declines(tmp_path):
    run_dir = RunDir(tmp_path)
    s = splits.Splits(run_dir.splits)
    now = [0.0]
    holder = splits.Splitter(s, SHARD, SHARD, guard=lambda: None, clock=lambda: now[0])
    stream = RowStream(((i, {"i": i}) for i in range(SHARD.start, SHARD.stop)), SHARD.stop, SHARD.start)
    pulled = [next(stream)[0] for _ in range(20)]  # rows 100..119 read; 4 of them still in flight
    run_dir.checkpoint(SHARD.id).mkdir(parents=True)
    run_dir.progress(SHARD.id).write_text(
        records.Progress(1, "h", 1, None, started=0.0, time=16.0, rows=60, done=16, resumed=0, saved=16).text()
    )
    answers = []

    def hold() -> None:  # the holder's feed, polling between engine steps
        for _ in range(400):
            now[0] += 1.0
            if holder.wanted():
                cut = splits.cut_point(stream.floor, stream.stop, held=4)
                if holder.decide(cut):
                    stream.stop = cut
                answers.append(cut)
                return
            time.sleep(0.01)

    thief = splits.Thief(s, run_dir, {"worker": 1}, min_seconds=10, sleep=lambda _: time.sleep(0.02))
    t = threading.Thread(target=hold)
    t.start()
    assert thief.steal(["00003"]) is True
    t.join()
    assert answers == [138] and [p.id for p in s.pieces(SHARD)[1:]] == ["00003-138"]  # 40 unread + 4 held: 22 go
    rest = [i for i, _ in stream]
    assert max(pulled + rest) == 137 and not s.pending("00003"), "the holder stops at the cut"
    assert [(p.start, p.stop) for p in s.pieces(SHARD)] == [(100, 138), (138, 160)]
    assert holder.stop_now() == 138

    # the holder has read every row now (all in flight): it declines, and is not asked again
    t = threading.Thread(target=hold)
    t.start()
    assert thief.steal(["00003"]) is True
    t.join()
    assert answers[-1] is None and set(thief.declined) == {"00003"}
    assert thief.steal(["00003"]) is False, "nothing worth asking: the worker ends"

    # a piece whose holder has reported no progress yet (its engine starting) may be the slowest: the
    # worker waits for a rate, up to splits.RATE_WAIT_S in all, before it ends
    slept = []
    thief = splits.Thief(s, run_dir, {"worker": 1}, min_seconds=10, sleep=slept.append)
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

    from shardgen.feed import prepared_requests

    renderer = SimpleNamespace(render_batch=lambda rows: [r["p"] for r in rows])
    tokenizer = SimpleNamespace(encode_batch=lambda prompts: [[len(p)] for p in prompts])
    task = SimpleNamespace(params=lambda index, row: None)
    stream = RowStream(((i, {"p": "x" * (i % 7 + 1)}) for i in range(1000)), 1000, 0)
    read_ahead = [True]
    requests = prepared_requests(stream, renderer, tokenizer, task, None, order_window=64, batch_rows=8,
                                 read_ahead=lambda: read_ahead[0])  # fmt: skip
    sent = [next(requests).key for _ in range(10)]
    assert sent[:3] == [0, 7, 14] and stream.floor >= 64, "the shortest prompts first, over the rows read ahead"
    read_ahead[0] = False
    floor = stream.floor
    for _ in range(floor - len(sent)):  # the rows read ahead drain first, and no row more is read
        next(requests)
    assert stream.floor == floor
    next(requests)
    assert stream.floor == floor + 8, "then one batch at a time"


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

    monkeypatch.setattr("shardgen.io.write_all", full)
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
    from shardgen.feed import ErrorBudget, TooManyErrors

    budget = ErrorBudget("00003", 60, 0.1)  # 6 errors allowed
    for i in range(4):
        budget.add(100 + i, "template: boom")
    budget.narrow(50)  # 5 allowed
    with pytest.raises(TooManyErrors, match="4 of its 30 rows"):
        budget.narrow(30)  # 3 allowed: 4 is too many
