"""Claims on shards: who may write a shard, in every mode.

Every generate job owns the shards it writes through a claim: an elastic
worker (``shards.workers``) for each shard it takes, a job of one shard (or
of ``shards.per_job`` shards) for each of its shards (``ClaimBoard.acquire``).

W worker jobs take shards from the plan, largest estimated work first
(``manifest.work_order``), until none is left. A worker claims a shard by
creating ``claims/<shard>.<generation>.claim`` with ``O_EXCL``: of any
number of workers racing for the same name, exactly one creates it. The
file says who holds it (worker index, host, Slurm job, pid, a token); its
modification time is the heartbeat, renewed by a thread while the shard runs.

A claim whose heartbeat is older than the lease (``shards.lease_seconds``)
belongs to a worker that is gone. Its age is judged by the file system's
clock, never a node's: each worker touches a clock file of its own and reads
the time back. Another worker takes the shard over by creating the next
generation, ``<shard>.<g+1>.claim``, again with ``O_EXCL``, and resumes it
from its checkpoints. The holder of generation g has lost the shard as soon
as generation g+1 exists (or its own file is gone): it checks before every
write and abandons the shard without writing (``ClaimLost``). Generations make
takeover free of races: two workers that both find g stale both try g+1, and
one of them gets it.

A claim is never taken from a holder that is still alive: a retry that
overlaps its dying attempt (a time limit under KillWait, ``scancel``, a
preemption's grace), or a job of a rerun while an orphan of a killed
controller still runs, waits until the holder is gone (``holder_gone``:
Slurm no longer lists its job as running, or its process on this host has
ended) or its heartbeat is older than the lease. A worker that Snakemake
retries (the same worker index) takes its own claims back first, once its
earlier attempt is gone, and carries on. A shard that failed with an error (not a kill or a
signal) is marked ``<shard>.<g>.failed``: only the retry of the worker that
held it tries it again, so one bad shard fails one worker, as it fails one job
when each shard is a job, instead of every worker in turn. A committed shard's
claims are removed, so the directory holds only the shards in progress.

A claim on a shard or piece the plan does not hold (a stopped run's, planned
again since: other rows per shard, another input, other workers with
``tail: guided``) is work nobody can run: once its holder is gone it is
released, never taken over as work; a live holder's is left alone.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from shardgen import cluster
from shardgen.base import jobinfo
from shardgen.base.io import Dir
from shardgen.base.rundir import RunDir
from shardgen.errors import ShardgenError

log = logging.getLogger(__name__)

CLAIM_NAME = re.compile(r"([0-9]+(?:-[0-9]+)?)\.([0-9]+)\.claim")  # a shard's, or a piece's (splits)
FAILED = ".failed"
# Heartbeats per lease: a claim is taken over only after this many renewals were missed in a row.
BEATS_PER_LEASE = 5
# Longest sleep between looks at a silent claim, while waiting for its lease to run out.
MAX_WAIT_S = 30.0
# Looks per heartbeat at the claims a worker with nothing left watches (``ClaimBoard.watch``).
WATCH_LOOKS_PER_BEAT = 10


class ClaimLost(ShardgenError):
    """Another worker took this shard over (this worker's heartbeat stopped for longer than the lease)."""


def holder_gone(
    record: dict[str, Any] | None,
    job_state: Callable[[str], str | None] = cluster.job_state,
    own_worker: int | None = None,
    own_token: str | None = None,
) -> bool:
    """Whether the holder a claim file names can no longer write: its Slurm job has ended (Slurm is
    asked; a job Slurm still ends, COMPLETING, is not gone), or, outside Slurm, its process on this
    host has. False when that cannot be known: the lease decides then."""
    if not record:
        return False
    job = record.get("job_id")
    if job and job != os.environ.get("SLURM_JOB_ID"):
        state = job_state(str(job))  # '': Slurm has forgotten it; COMPLETING: still ending its processes
        return state == "" or state in cluster.FINAL_STATES
    if record.get("host") == jobinfo.host() and record.get("pid") == os.getpid():
        # this process runs one attempt of a worker's shard at a time: another token of the same
        # worker is an attempt that has ended here (tests run shards again in one process)
        return record.get("worker") == own_worker and record.get("token") != own_token
    return jobinfo.process_gone(record.get("host"), record.get("pid"))


@dataclass(frozen=True)
class Holder:
    """Who holds a claim: written into the claim file."""

    worker: int
    token: str
    host: str
    job_id: str | None
    pid: int

    @classmethod
    def here(cls, worker: int) -> Holder:
        return cls(worker, secrets.token_hex(8), jobinfo.host(), os.environ.get("SLURM_JOB_ID"), os.getpid())


@dataclass(frozen=True)
class Seen:
    """A shard's current claim, as the directory shows it."""

    shard: str
    generation: int
    failed: bool
    mtime: float  # the last heartbeat, by the file system's clock

    @property
    def name(self) -> str:
        return claim_name(self.shard, self.generation)


def claim_name(shard: str, generation: int) -> str:
    return f"{shard}.{generation}.claim"


class Claim:
    """A shard this worker holds. Inside ``with claim:`` a thread renews the heartbeat."""

    def __init__(self, board: ClaimBoard, shard: str, generation: int, took_over: dict | None) -> None:
        self.board, self.shard, self.generation = board, shard, generation
        self.name = claim_name(shard, generation)
        self.took_over = took_over  # the holder it took the shard from, if any
        self._lost = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def held(self) -> bool:
        """Whether the claim is still this worker's: no later generation, and its file is the one it
        made (its token; a released name may be claimed anew, and inode numbers are reused)."""
        d = self.board.dir
        if self._lost or d.exists(claim_name(self.shard, self.generation + 1)):
            self._lost = True
        else:
            try:
                self._lost = json.loads(d.read_text(self.name)).get("token") != self.board.holder.token
            except (OSError, ValueError):
                self._lost = True
        return not self._lost

    def check(self) -> None:
        """Before every write of the shard's files.

        Raises:
            ClaimLost: another worker holds the shard now.
        """
        if not self.held():
            raise ClaimLost(
                f"shard {self.shard}: taken over by another worker (this worker's heartbeat was older than "
                f"the lease of {self.board.lease_s:g} s); abandoned without writing"
            )

    def _beat(self) -> None:
        while not self._stop.wait(self.board.heartbeat_s):
            if not self.held():
                log.warning("shard %s: claim lost to another worker", self.shard)
                return
            try:
                self.board.dir.touch(self.name)
            except OSError as e:  # a file system hiccup: the next beat tries again
                log.warning("shard %s: heartbeat failed: %s", self.shard, e)

    def __enter__(self) -> Claim:
        self._thread = threading.Thread(target=self._beat, name=f"heartbeat-{self.shard}", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def mark_failed(self, error: BaseException) -> None:
        """The shard failed here: only this worker's retry tries it again."""
        if self.held():
            text = json.dumps({"error": f"{type(error).__name__}: {error}"[:2000], "holder": asdict(self.board.holder)})
            self.board.dir.create_exclusive(self.name + FAILED, text.encode())

    def release(self) -> None:
        """The shard is committed: remove its claims (this generation and the ones it replaced)."""
        if not self.held():
            return
        d = self.board.dir
        for g in range(self.generation, 0, -1):
            d.unlink(claim_name(self.shard, g) + FAILED)
            d.unlink(claim_name(self.shard, g))


class ClaimBoard:
    """The claims directory of a run, as one worker sees and uses it.

    Args:
        directory: ``<output.dir>/claims``.
        holder: this worker.
        lease_s: a claim whose heartbeat is older is taken over.
        below: the output directory (no symlink between it and ``directory``).
        sleep: how to wait for a silent claim's lease to run out (tests pass a fake).
        job_state: how Slurm is asked for a holder's job (``cluster.job_state``; tests pass a fake).
    """

    def __init__(
        self,
        directory: str | Path,
        holder: Holder,
        lease_s: float,
        below: str | Path | None = None,
        sleep: Callable[[float], None] = time.sleep,
        job_state: Callable[[str], str | None] = cluster.job_state,
    ) -> None:
        self.dir = Dir.open(directory, below=below)
        self._job_state = job_state
        self.holder = holder
        self.lease_s = float(lease_s)
        self.heartbeat_s = self.lease_s / BEATS_PER_LEASE
        self._sleep = sleep
        self._clock = f".clock-{holder.worker}-{holder.token}"
        self.dir.create_exclusive(self._clock, b"")

    def close(self) -> None:
        self.dir.unlink(self._clock)
        self.dir.close()

    def now(self) -> float:
        """The file system's time now (a touch of this worker's clock file, read back)."""
        return self.dir.touch(self._clock)

    def scan(self) -> dict[str, Seen]:
        """Each claimed shard's current (highest) generation."""
        names = set(self.dir.names())
        top: dict[str, int] = {}
        for name in names:
            m = CLAIM_NAME.fullmatch(name)
            if m and int(m.group(2)) > top.get(m.group(1), 0):
                top[m.group(1)] = int(m.group(2))
        seen = {}
        for shard, g in top.items():
            name = claim_name(shard, g)
            try:
                mtime = self.dir.mtime(name)
            except FileNotFoundError:  # released since the listing
                continue
            seen[shard] = Seen(shard, g, name + FAILED in names, mtime)
        return seen

    def holder_of(self, seen: Seen) -> dict[str, Any] | None:
        """The claim file's record of its holder (None when it is gone or unreadable)."""
        try:
            return json.loads(self.dir.read_text(seen.name))
        except (OSError, ValueError):
            return None

    def gone(self, record: dict[str, Any] | None, age: float, ask: bool = True) -> bool:
        """Whether a claim's holder can no longer write: its heartbeat is older than the lease, or (when
        ``ask``) it has ended (``holder_gone``: one squeue call)."""
        return age > self.lease_s or (
            ask and holder_gone(record, self._job_state, self.holder.worker, self.holder.token)
        )

    def acquire(self, shard: str) -> Claim:
        """The shard's claim for a job that must write it (one job per shard, or ``per_job``): at once
        when nobody holds it; else once its holder is gone (``gone``), looking again every heartbeat.
        A dying attempt that still saves its rows, or an orphaned job of a killed controller that still
        runs, keeps the shard until it ends."""
        said = False
        while True:
            seen = self.scan().get(shard)
            if seen is None:
                claim = self.claim(shard)
            else:
                record = self.holder_of(seen)
                if not self.gone(record, self.now() - seen.mtime):
                    if not said:
                        log.warning("shard %s: %s still holds it; waiting until it has ended (lease %g s)", shard,
                                    _who(record), self.lease_s)  # fmt: skip
                        said = True
                    self._sleep(self.heartbeat_s)
                    continue
                claim = self.claim(shard, seen.generation + 1, took_over=record)
            if claim is not None:
                return claim

    def claim(self, shard: str, generation: int = 1, took_over: dict | None = None) -> Claim | None:
        """Create generation ``generation`` of the shard's claim; None when another worker did first."""
        name = claim_name(shard, generation)
        record = asdict(self.holder) | {"shard": shard, "generation": generation, "took_over": took_over}
        if not self.dir.create_exclusive(name, json.dumps(record).encode()):
            return None
        return Claim(self, shard, generation, took_over)

    def next(
        self,
        shard_ids: Iterable[str] | Callable[[], Iterable[str]],
        is_done: Callable[[str], bool],
        steal: Callable[[list[str]], bool] | None = None,
    ) -> Claim | None:
        """The next shard for this worker, claimed; None when nothing is left for it.

        In this order: the claims this worker index held before (a retried
        worker carries on with them, failed or not); shards nobody claimed, in
        the order of ``shard_ids`` (workers pass ``manifest.work_order``, largest
        first, then the pieces splits made: a function, asked on every look);
        claims whose heartbeat is older than the lease (not marked
        failed), oldest first. When only other workers' claims are left, it
        watches them for up to one and a half heartbeats (``watch``): a claim
        that was not renewed meanwhile belongs to a worker that stopped, and
        this worker waits out its lease and takes it over, rather than leave
        the shard to a retry that may queue for hours; once every claim was
        renewed or released, it looks again, and ends when nothing is left.
        Before watching, it asks ``steal`` (with the shards the others hold) for
        a split of one of them (``splits.Thief``): a split, or a holder's answer
        that it has none to give, and it looks again.

        A claim on a shard that ``shard_ids`` does not list (the plan's every
        shard and piece) is not the plan's work: it is released once its holder
        is gone, and otherwise left alone (``_unplanned``).
        """
        watched: dict[str, float] = {}  # claim -> its heartbeat when first watched
        left: set[str] = set()  # claims on work the plan does not hold, whose holder still runs
        while True:
            seen = self.scan()
            # listed after the scan: a piece's cut file is made before any claim on it, so every claim
            # the scan saw on a piece of the plan is listed
            ids = list(shard_ids() if callable(shard_ids) else shard_ids)
            planned = set(ids)
            now = self.now()
            others: list[tuple[Seen, dict[str, Any] | None]] = []
            for s in sorted(seen.values(), key=lambda s: s.shard):
                record = self.holder_of(s)
                if s.shard not in planned:
                    self._unplanned(s, record, now - s.mtime, left)
                    continue
                mine = record is not None and record.get("worker") == self.holder.worker
                if mine and record.get("token") != self.holder.token and self.gone(record, now - s.mtime):
                    claim = self.claim(s.shard, s.generation + 1, took_over=record)
                    if claim is not None:
                        log.info("shard %s: taken back from this worker's earlier attempt", s.shard)
                        return claim
                elif mine or not s.failed:  # mine: this worker's earlier attempt, still saving its rows
                    others.append((s, record))
            for shard in ids:
                if shard not in seen and not is_done(shard):
                    claim = self.claim(shard)
                    if claim is not None:
                        return claim
            waits, unknown = [], []
            for s, record in sorted(others, key=lambda o: o[0].mtime):
                age = now - s.mtime
                mine = record is not None and record.get("worker") == self.holder.worker
                # Slurm is asked only about a holder that stopped renewing (or this worker's own earlier
                # attempt): one squeue call per such claim, not one per claim of a thousand workers.
                if self.gone(record, age, ask=mine or age > 2 * self.heartbeat_s):
                    claim = self.claim(s.shard, s.generation + 1, took_over=record)
                    if claim is not None:
                        log.warning("shard %s: heartbeat %.0f s old (lease %g s); taken over from %s",
                                    s.shard, age, self.lease_s, _who(record))  # fmt: skip
                        return claim
                elif mine:  # never leave it: wait for the earlier attempt to end
                    waits.append(self.heartbeat_s - 1.0)
                elif age > 2 * self.heartbeat_s or s.mtime <= watched.get(s.name, -1.0):
                    waits.append(self.lease_s - age)
                elif s.name not in watched:
                    unknown.append(s)
            if waits:
                wait = min(max(min(waits), 0.0) + 1.0, MAX_WAIT_S)
                log.info("%d claim(s) not renewed; looking again in %.0f s (lease %g s)", len(waits), wait,
                         self.lease_s)  # fmt: skip
                self._sleep(wait)
            elif steal is not None and steal([s.shard for s, _ in others]):
                continue  # a holder answered (a split, or not): look again
            elif unknown:
                watched.update((s.name, s.mtime) for s in unknown)
                self.watch(unknown)
            else:
                return None

    def watch(self, claims: list[Seen]) -> None:
        """Sleep while ``claims`` are watched: one and a half heartbeats, or less once each of them was
        renewed (its holder is alive) or released (its shard done, or given up). A look is one stat per
        watched claim, ``WATCH_LOOKS_PER_BEAT`` a heartbeat: a worker that finished waits for the last
        shards' commits, not for a fixed time with its GPUs idle."""
        pending = {s.name: s.mtime for s in claims}
        left, step = 1.5 * self.heartbeat_s, self.heartbeat_s / WATCH_LOOKS_PER_BEAT
        while pending and left > 0:
            self._sleep(min(step, left))
            left -= step
            for name, mtime in list(pending.items()):
                try:
                    if self.dir.mtime(name) <= mtime:
                        continue
                except FileNotFoundError:
                    pass
                del pending[name]

    def _unplanned(self, seen: Seen, record: dict[str, Any] | None, age: float, left: set[str]) -> None:
        """A claim on a shard or piece the plan does not hold: a stopped run's, planned again since. Nobody
        can run it (its rows are not the plan's), so it is never taken over as work: once its holder is gone,
        it is taken over only to be released (generation g+1 first, so that one worker removes it), with
        every earlier generation; a live holder's (``left``) is left alone, and not waited for."""
        mine = record is not None and record.get("worker") == self.holder.worker
        if self.gone(record, age, ask=mine or age > 2 * self.heartbeat_s):
            claim = self.claim(seen.shard, seen.generation + 1, took_over=record)
            if claim is not None:
                claim.release()
                log.warning("shard %s: the plan has no such shard or piece (planned again since %s claimed it); "
                            "its claim is released", seen.shard, _who(record))  # fmt: skip
        elif seen.name not in left:
            left.add(seen.name)
            log.warning("shard %s: the plan has no such shard or piece; its claim is left to %s, which still "
                        "holds it", seen.shard, _who(record))  # fmt: skip


@contextlib.contextmanager
def own(run_dir: RunDir, shard: str, lease_s: float, sleep: Callable[[float], None]) -> Iterator[Claim]:
    """A job's claim on a shard it runs by itself, not as an elastic worker (``ClaimBoard.acquire``),
    its heartbeat renewed while it runs: a retry overlapping its dying attempt, or a rerun's job beside
    an orphan of a killed controller, waits until the other is gone instead of writing beside it.
    ``sleep`` is how it waits (the job's stop flag's, so that a signal stops the wait)."""
    board = ClaimBoard(run_dir.claims, Holder.here(-1), lease_s, below=run_dir.root, sleep=sleep)
    try:
        with board.acquire(shard) as claim:
            yield claim
    finally:
        board.close()


def _who(record: dict[str, Any] | None) -> str:
    if not record:
        return "an unknown worker"
    job = f", Slurm job {record['job_id']}" if record.get("job_id") else ""
    who = f"worker {record.get('worker')}" if (record.get("worker") or 0) >= 0 else "the job"
    return f"{who} on {record.get('host')}{job} (pid {record.get('pid')})"
