"""Jobs that die: kill -9, scancel, a Slurm time limit, an out-of-memory at engine start.

Each run has one shard whose rows finish a few at a time (``max_num_seqs``
small), so that it can be broken after some rows are saved and before all are.
"""

from __future__ import annotations

import json
import re
import subprocess

import psutil
import pyarrow.parquet as pq
import pytest

from tests.conftest import make_rows, write_parquet
from tests.integration.workflow import Background, part_rows, run_workflow, slurm_available, workflow_config

pytestmark = pytest.mark.engine


def one_shard_run(tmp_path, rows: int, **model):
    write_parquet(tmp_path / "data" / "in.parquet", make_rows(rows))
    config = workflow_config(
        {"parquet": [str(tmp_path / "data" / "in.parquet")], "id_column": "id"},
        shards={"rows_per_shard": rows},
        checkpoint={"rows": 4, "seconds": 300},
        sampling={"temperature": 0.0, "max_tokens": 24, "ignore_eos": True},
    )
    config["model"].update({"max_num_seqs": 4, **model})
    return config


def results(tmp_path, rows: int):
    table = pq.read_table(tmp_path / "results" / "output.parquet")
    # the shard's own stats (stats.json keeps a summary of each shard)
    shard = json.loads((tmp_path / "results" / "shards" / "00000.stats.json").read_text())
    assert table.column("id").to_pylist() == [f"r{i:05d}" for i in range(rows)], "every row exactly once, in order"
    assert table.column("error").null_count == rows
    assert not (tmp_path / "results" / "checkpoints" / "00000").exists()
    return table, shard


def checkpoints(tmp_path):
    return tmp_path / "results" / "checkpoints" / "00000"


def test_kill_9_of_a_generate_process_resumes_and_regenerates_only_unsaved_rows(tmp_path):
    rows = 60
    run = Background(tmp_path, one_shard_run(tmp_path, rows), "local")  # the local profile retries once
    run.wait_until(lambda: part_rows(checkpoints(tmp_path)) > 0, 300, "a checkpoint part")
    job = next(
        p
        for p in psutil.process_iter(["cmdline"])
        if "generate" in (p.info["cmdline"] or []) and any(a.endswith("shardgen") for a in p.info["cmdline"])
    )
    victims = [*job.children(recursive=True), job]
    for p in victims:  # what the OOM killer or a node failure does: no warning, no flush
        p.kill()
    saved = part_rows(checkpoints(tmp_path))
    assert 0 < saved < rows
    run.wait()
    _, shard = results(tmp_path, rows)
    assert shard["rows_resumed"] == saved, "every saved row was reused"
    assert shard["rows_generated"] == rows - saved, "only the unsaved rows were generated again"


def _running_job_ids() -> list[str]:
    out = subprocess.run(["squeue", "-h", "-t", "R", "-o", "%i"], capture_output=True, text=True).stdout
    return out.split()


def _job_states() -> dict[str, str]:
    out = subprocess.run(["squeue", "-h", "-t", "all", "-o", "%i %T"], capture_output=True, text=True).stdout
    return dict(line.split() for line in out.splitlines() if line.strip())


@pytest.mark.slurm
def test_scancel_of_a_running_shard_job_is_retried_and_completes_exactly_once(tmp_path):
    if not slurm_available():
        pytest.fail("no Slurm cluster: run `make slurm` first")
    rows = 60
    run = Background(tmp_path, one_shard_run(tmp_path, rows), "slurm")
    run.wait_until(lambda: part_rows(checkpoints(tmp_path)) > 0, 400, "a checkpoint part")
    (job_id,) = _running_job_ids()
    saved_before = part_rows(checkpoints(tmp_path))
    subprocess.run(["scancel", job_id], check=True)
    run.wait()
    _, shard = results(tmp_path, rows)
    assert shard["slurm"]["job_id"] != job_id, "a new job finished the shard"
    assert _job_states()[job_id] == "CANCELLED"
    # SIGTERM let the cancelled job save what it had finished
    assert shard["rows_resumed"] >= saved_before > 0
    assert shard["rows_generated"] == rows - shard["rows_resumed"]


@pytest.mark.slurm
def test_a_time_limit_too_short_for_the_first_attempt_is_retried_with_more_time(tmp_path):
    if not slurm_available():
        pytest.fail("no Slurm cluster: run `make slurm` first")
    rows = 240
    # About 55 s from job start to the first row and 2-3.5 rows/s here: far
    # past the first attempt's limit (Slurm enforces it within about 30 s);
    # the second (2 minutes) or the third (3) finishes the shard.
    config = one_shard_run(tmp_path, rows)
    config["resources"]["runtime"] = 1  # minutes; the retry gets 2, then 3
    run_workflow(tmp_path, config, "slurm")
    _, shard = results(tmp_path, rows)
    states = _job_states()
    assert "TIMEOUT" in states.values(), f"the first attempt hit its time limit: {states}"
    assert shard["rows_resumed"] > 0, "the timed-out attempt saved its finished rows"
    assert shard["rows_generated"] == rows - shard["rows_resumed"]
    # the log names the Slurm job of the attempt that finished
    log = (tmp_path / "results" / "logs" / "generate_shard" / "00000.log").read_text()
    assert re.search(rf"start on \S+, Slurm job {shard['slurm']['job_id']} ", log), log[:2000]


def test_an_out_of_memory_at_engine_start_is_retried_with_lower_settings(tmp_path):
    from shardgen.engine import fp8_kv_cache_supported

    # A KV cache too small for one 1024-token sequence in float32, large enough in FP8.
    rows = 8
    config = one_shard_run(tmp_path, rows, kv_cache_memory_bytes=16 * 1024 * 1024)
    if not fp8_kv_cache_supported("cpu"):
        # vLLM's CPU build has an FP8 KV cache only with AVX-512 or AMX: the
        # retry cannot turn it on here, halves the batch, fails again, and says what to do.
        r = run_workflow(tmp_path, config, "local", check=False)  # the local profile retries once
        assert r.returncode != 0
        failures = json.loads((checkpoints(tmp_path) / "memory_failures.json").read_text())
        assert [f["stage"] for f in failures] == ["engine start", "engine start"]
        assert failures[1]["settings"] == {"max_num_seqs": 2, "gpu_memory_utilization": 0.85, "kv_cache_dtype": None}
        log = (tmp_path / "results" / "logs" / "generate_shard" / "00000.log").read_text()
        assert "out of memory during engine start" in log and "lower model.max_model_len" in log
        return
    run_workflow(tmp_path, config, "local")  # the local profile retries once
    _, shard = results(tmp_path, rows)
    (failure,) = shard["memory_failures"]
    assert failure["stage"] == "engine start" and failure["settings"]["kv_cache_dtype"] is None
    assert shard["memory_overrides"] == {"max_num_seqs": 2, "gpu_memory_utilization": 0.85, "kv_cache_dtype": "fp8"}
    assert shard["engine"]["args"]["kv_cache_dtype"] == "fp8"
