"""Claims on shards for elastic workers: exclusive, taken over only after the lease by the file
system's clock, never twice, and a retried worker carries on with its own."""

import json
import multiprocessing
import os
import time
from pathlib import Path

import pytest

from shardgen.jobs.claims import ClaimBoard, ClaimLost, Holder, claim_name

SHARDS = [f"{i:05d}" for i in range(200)]


def board(tmp_path, worker, lease=60.0, sleep=time.sleep):
    return ClaimBoard(tmp_path / "claims", Holder.here(worker), lease, below=tmp_path, sleep=sleep)


def age(path: Path, seconds: float) -> None:
    """Make a claim's heartbeat ``seconds`` old (by the file system's clock)."""
    now = path.stat().st_mtime
    os.utime(path, (now - seconds, now - seconds))


def never_done(shard):
    return False


def test_one_claim_per_shard_and_generation(tmp_path):
    a, b = board(tmp_path, 0), board(tmp_path, 1)
    first = a.next(["00000", "00001"], never_done)
    second = b.next(["00000", "00001"], never_done)
    assert (first.shard, second.shard) == ("00000", "00001")
    assert b.claim("00000") is None
    assert json.loads((tmp_path / "claims" / "00000.1.claim").read_text())["worker"] == 0


def _claimer(directory: str, worker: int, shards: list[str], out: str) -> None:
    """A worker in its own process: claim, 'run' (record it), commit (a done marker), release."""
    root = Path(directory)
    b = ClaimBoard(root / "claims", Holder.here(worker), 2.0, below=root)
    done_dir = root / "done"

    def is_done(shard):
        return (done_dir / shard).exists()

    ran = []
    while (claim := b.next(shards, is_done)) is not None:
        with claim:
            if is_done(claim.shard):
                claim.release()
                continue
            try:
                claim.check()  # what every write of a shard's files does first
            except ClaimLost:
                continue
            ran.append(claim.shard)
            (done_dir / claim.shard).touch()
            claim.release()
    Path(out).write_text(json.dumps(ran))


def _race(tmp_path, workers, shards):
    (tmp_path / "done").mkdir(exist_ok=True)
    ctx = multiprocessing.get_context("fork")
    procs = [
        ctx.Process(target=_claimer, args=(str(tmp_path), w, shards, str(tmp_path / f"ran-{w}.json")))
        for w in range(workers)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    return [s for w in range(workers) for s in json.loads((tmp_path / f"ran-{w}.json").read_text())]


def test_sixteen_workers_racing_for_200_shards_run_each_exactly_once(tmp_path):
    ran = _race(tmp_path, 16, SHARDS)
    assert sorted(ran) == SHARDS
    # every committed shard's claims were removed: only shards in progress are listed
    assert [n for n in os.listdir(tmp_path / "claims") if n.endswith(".claim")] == []


def test_workers_racing_to_take_over_stale_claims_take_each_exactly_once(tmp_path):
    """20 claims of a dead worker, all past the lease: 12 workers race for them (generation 2 of each),
    and each shard is run by exactly one."""
    shards = SHARDS[:20]
    dead = board(tmp_path, 99)
    for s in shards:
        dead.claim(s)
        age(tmp_path / "claims" / claim_name(s, 1), 10)
    ran = _race(tmp_path, 12, shards)
    assert sorted(ran) == shards
    assert [n for n in os.listdir(tmp_path / "claims") if n.endswith(".claim")] == []


def test_a_claim_is_taken_over_only_after_the_lease_by_the_file_systems_clock(tmp_path, monkeypatch):
    def renewed(seconds):  # while B watches, A's heartbeat renews its claim
        path = tmp_path / "claims" / "00000.1.claim"
        os.utime(path, (path.stat().st_mtime + seconds, path.stat().st_mtime + seconds))

    a, b = board(tmp_path, 0, lease=30), board(tmp_path, 1, lease=30, sleep=renewed)
    claim = a.next(["00000"], never_done)
    path = tmp_path / "claims" / claim.name
    age(path, 5)  # a heartbeat late, and renewed: the holder is alive
    assert b.next(["00000"], never_done) is None
    # B's node clock an hour ahead changes nothing: ages come from file times only
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 3600)
    assert b.next(["00000"], never_done) is None
    age(path, 60)  # now well past the lease without a heartbeat
    taken = b.next(["00000"], never_done)
    assert (taken.shard, taken.generation, taken.took_over["worker"]) == ("00000", 2, 0)
    with pytest.raises(ClaimLost, match="taken over by another worker"):
        claim.check()
    claim.release()  # the old holder removes nothing of the new holder's
    assert (tmp_path / "claims" / taken.name).exists()


