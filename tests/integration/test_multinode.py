"""One engine across two Slurm nodes: the local Slurm's partition twonodes is two slurmd daemons
on this machine (scripts/slurm-up.sh), and vLLM's CPU build runs the demo model with one pipeline
stage on each (tensor parallel 1 per node: see shardgen.engines.multinode and docs/dev/vllm-multinode.md)."""

from __future__ import annotations

import datetime
import json
import signal

import psutil
import pyarrow.parquet as pq
import pytest

from tests.conftest import make_rows, write_parquet
from tests.integration.workflow import Background, part_rows, workflow_config

pytestmark = [pytest.mark.slurm, pytest.mark.engine]


def engine_worker_processes() -> list[psutil.Process]:
    """The headless executors (``shardgen engine-worker``) the second node runs, with their children;
    not the first node's ``srun`` that started them, which sees them die."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmdline = p.info["cmdline"] or []
        if "engine-worker" in cmdline and not cmdline[0].endswith("srun"):
            found += [*p.children(recursive=True), p]
    return found


def test_a_model_across_two_nodes_generates_every_row_once_and_a_dead_worker_node_fails_the_job_and_the_retry_resumes(
    tmp_path, slurm_cluster
):
    rows = 16
    data = write_parquet(tmp_path / "data" / "part-0.parquet", make_rows(rows))
    config = workflow_config(
        {"parquet": [str(data)], "id_column": "id"},
        shards={"rows_per_shard": rows},
        model={**workflow_config({})["model"], "pipeline_parallel_size": 2, "max_num_seqs": 2},
        resources={"mem_mb": 4000, "cpus_per_task": 2, "runtime": 20, "nodes": 2},
        checkpoint={"rows": 2, "seconds": 300},
    )
    run = Background(tmp_path, config, "slurm", "--default-resources", "slurm_partition=twonodes")
    ckpt = tmp_path / "results" / "checkpoints" / "00000"
    run.wait_until(lambda: ckpt.exists() and part_rows(ckpt) >= 2, 900, "rows saved by the engine over two nodes")
    killed = engine_worker_processes()
    assert killed, "the second node runs the engine's workers"
    killed_at = datetime.datetime.now(datetime.UTC)
    for p in killed:  # the second node dies: its executor and its worker, at once
        p.send_signal(signal.SIGKILL)
    text = run.wait()

    table = pq.read_table(tmp_path / "results" / "output.parquet")
    assert table.column("id").to_pylist() == [f"r{i:05d}" for i in range(rows)], "every row exactly once"
    assert all(g and g.strip() for g in table.column("generation").to_pylist())
    stats = json.loads((tmp_path / "results" / "shards" / "00000.stats.json").read_text())
    first, second = stats["attempts"]
    assert first["outcome"] == "workers_lost" and "ended (srun exit status" in first["error"], first
    # the head stopped its engine when the workers died, not after vLLM's RPC timeout (300 s)
    ended = datetime.datetime.fromisoformat(first["ended"])
    assert (ended - killed_at).total_seconds() < 120, (killed_at, first["ended"])
    assert first["rows_saved"] >= 2 and second["outcome"] == "committed"
    assert first["slurm"]["job_id"] != second["slurm"]["job_id"], "Snakemake retried the failed job"
    assert stats["rows_resumed"] == first["rows_saved"] and stats["rows_generated"] == rows - first["rows_saved"]
    assert stats["nodes"] == 2 and len(stats["node_names"]) == 2 and stats["gpus"] == 2
    assert sorted(stats["node_gpus"]) == sorted(stats["node_names"]), "each node reported its GPUs"
    assert stats["engine"]["args"]["pipeline_parallel_size"] == 2
    assert "output: results/output.parquet" in text
