"""Elastic workers (shards.workers) on the real Slurm: two workers share the plan; one is killed with
kill -9 mid-shard, the other takes its claim over after the lease and resumes its rows; a rerun, as the
README says, merges every row exactly once. An idle worker splits the slowest shard. Both on the fake
engine at a set speed (engine.kind: fake): claims, leases and splits are shardgen's decisions, not the
engine's (the kill -9 of a real engine's job: test_failures)."""

from __future__ import annotations

import itertools
import json
import subprocess

import psutil
import pyarrow.parquet as pq
import pytest

from tests.conftest import make_rows, write_parquet
from tests.integration.workflow import (
    BIN,
    Background,
    generate_process,
    part_rows,
    progress_of,
    run_workflow,
    workflow_config,
)

pytestmark = pytest.mark.slurm


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
        shards={"rows_per_shard": 12, "workers": 2, "lease_seconds": 8, "tail": "none"},
        checkpoint={"rows": 2, "seconds": 300},
        sampling={"temperature": 0.0, "max_tokens": 16, "ignore_eos": True},
        # one CPU each: the node's two run both workers at once
        resources={"mem_mb": 6000, "cpus_per_task": 1, "runtime": 20},
        engine={"kind": "fake", "fake": {"tokens_per_second": 16}},  # a row a second: a shard 12 s
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


def test_an_idle_worker_splits_the_slowest_shard_and_every_row_is_run_once(tmp_path, slurm_cluster):
    """Shard 0 asks 20 times the output tokens of the others, which the plan cannot see (per row,
    through input.sampling_column): the worker that ran the light shards asks its holder for the rows
    it has not read, runs them as a piece of their own, and the merge holds every row once, in order,
    each run to its own max_tokens. Splits are shardgen's decisions, not the engine's: the fake engine
    (engine.kind: fake) generates at 20 tokens/s, which makes shard 0 about 32 s of generation."""
    rows = make_rows(48)
    # About 30 s of generation for shard 0 (a split needs more than split_seconds left, 3 s). The other
    # worker's engine may start much later than its holder's (vLLM's: 36 s later in one CI run, 82 s in
    # another, where shard 0 ended before anyone could ask): the holder is suspended once it has a rate,
    # until the other worker has committed shards 1 and 2
    for i, row in enumerate(rows):
        row["sampling"] = json.dumps({"max_tokens": 40 if i < 16 else 2})
    write_parquet(tmp_path / "data" / "in.parquet", rows)
    config = workflow_config(
        {"parquet": [str(tmp_path / "data" / "in.parquet")], "id_column": "id", "sampling_column": "sampling"},
        # a lease longer than the suspension (the other engine's start and two light shards)
        shards={"rows_per_shard": 16, "workers": 2, "lease_seconds": 300, "split_seconds": 3, "tail": "none"},
        prompt={"system": "Answer at length.", "template": "Write about {{ topic }}.", "order": "input"},
        checkpoint={"rows": 2, "seconds": 300},
        sampling={"temperature": 0.0, "max_tokens": 4, "ignore_eos": True},
        resources={"mem_mb": 6000, "cpus_per_task": 1, "runtime": 20},
        engine={"kind": "fake", "fake": {"tokens_per_second": 20}},
    )
    config["model"]["max_num_seqs"] = 1  # a shard's time is its rows' tokens, one row at a time
    out = tmp_path / "results"
    run = Background(tmp_path, config, "slurm", "--retries", "0")
    run.wait_until(lambda: progress_of(out, "00000").get("done", 0) >= 1, 600, "shard 0's first row")
    holder_job = progress_of(out, "00000")["job_id"]
    subprocess.run(["scontrol", "suspend", holder_job], check=True)
    try:
        light = [out / "shards" / f"{s}.parquet" for s in ("00001", "00002")]
        run.wait_until(lambda: all(p.exists() for p in light), 600, "shards 1 and 2, while shard 0's holder waits")
    finally:
        subprocess.run(["scontrol", "resume", holder_job], check=True)
    run.wait()

    cuts = sorted(int(p.name.split(".")[1]) for p in (out / "splits").glob("00000.*.cut"))
    assert cuts and all(0 < c < 16 for c in cuts), sorted(p.name for p in (out / "splits").iterdir())
    pieces = [f"00000-{c}" for c in cuts]
    assert sorted(p.stem for p in (out / "shards").glob("*.parquet")) == sorted(["00000", *pieces, "00001", "00002"])
    bounds = [0, *cuts, 16]
    for piece, (a, b) in zip(["00000", *pieces], itertools.pairwise(bounds), strict=True):
        stats = json.loads((out / "shards" / f"{piece}.stats.json").read_text())
        assert (stats["row_start"], stats["row_stop"], stats["attempt_requests"]) == (a, b, b - a), piece
    records = [json.loads((out / "shards" / "workers" / f"{w}.json").read_text()) for w in (0, 1)]
    holder = next(r for r in records if "00000" in r["committed"])
    thief = next(r for r in records if r is not holder)
    assert thief["splits_asked"] >= 1 and set(pieces) <= set(thief["committed"]) | set(holder["committed"])
    assert all(r["engine_starts"] == 1 for r in records), "a piece runs on the worker's running engine"

    table = pq.read_table(out / "output.parquet")
    assert table.column("id").to_pylist() == [r["id"] for r in rows], "every row exactly once, in order"
    assert table.column("generated_tokens").to_pylist() == [40] * 16 + [2] * 32, "each row to its own max_tokens"
    merged = json.loads((out / "stats.json").read_text())
    assert merged["rows"] == 48 and merged["num_shards"] == 3 + len(pieces)
    status = subprocess.run(
        [str(BIN / "shardgen"), "status", "--dir", str(out)], capture_output=True, text=True, check=True
    ).stdout
    assert "rows: 48 of 48 done (100.0%)" in status and f"shards: {3 + len(pieces)} done, 0 running" in status, status