def test_the_heartbeat_keeps_a_running_shard_from_being_taken_over(tmp_path):
    a, b = board(tmp_path, 0, lease=1.0), board(tmp_path, 1, lease=1.0)
    claim = a.next(["00000"], never_done)
    with claim:
        time.sleep(2.5)  # more than two leases, renewed every 0.2 s
        assert b.next(["00000"], never_done) is None
    claim.check()


def test_a_holder_whose_claim_was_released_and_claimed_anew_knows_it_lost_it(tmp_path):
    a, b = board(tmp_path, 0), board(tmp_path, 1)
    claim = a.next(["00000"], never_done)
    (tmp_path / "claims" / claim.name).unlink()
    again = b.claim("00000")  # same name, another file
    assert again is not None
    with pytest.raises(ClaimLost):
        claim.check()


def earlier_attempt(tmp_path, worker, job_id=None, **kwargs):
    """A board of a worker's earlier attempt: another process (alive until ``.kill()``) on this host."""
    import secrets
    import subprocess

    from shardgen.base import jobinfo

    proc = subprocess.Popen(["sleep", "600"])
    holder = Holder(worker, secrets.token_hex(8), jobinfo.host(), job_id, proc.pid)
    return ClaimBoard(tmp_path / "claims", holder, 60.0, below=tmp_path, **kwargs), proc


def test_a_retried_worker_takes_its_own_claims_back_first_once_its_earlier_attempt_has_ended(tmp_path):
    first, proc = earlier_attempt(tmp_path, 3)
    c1 = first.next(SHARDS[:3], never_done)
    c1.mark_failed(RuntimeError("boom"))
    c2 = first.next(SHARDS[:3], never_done)
    waited = []

    def sleep(seconds):  # the earlier attempt is still saving its rows; it ends while the retry waits
        waited.append(seconds)
        proc.kill()
        proc.wait()

    retry = board(tmp_path, 3, sleep=sleep)  # the same worker index, a new process (Snakemake's retry)
    got = [retry.next(SHARDS[:3], never_done) for _ in range(3)]
    assert got[0].shard == "00002", "a shard nobody holds while the earlier attempt still runs"
    assert sorted(c.shard for c in got[1:]) == sorted([c1.shard, c2.shard])
    assert all(c.generation == 2 for c in got[1:]) and len(waited) == 1
    with pytest.raises(ClaimLost):
        c2.check()  # had the earlier attempt woken up, it could not have written


def test_a_job_owns_its_shard_only_once_the_earlier_holder_has_ended(tmp_path):
    """One job per shard: the retry of a job still ending in Slurm (scancel, a time limit under
    KillWait) waits for it; it never writes beside it."""
    states = ["RUNNING", "COMPLETING", "CANCELLED"]
    dying, proc = earlier_attempt(tmp_path, -1, job_id="901")
    old = dying.acquire("00007")
    proc.kill()
    asked, slept = [], []

    def job_state(job_id):
        asked.append(job_id)
        return states[min(len(asked) - 1, 2)]

    retry = ClaimBoard(tmp_path / "claims", Holder.here(-1), 60.0, below=tmp_path, sleep=slept.append,
                       job_state=job_state)  # fmt: skip
    new = retry.acquire("00007")
    assert (new.generation, asked, len(slept)) == (2, ["901"] * 3, 2)
    assert new.took_over["job_id"] == "901"
    with pytest.raises(ClaimLost):
        old.check()
    assert ClaimBoard(tmp_path / "claims", Holder.here(-1), 60.0, below=tmp_path).scan()["00007"].generation == 2


def test_a_failed_claim_of_another_worker_is_left_to_that_workers_retry(tmp_path):
    a, b = board(tmp_path, 0, lease=1), board(tmp_path, 1, lease=1)
    claim = a.next(["00000"], never_done)
    claim.mark_failed(ValueError("too many errors"))
    age(tmp_path / "claims" / claim.name, 3600)
    assert b.next(["00000"], never_done) is None
    marker = json.loads((tmp_path / "claims" / (claim.name + ".failed")).read_text())
    assert marker["error"] == "ValueError: too many errors"


def test_a_worker_with_nothing_left_waits_out_a_silent_claims_lease_then_takes_it(tmp_path):
    waited = []

    def sleep(seconds):
        waited.append(seconds)
        age(tmp_path / "claims" / "00000.1.claim", seconds)  # time passes; no heartbeat comes

    a = board(tmp_path, 0, lease=100)
    a.next(["00000"], never_done)
    age(tmp_path / "claims" / "00000.1.claim", 50)  # silent for 2.5 heartbeats, half the lease
    b = board(tmp_path, 1, lease=100, sleep=sleep)
    taken = b.next(["00000"], never_done)
    assert taken.generation == 2
    assert waited and sum(waited) >= 50


