"""Splits: an idle elastic worker takes the unstarted rows of the slowest running shard.

At the end of a run of ``shards.workers``, a worker that finds no shard left
would end while another still runs a large one: the run's end waits on that
straggler. Instead it asks the shard's holder to split (``Thief``): the holder
(``Splitter``, polled by its feed between engine steps) cuts its rows at a row
it has not read yet, keeps the rows before the cut and gives the rest away as a
new piece, which any worker then claims and runs like a shard: its own claim,
checkpoints, commit, stats. A piece may be split again, so the pieces of one
shard shrink until the time left is not worth a split (``shards.split_seconds``).

Exactly once rests on three rules:

- A cut is decided only by the holder of the piece it cuts, and only at a row
  its feed has not pulled from the input (nor saved in an earlier attempt): no
  row past the cut is the holder's, in flight or saved.
- A cut is a file, ``splits/<shard>.<row>.cut``, created with ``O_EXCL`` before
  the holder stops reading at it, and never removed. The
  pieces of a shard are the ranges between its start, its cuts and its stop
  (``pieces``): every reader (the feed, a takeover, the commit, the merge,
  ``shardgen status``) computes them from the same files, so none can disagree.
- A piece is committed when its file and stats are there with the run's
  fingerprint and its stats' row range is the piece's range now
  (``generate.committed``): a file committed before a later cut does not count.

A piece is named ``<shard>-<first row>`` (the shard's first piece keeps the
shard's id): its files are those of a shard of that name (``rundir.RunDir``).
Outputs do not depend on the pieces: a row's seed comes from ``sampling.seed``
and the row's id, and every piece has its shard's fingerprint.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from shardgen.base.io import LazyDir
from shardgen.base.records import read_progress
from shardgen.base.rundir import RunDir
from shardgen.data import manifest as mf
from shardgen.data.manifest import Manifest, Segment, Shard

if TYPE_CHECKING:
    from shardgen.base.records import Progress
    from shardgen.config import RunConfig

CUT_NAME = re.compile(r"([0-9]+)\.([0-9]+)\.cut")
PIECE_ID = re.compile(r"([0-9]+)(?:-([0-9]+))?")
WANT = ".want"
# How often a holder looks for a request (one stat call), and how long a thief waits for the answer.
POLL_S = 2.0
ANSWER_WAIT_S = 30.0
# How long in all an idle worker waits for a running piece's rate to be known (its holder starting its
# engine, or not yet past its first rows) before it ends: a piece of unknown time left may be the slowest.
RATE_WAIT_S = 60.0
# A split leaves the holder at least this many unread rows' worth of work to give: one row is no piece.
MIN_ROWS = 2


def of_run(config: RunConfig) -> Splits | None:
    """The run's splits: elastic workers' (``shards.workers``) only. Every reader of a shard's rows
    asks this, so a run without workers never sees a cut an earlier run of workers made."""
    if not config.shards.workers:
        return None
    run_dir = RunDir(config.output.dir)
    return Splits(run_dir.splits, below=run_dir.root)


def piece_id(shard_id: str, start: int, shard_start: int) -> str:
    return shard_id if start == shard_start else f"{shard_id}-{start}"


def parent_id(piece: str) -> str:
    """The plan shard a piece belongs to (its own id for a shard's first piece)."""
    m = PIECE_ID.fullmatch(piece)
    if m is None:
        raise ValueError(f"not a shard or piece id: {piece!r}")
    return m.group(1)


def clip(shard: Shard, start: int, stop: int) -> Shard:
    """The piece ``[start, stop)`` of ``shard``: its segments cut to those rows."""
    segments, at = [], shard.start
    for seg in shard.segments:
        rows = seg.stop - seg.start
        a, b = max(start, at), min(stop, at + rows)
        if a < b:
            segments.append(Segment(seg.file, seg.start + a - at, seg.start + b - at))
        at += rows
    return replace(shard, id=piece_id(shard.id, start, shard.start), start=start, stop=stop, segments=segments)


@dataclass(frozen=True)
class Running:
    """A piece a worker holds, as an idle worker sees it (from its ``progress.json``)."""

    piece: str
    rows_left: int
    seconds_left: float | None  # None: no rate known yet


def seconds_left(progress: Progress) -> float | None:
    """A running piece's time to its end, at the rate of its attempt so far."""
    done_here = progress.done - progress.resumed
    elapsed = progress.time - progress.started
    if done_here <= 0 or elapsed <= 0:
        return None
    return (progress.rows - progress.done) * elapsed / done_here


def victim(running: Iterable[Running], min_seconds: float) -> Running | None:
    """The piece an idle worker asks to split: the one with the most time left, when that is more than
    ``min_seconds`` (a split then halves the end of the run's slowest piece) and it has rows to give."""
    worth = [r for r in running if r.seconds_left is not None and r.seconds_left > min_seconds
             and r.rows_left >= 2 * MIN_ROWS]  # fmt: skip
    return max(worth, key=lambda r: r.seconds_left or 0.0, default=None)


def cut_point(floor: int, stop: int, held: int) -> int | None:
    """Where a holder cuts its rows ``[.., stop)`` for an idle worker: half of the rows it has not
    finished go to the thief (those it holds in flight, ``held``, stay its own), never below ``floor``
    (the first row it has not pulled or saved). None: fewer than ``MIN_ROWS`` unread rows to give."""
    unread = stop - floor
    give = min(unread, (unread + held) // 2)
    return stop - give if give >= MIN_ROWS else None


class Splits(LazyDir):
    """The cuts of a run's shards and the requests for them (``<output.dir>/splits/``)."""

    def cuts(self, names: Iterable[str] | None = None) -> dict[str, list[int]]:
        """Each shard's cuts, sorted (from one listing, or the listing ``names``)."""
        if names is None:
            names = self.path.iterdir() if self.path.is_dir() else ()
            names = [p.name for p in names]
        out: dict[str, list[int]] = {}
        for name in names:
            if m := CUT_NAME.fullmatch(name):
                out.setdefault(m.group(1), []).append(int(m.group(2)))
        return {k: sorted(v) for k, v in out.items()}

    def pieces(self, shard: Shard, cuts: dict[str, list[int]] | None = None) -> list[Shard]:
        """The shard's pieces now, in row order: the shard itself when it was never split."""
        cuts = self.cuts() if cuts is None else cuts
        bounds = [shard.start, *(c for c in cuts.get(shard.id, ()) if shard.start < c < shard.stop), shard.stop]
        return [clip(shard, a, b) for a, b in itertools.pairwise(bounds)]

    def all_pieces(self, manifest: Manifest) -> list[Shard]:
        """Every piece of the plan, in row order (one listing)."""
        cuts = self.cuts()
        return [p for s in manifest.shards for p in self.pieces(s, cuts)]

    def piece(self, manifest: Manifest, piece: str) -> Shard:
        """A piece's rows now (``InputError`` from the manifest for an unknown shard)."""
        return self.piece_of(manifest.shard(parent_id(piece)), piece)

    def piece_of(self, shard: Shard, piece: str) -> Shard:
        """The piece ``piece`` of the plan's ``shard``, its rows now."""
        for p in self.pieces(shard):
            if p.id == piece:
                return p
        raise ValueError(f"shard {shard.id} has no piece {piece!r} (its cuts are in {self.path})")

    def new_pieces(self, manifest: Manifest) -> list[str]:
        """The pieces splits made (not the plan's shards), largest first: what workers take after the plan."""
        cuts = self.cuts()
        made = [p for s in manifest.shards if s.id in cuts for p in self.pieces(s, cuts)[1:]]
        return [p.id for p in sorted(made, key=lambda p: -p.rows)]

    # -- the thief's side and the holder's -------------------------------------------------------------

    def request(self, piece: str, who: dict[str, Any]) -> bool:
        """Ask the holder of ``piece`` to split it; False when another worker asked already."""
        return self.dir.create_exclusive(piece + WANT, json.dumps(who).encode())

    def pending(self, piece: str) -> bool:
        return self.dir.exists(piece + WANT)

    def withdraw(self, piece: str) -> None:
        self.dir.unlink(piece + WANT)

    def record_cut(self, piece: Shard, cut: int, record: dict[str, Any]) -> bool:
        """Make the cut (True; False when it exists). Its name is the cut: a record that could not be
        written leaves it made, and the error ends the holder's attempt before it reads past it."""
        shard = parent_id(piece.id)
        return self.dir.create_exclusive(f"{shard}.{cut}.cut", json.dumps(record).encode(), keep=True)


class Splitter:
    """The holder's side of a piece it runs: whether an idle worker asked for a split, and the cut.

    Args:
        splits: the run's.
        shard: the plan's shard the piece is of.
        piece: the piece as the holder runs it.
        guard: the claim check, before the cut is written (``claims.Claim.check``).
        answer: whether requests are answered (``shards.split_seconds`` > 0); the piece's end is
            checked against the cut files at its commit either way (``stop_now``).
    """

    def __init__(self, splits: Splits, shard: Shard, piece: Shard, guard: Callable[[], None],
                 answer: bool = True, clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.splits, self.shard, self.piece, self.guard, self._clock = splits, shard, piece, guard, clock
        self.answer = answer
        self._next_look = clock() + POLL_S
        self.cuts: list[int] = []

    def wanted(self) -> bool:
        """Whether an idle worker asks for a split (a file system call every ``POLL_S`` at most)."""
        now = self._clock()
        if not self.answer or now < self._next_look:
            return False
        self._next_look = now + POLL_S
        return self.splits.pending(self.piece.id)

    @staticmethod
    def cut(floor: int, stop: int, held: int) -> int | None:
        """Where to cut the piece for an idle worker (``cut_point``)."""
        return cut_point(floor, stop, held)

    def decide(self, cut: int | None) -> bool:
        """Answer the request: cut at ``cut`` (None: decline). The cut is recorded before the caller stops
        reading there; True when it was. The request is removed either way."""
        made = False
        if cut is not None:
            self.guard()
            record = {"piece": self.piece.id, "cut": cut, "stop": self.piece.stop, "time": time.time()}
            made = self.splits.record_cut(self.piece, cut, record)
            if made:
                self.piece = replace(self.piece, stop=cut)
                self.cuts.append(cut)
        self.splits.withdraw(self.piece.id)
        return made

    def close(self) -> None:
        """Close the splits directory this piece's holder opened (a worker runs many pieces)."""
        self.splits.close()

    def stop_now(self) -> int:
        """Where the piece's rows end by the cut files now (cut files are never removed, so the piece's
        start stays a bound: a piece that is gone is a run directory changed under the run)."""
        return self.splits.piece_of(self.shard, self.piece.id).stop


class Thief:
    """An idle worker's side: ask the holder of the running piece with the most time left to split it.

    Args:
        splits: the run's.
        run_dir: where each running piece's ``progress.json`` is.
        who: this worker, as the request names it.
        min_seconds: ``shards.split_seconds``.
        sleep: how to wait for the answer (the worker's, which a signal stops).
    """

    def __init__(self, splits: Splits, run_dir: RunDir, who: dict[str, Any], min_seconds: float,
                 sleep: Callable[[float], None] = time.sleep) -> None:  # fmt: skip
        self.splits, self.run_dir, self.who, self.min_seconds = splits, run_dir, who, min_seconds
        self._sleep = sleep
        # pieces whose holder gave nothing, and when: asked again only after min_seconds (it reads no
        # row ahead since, so the rows it has not read may be worth a split by then)
        self.declined: dict[str, float] = {}
        self.asked = 0
        self.rate_waited = 0.0

    def running(self, live: Iterable[str]) -> list[Running]:
        """The live pieces no other worker asked for; rows and time left unknown (-1, None) for one that
        has not reported progress yet."""
        out = []
        for piece in live:
            if self.splits.pending(piece):  # another worker asked
                continue
            try:
                progress = read_progress(self.run_dir.progress(piece).read_text())
            except OSError:
                progress = None
            if progress is None:
                out.append(Running(piece, -1, None))
            else:
                out.append(Running(piece, progress.rows - progress.done, seconds_left(progress)))
        return out

    def steal(self, live: Iterable[str]) -> bool:
        """Ask for a split of one of the ``live`` pieces (held by running workers) and wait for the
        answer; False when none is worth it (the worker then ends). True: look for a new piece. A piece
        whose holder gave nothing is asked again only after ``min_seconds`` (its holder reads no row
        ahead since, so its unread rows may be worth it then); waiting for that would bill the GPU."""
        now = time.monotonic()
        askable = [r for r in self.running(live) if now - self.declined.get(r.piece, -math.inf) >= self.min_seconds]
        chosen = victim(askable, self.min_seconds)
        if chosen is None:
            unknown = any(r.seconds_left is None and (r.rows_left < 0 or r.rows_left >= 2 * MIN_ROWS) for r in askable)
            if not unknown or self.rate_waited >= RATE_WAIT_S:
                return False
            self.rate_waited += POLL_S  # wait for a rate rather than end beside a piece that may be slow
            self._sleep(POLL_S)
            return True
        shard = parent_id(chosen.piece)
        before = self.splits.cuts().get(shard, [])  # before asking: the holder may answer at once
        if not self.splits.request(chosen.piece, self.who):
            return True  # another worker asked just now: look again
        self.asked += 1
        waited = 0.0
        while self.splits.pending(chosen.piece) and waited < ANSWER_WAIT_S:
            self._sleep(1.0)
            waited += 1.0
        if self.splits.pending(chosen.piece):  # no answer: the holder is between rows (a commit), or gone
            self.splits.withdraw(chosen.piece)
        if self.splits.cuts().get(shard, []) == before:
            self.declined[chosen.piece] = time.monotonic()
        return True


def _pieces(manifest: Manifest, run_dir: RunDir, workers: bool) -> list[Shard] | None:
    """A run's pieces now (``manifest.run_shards``): of elastic workers' runs only."""
    return Splits(run_dir.splits, below=run_dir.root).all_pieces(manifest) if workers else None


mf.PIECES.append(_pieces)
