"""Elastic workers (shards.workers) on the real Slurm with the real engine: two workers share the
plan; one is killed with kill -9 mid-shard, the other takes its claim over after the lease and
resumes its rows; a rerun, as the README says, merges every row exactly once."""

from __future__ import annotations

import json
import subprocess

import psutil
import pyarrow.parquet as pq
import pytest

from tests.conftest import make_rows, write_parquet
from tests.integration.workflow import BIN, Background, generate_process, part_rows, run_workflow, workflow_config

pytestmark = [pytest.mark.engine, pytest.mark.slurm]


def claims_of(out, worker: int) -> list[str]:
    """The shards whose current claim the worker holds."""
    held = []
    for path in sorted((out / "claims").glob("*.claim")):
        try:
            record = json.loads(path.read_text())
        except ValueError:
            continue
        if (
            record["worker"] == worker
            and not (out / "claims" / f"{record['shard']}.{record['generation'] + 1}.claim").exists()
        ):
            held.append(record["shard"])
    return held


def test_a_worker_killed_mid_shard_is_taken_over_after_the_lease_and_its_rows_resumed(tmp_path, slurm_cluster):
    rows = 48
    write_parquet(tmp_path / "data" / "in.parquet", make_rows(rows))
    config = workflow_config(
        {"parquet": [str(tmp_path / "data" / "in.parquet")], "id_column": "id"},
        shards={"rows_per_shard": 12, "workers": 2, "lease_seconds": 8},
        checkpoint={"rows": 2, "seconds": 300},
        sampling={"temperature": 0.0, "max_tokens": 16, "ignore_eos": True},
        # one CPU each: the node's two run both workers at once
        resources={"mem_mb": 6000, "cpus_per_task": 1, "runtime": 20},
    )
    config["model"]["max_num_seqs"] = 2
    out = tmp_path / "results"
    run = Background(tmp_path, config, "slurm", "--retries", "0")

    def saving(worker: int) -> bool:
        held = claims_of(out, worker)
        return bool(held) and part_rows(out / "checkpoints" / held[0]) > 0

    # Worker 1 must outlive worker 0 to take its claim over: a worker whose remaining shards are all
    # held by live workers ends, by design. Whichever engine starts first, worker 1 is paused (its
    # whole process tree, as in a long GC or I/O stall) once it saves rows, until worker 0 saves.
    frozen: list[psutil.Process] = []

    def victim_shard() -> bool:
        if saving(0):
            return True
        if not frozen and saving(1):
            job = generate_process(tmp_path, "--worker", "1")
            frozen.extend([job, *job.children(recursive=True)])
            for p in frozen:
                p.suspend()
        return False

    try:
        run.wait_until(victim_shard, 600, "saved rows of a shard of worker 0")
        (shard,) = claims_of(out, 0)
        job = generate_process(tmp_path, "--worker", "0")
        for p in [*job.children(recursive=True), job]:  # no warning, no save, no end record
            p.kill()
        saved = part_rows(out / "checkpoints" / shard)
    finally:
        for p in frozen:
            p.resume()
    with pytest.raises(AssertionError, match="snakemake failed"):
        run.wait()  # worker 0's job failed and no retries are left: the run stops after worker 1 ends
    record = json.loads((out / "shards" / "workers" / "1.json").read_text())
    assert shard in record["taken_over"], record
    assert record["engine_starts"] == 1, "one engine for every shard the worker ran"
    stats = json.loads((out / "shards" / f"{shard}.stats.json").read_text())
    assert stats["rows_resumed"] >= saved > 0, "the killed worker's saved rows were resumed"
    assert stats["attempt_requests"] == 12 - stats["rows_resumed"], "only the unsaved rows were generated"
    killed, finished = stats["attempts"]
    assert killed["outcome"] is None and finished["outcome"] == "committed"
    assert killed["slurm"]["job_id"] != finished["slurm"]["job_id"]
    assert sorted(p.name for p in (out / "shards").glob("*.parquet")) == [f"{i:05d}.parquet" for i in range(4)]

    # the same command again: worker 0 finds every shard committed, and the merge runs
    run_workflow(tmp_path, config, "slurm", "--retries", "0")
    table = pq.read_table(out / "output.parquet")
    assert table.column("id").to_pylist() == [f"r{i:05d}" for i in range(rows)], "every row exactly once, in order"
    assert json.loads((out / "shards" / "workers" / "0.json").read_text())["committed"] == []
    merged = json.loads((out / "stats.json").read_text())
    assert merged["rows"] == rows and merged["errors"] == 0
    assert [n for n in (out / "claims").iterdir() if n.name.endswith(".claim")] == [], (
        "committed shards' claims removed"
    )
    status = subprocess.run(
        [str(BIN / "shardgen"), "status", "--dir", str(out)], capture_output=True, text=True, check=True
    ).stdout
    assert f"rows: {rows} of {rows} done (100.0%)" in status and "shards: 4 done, 0 running" in status, status
