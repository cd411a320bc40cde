"""A job of several shards has one stop flag: a signal cannot fall between two shards and be lost.
(The flag inside a shard, with the real engine: tests/integration/test_generate_engine.py.)"""

from __future__ import annotations

import os
import signal

import pytest

from shardgen.engines.vllm import Engine
from shardgen.jobs import generate, workers
from shardgen.jobs.generate import JobContext
from shardgen.jobs.stopflag import Interrupted, StopFlag


def test_a_signal_during_one_shard_of_a_job_stops_the_next_before_it_starts(tmp_path):
    running = Engine(llm=object())  # a running engine the job was handed: never started or stopped here
    with StopFlag() as stop:
        os.kill(os.getpid(), signal.SIGTERM)  # as Slurm's, arriving while the previous shard commits
        with pytest.raises(Interrupted, match="shard 00001: stopped by SIGTERM"):
            # nothing of the shard is read or written: its plan does not even exist
            generate.run_shard(None, tmp_path / "no-plan.json", "00001", tmp_path / "out", tmp_path / "stats",
                               JobContext(engine=running, stop=stop))  # fmt: skip
    assert not any(tmp_path.iterdir())


def test_a_worker_waiting_for_a_silent_claims_lease_stops_at_once_on_sigterm(tmp_path):
    """Every shard is held by another worker whose process lives (this test's parent): the worker waits
    for its lease (a minute) to run out, and Slurm's SIGTERM ends that wait at once, not after it."""
    import threading
    import time

    from shardgen.base.rundir import RunDir
    from shardgen.data.plan import write_manifest
    from shardgen.jobs.claims import ClaimBoard, Holder
    from tests.conftest import base_config, make_rows, write_parquet

    run_dir = RunDir(tmp_path / "results")
    data = write_parquet(tmp_path / "in.parquet", make_rows(4))
    config = base_config({"parquet": [str(data)]}, output={"dir": str(run_dir.root)},
                         shards={"rows_per_shard": 8, "workers": 1, "lease_seconds": 60, "tail": "none"})  # fmt: skip
    write_manifest(config, run_dir.manifest)
    other = Holder(worker=1, token="other", host=Holder.here(0).host, job_id=None, pid=os.getppid())
    assert ClaimBoard(run_dir.claims, other, 60, below=run_dir.root).claim("00000") is not None
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    started = time.monotonic()
    with pytest.raises(Interrupted, match="stopped by SIGTERM"):
        workers.run_worker(config, run_dir.manifest, 0, JobContext(engine=Engine(llm=object())))
    timer.join()
    assert time.monotonic() - started < 5, "the wait ended with the signal, not with the lease"


def test_a_worker_takes_shards_in_the_plans_work_order(tmp_path, monkeypatch):
    import json

    from shardgen.base.rundir import RunDir
    from shardgen.data.plan import write_manifest
    from shardgen.jobs.claims import ClaimBoard
    from tests.conftest import base_config, make_rows, write_parquet

    run_dir = RunDir(tmp_path / "results")
    data = write_parquet(tmp_path / "in.parquet", make_rows(12))
    config = base_config({"parquet": [str(data)]}, output={"dir": str(run_dir.root)},
                         shards={"rows_per_shard": 4, "workers": 1, "tail": "none"})  # fmt: skip
    manifest = write_manifest(config, run_dir.manifest)
    for shard, tokens in zip(manifest["shards"], [10, 30, 20], strict=True):
        shard["estimated_tokens"] = tokens
    run_dir.manifest.write_text(json.dumps(manifest))
    offered = []
    monkeypatch.setattr(ClaimBoard, "next", lambda self, ids, is_done, steal: offered.append(list(ids())))
    workers.run_worker(config, run_dir.manifest, 0, JobContext(engine=Engine(llm=object())))
    assert offered == [["00001", "00002", "00000"]]