def test_committed_shards_are_not_claimed_and_release_removes_every_generation(tmp_path):
    a = board(tmp_path, 0, lease=1)
    claim = a.next(["00000", "00001"], lambda s: s == "00000")
    assert claim.shard == "00001"
    age(tmp_path / "claims" / claim.name, 10)
    newer = board(tmp_path, 1, lease=1).next(["00001"], never_done)
    newer.release()
    assert [n for n in os.listdir(tmp_path / "claims") if not n.startswith(".clock")] == []


def test_a_worker_with_nothing_left_watches_fresh_claims_and_takes_over_one_that_is_not_renewed(tmp_path):
    """A worker killed a moment ago: its claim is young, but it is not renewed while the idle worker
    watches it for one and a half heartbeats; so the idle worker waits out the lease and takes it."""
    slept = []

    def sleep(seconds):  # time passes, and no heartbeat comes
        slept.append(seconds)
        age(tmp_path / "claims" / "00000.1.claim", seconds)

    board(tmp_path, 0, lease=100).next(["00000"], never_done)
    taken = board(tmp_path, 1, lease=100, sleep=sleep).next(["00000"], never_done)
    assert taken.generation == 2
    assert slept[:15] == [2] * 15  # watched for 1.5 heartbeats of 20 s, looking 10 times a heartbeat


def test_a_worker_with_nothing_left_ends_once_every_other_claim_was_renewed(tmp_path):
    claim = board(tmp_path, 0, lease=100).next(["00000"], never_done)
    slept = []

    def sleep(seconds):  # the holder's heartbeat renews the claim meanwhile
        slept.append(seconds)
        path = tmp_path / "claims" / claim.name
        os.utime(path, (path.stat().st_mtime + 1, path.stat().st_mtime + 1))

    assert board(tmp_path, 1, lease=100, sleep=sleep).next(["00000"], never_done) is None
    assert slept == [2], "the watch ends at the first look that finds the claim renewed"


def test_a_worker_with_nothing_left_ends_once_the_claim_it_watches_is_released(tmp_path):
    """The last shard's holder commits it and releases its claim while an idle worker watches: the idle
    worker ends at its next look, not one and a half heartbeats later with its GPUs idle."""
    claim = board(tmp_path, 0, lease=100).next(["00000"], never_done)
    slept = []

    committed = set()

    def sleep(seconds):
        slept.append(seconds)
        if len(slept) == 3:
            committed.add(claim.shard)
            claim.release()

    assert board(tmp_path, 1, lease=100, sleep=sleep).next(["00000"], committed.__contains__) is None
    assert slept == [2, 2, 2]


def test_a_claim_on_work_the_plan_does_not_hold_is_released_once_its_holder_is_gone_and_a_live_ones_left(
    tmp_path, caplog
):
    """Claims of a run planned again since (other rows per shard): 00007 of a worker that failed on it and
    is gone, 00009 of one still running. Neither is the plan's work (``shard_ids``): the first is released
    with every generation, never taken over and run; the second is left to its holder, and neither waited
    for nor asked to split."""
    gone = board(tmp_path, 5)
    stale = gone.claim("00007")
    age(tmp_path / "claims" / stale.name, 3600)
    stale = gone.claim("00007", 2)  # a retry took it back, and failed too
    stale.mark_failed(RuntimeError("shard 00007 has no piece"))
    age(tmp_path / "claims" / stale.name, 3600)
    live = board(tmp_path, 6).claim("00009")
    slept, asked = [], []

    def steal(live: list[str]) -> bool:
        asked.append(live)
        return False

    b = board(tmp_path, 0, sleep=slept.append)
    claim = b.next(["00000"], never_done, steal)
    assert claim.shard == "00000" and claim.generation == 1
    claim.release()  # committed
    assert b.next(["00000"], lambda s: True, steal) is None
    assert slept == [] and all("00009" not in shards for shards in asked)
    assert sorted(n for n in os.listdir(tmp_path / "claims") if not n.startswith(".clock")) == ["00009.1.claim"]
    live.check()
    assert "00007: the plan has no such shard or piece" in caplog.text and "released" in caplog.text
    assert "00009: the plan has no such shard or piece; its claim is left to worker 6" in caplog.text
