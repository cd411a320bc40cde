"""A job of several shards has one stop flag: a signal cannot fall between two shards and be lost.
(The flag inside a shard, with the real engine: tests/integration/test_generate_engine.py.)"""

from __future__ import annotations

import os
import signal

import pytest

from shardgen import generate
from shardgen.engine import Engine
from shardgen.generate import Interrupted


def test_a_signal_during_one_shard_of_a_job_stops_the_next_before_it_starts(tmp_path):
    running = Engine(llm=object())  # a running engine the job was handed: never started or stopped here
    with generate._StopFlag() as stop:
        os.kill(os.getpid(), signal.SIGTERM)  # as Slurm's, arriving while the previous shard commits
        with pytest.raises(Interrupted, match="shard 00001: stopped by SIGTERM"):
            # nothing of the shard is read or written: its plan does not even exist
            generate.run_shard(None, tmp_path / "no-plan.json", "00001", tmp_path / "out", tmp_path / "stats",
                               engine=running, stop=stop)  # fmt: skip
    assert not any(tmp_path.iterdir())


def test_a_worker_waiting_for_a_silent_claims_lease_stops_at_once_on_sigterm(tmp_path):
    """Every shard is held by another worker whose process lives (this test's parent): the worker waits
    for its lease (a minute) to run out, and Slurm's SIGTERM ends that wait at once, not after it."""
    import threading
    import time

    from shardgen.claims import ClaimBoard, Holder
    from shardgen.plan import write_manifest
    from shardgen.rundir import RunDir
    from tests.conftest import base_config, make_rows, write_parquet

    run_dir = RunDir(tmp_path / "results")
    data = write_parquet(tmp_path / "in.parquet", make_rows(4))
    config = base_config({"parquet": [str(data)]}, output={"dir": str(run_dir.root)},
                         shards={"rows_per_shard": 8, "workers": 1, "lease_seconds": 60})  # fmt: skip
    write_manifest(config, run_dir.manifest)
    other = Holder(worker=1, token="other", host=Holder.here(0).host, job_id=None, pid=os.getppid())
    assert ClaimBoard(run_dir.claims, other, 60, below=run_dir.root).claim("00000") is not None
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    started = time.monotonic()
    with pytest.raises(Interrupted, match="stopped by SIGTERM"):
        generate.run_worker(config, run_dir.manifest, 0, engine=Engine(llm=object()))
    timer.join()
    assert time.monotonic() - started < 5, "the wait ended with the signal, not with the lease"


def test_a_worker_takes_shards_in_the_plans_work_order(tmp_path, monkeypatch):
    import json

    from shardgen.claims import ClaimBoard
    from shardgen.plan import write_manifest
    from shardgen.rundir import RunDir
    from tests.conftest import base_config, make_rows, write_parquet

    run_dir = RunDir(tmp_path / "results")
    data = write_parquet(tmp_path / "in.parquet", make_rows(12))
    config = base_config({"parquet": [str(data)]}, output={"dir": str(run_dir.root)},
                         shards={"rows_per_shard": 4, "workers": 1})  # fmt: skip
    manifest = write_manifest(config, run_dir.manifest)
    for shard, tokens in zip(manifest["shards"], [10, 30, 20], strict=True):
        shard["estimated_tokens"] = tokens
    run_dir.manifest.write_text(json.dumps(manifest))
    offered = []
    monkeypatch.setattr(ClaimBoard, "next", lambda self, ids, is_done, steal: offered.append(list(ids())))
    generate.run_worker(config, run_dir.manifest, 0, engine=Engine(llm=object()))
    assert offered == [["00001", "00002", "00000"]]