def _replanned_with_a_stale_claim(tmp_path, stale: str, holder_worker: int, old_rows: int, cut: int | None = None):
    """A stopped run (``old_rows`` rows per shard, its shard 00000 cut at ``cut``) left a claim on ``stale``;
    its holder is gone (no heartbeat for an hour). The run is planned again with 4 rows per shard: 3 shards."""
    from shardgen.base.rundir import RunDir
    from shardgen.data.manifest import Manifest
    from shardgen.data.plan import write_manifest
    from shardgen.features import splits
    from shardgen.jobs.claims import ClaimBoard, Holder
    from tests.conftest import base_config, make_rows, write_parquet

    run_dir = RunDir(tmp_path / "results")
    data = write_parquet(tmp_path / "in.parquet", make_rows(12))

    def config(rows):
        return base_config({"parquet": [str(data)]}, output={"dir": str(run_dir.root)},
                           shards={"rows_per_shard": rows, "workers": 2, "lease_seconds": 60,
                                   "tail": "none"})  # fmt: skip

    write_manifest(config(old_rows), run_dir.manifest)
    if cut is not None:
        splits.of_run(config(old_rows)).record_cut(Manifest.load(run_dir.manifest).shard("00000"), cut, {})
    gone = Holder(holder_worker, "earlier", Holder.here(0).host, None, os.getppid())  # alive, but silent
    old = ClaimBoard(run_dir.claims, gone, 60, below=run_dir.root)
    assert old.claim(stale) is not None
    old.close()
    path = run_dir.claims / f"{stale}.1.claim"
    os.utime(path, (path.stat().st_mtime - 3600, path.stat().st_mtime - 3600))
    new = config(4)
    write_manifest(new, run_dir.manifest)
    return new, run_dir


def _run_worker_without_engine(config, run_dir, monkeypatch) -> tuple[dict, list[str]]:
    """The real worker loop (claims, is_done, releases); each shard's run (the engine's part) only
    checks its claim, as every write does, and says it ran."""
    ran = []

    def run_shard(config, manifest_path, shard_id, output, stats, context):
        context.guard()
        ran.append(shard_id)
        return {}

    monkeypatch.setattr(generate, "run_shard", run_shard)
    record = workers.run_worker(config, run_dir.manifest, 0, JobContext(engine=Engine(llm=object())))
    return record, ran


@pytest.mark.parametrize("holder_worker", [0, 1], ids=["its-own-earlier-attempt", "another-worker"])
def test_a_stale_claim_on_a_piece_a_new_plan_no_longer_has_is_released_and_the_worker_runs_the_plan(
    tmp_path, monkeypatch, caplog, holder_worker
):
    """Shard 00000 of 12 rows was cut at row 6; planned again with 4 rows a shard, 00000 is rows [0, 4)
    and has no piece 00000-6. Its stale claim is released (not taken over and run, nor a crash of every
    retry of the worker, each leaving one more generation of the claim)."""
    config, run_dir = _replanned_with_a_stale_claim(tmp_path, "00000-6", holder_worker, old_rows=12, cut=6)
    for attempt in range(2):  # the worker, then a retry of it: neither crashes, no claim piles up
        record, ran = _run_worker_without_engine(config, run_dir, monkeypatch)
        assert sorted(ran) == ["00000", "00001", "00002"] and record["committed"] == ran
        assert not record["taken_over"], "the stale claim was not taken over as work"
        assert sorted(os.listdir(run_dir.claims)) == [], f"attempt {attempt + 1}: claims left behind"
    assert "00000-6: the plan has no such shard or piece" in caplog.text


@pytest.mark.parametrize("holder_worker", [0, 1], ids=["its-own-earlier-attempt", "another-worker"])
def test_a_stale_claim_on_a_shard_a_new_plan_no_longer_has_is_released_and_the_worker_runs_the_plan(
    tmp_path, monkeypatch, caplog, holder_worker
):
    """Planned with 2 rows a shard, the run had shards 00000 to 00005; planned again with 4, it has 3, and
    a claim on 00005 is for no shard of the plan (it was InputError: manifest: no shard '00005')."""
    config, run_dir = _replanned_with_a_stale_claim(tmp_path, "00005", holder_worker, old_rows=2)
    record, ran = _run_worker_without_engine(config, run_dir, monkeypatch)
    assert sorted(ran) == ["00000", "00001", "00002"] and not record["taken_over"]
    assert sorted(os.listdir(run_dir.claims)) == []
    assert "00005: the plan has no such shard or piece" in caplog.text
