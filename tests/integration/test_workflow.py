"""The whole workflow: real Parquet and datasets inputs, the real engine, the real Slurm."""

from __future__ import annotations

import json

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from tests.conftest import make_rows, write_parquet
from tests.integration.workflow import run_workflow, slurm_available, workflow_config

pytestmark = pytest.mark.engine

STATS_KEYS = {
    "rows",
    "errors",
    "prompt_tokens",
    "generated_tokens",
    "generation_seconds",
    "output_tokens_per_s",
    "requests_per_s",
    "ttft_p50_s",
    "ttft_p90_s",
    "prefix_cache_hit_rate",
    "gpu_hours",
    "shards",
}


def check_output(workdir, ids: list[str]) -> tuple:
    table = pq.read_table(workdir / "results" / "output.parquet")
    stats = json.loads((workdir / "results" / "stats.json").read_text())
    assert table.column("id").to_pylist() == ids, "every row exactly once, in input order"
    assert table.column("row_index").to_pylist() == list(range(len(ids)))
    assert all(g and g.strip() for g in table.column("generation").to_pylist())
    assert None not in table.column("finish_reason").to_pylist()
    assert STATS_KEYS <= set(stats)
    assert stats["rows"] == len(ids) and stats["errors"] == 0
    assert stats["generated_tokens"] == pc.sum(table.column("generated_tokens")).as_py()
    assert stats["generated_tokens"] == sum(s["generated_tokens"] for s in stats["shards"])
    assert stats["prompt_tokens"] == pc.sum(table.column("prompt_tokens")).as_py()
    assert stats["output_tokens_per_s"] > 0 and stats["ttft_p50_s"] > 0 and stats["gpu_hours"] > 0
    return table, stats


@pytest.mark.slurm
def test_slurm_profile_runs_one_gpu_job_per_shard_and_merges_every_row_once(tmp_path):
    if not slurm_available():
        pytest.fail("no Slurm cluster: run `make slurm` (scripts/slurm-up.sh) first")
    sizes, files, start = [12, 7, 11], [], 0
    for i, n in enumerate(sizes):
        files.append(str(write_parquet(tmp_path / "data" / f"part-{i}.parquet", make_rows(n, start))))
        start += n
    config = workflow_config({"parquet": [str(tmp_path / "data" / "*.parquet")], "id_column": "id"})
    r = run_workflow(tmp_path, config, "slurm")
    _, stats = check_output(tmp_path, [f"r{i:05d}" for i in range(30)])
    assert len(stats["shards"]) == 3
    for s in stats["shards"]:
        assert s["slurm"].get("job_id"), "each shard ran as a Slurm job"
        assert s["cuda_visible_devices"] == "0", "the job was given one (fake) GPU by the scheduler"
        assert s["gpus"] == 1
        assert "OMP_NUM_THREADS" in s["thread_env_removed"]
    assert len({s["slurm"]["job_id"] for s in stats["shards"]}) == 3
    assert "output: results/output.parquet" in r.stdout + r.stderr


def test_local_profile_runs_a_dataset_saved_with_save_to_disk(tmp_path):
    import datasets

    rows = make_rows(14)
    datasets.Dataset.from_list(rows).save_to_disk(tmp_path / "ds")
    config = workflow_config({"disk": str(tmp_path / "ds")})
    run_workflow(tmp_path, config, "local")
    _, stats = check_output(tmp_path, [r["id"] for r in rows])
    assert [s["rows"] for s in stats["shards"]] == [10, 4]
    # a second run finds everything up to date and runs nothing
    r = run_workflow(tmp_path, config, "local")
    assert "Nothing to be done" in r.stdout + r.stderr
    # nor does a change of resources, memory settings or checkpoint interval
    # (real runs: a dry run stops at the plan checkpoint once the config changed)
    shard_files = sorted((tmp_path / "results" / "shards").glob("*.parquet"))
    mtimes = [p.stat().st_mtime_ns for p in shard_files]
    config["resources"]["runtime"] = 90
    config["model"]["max_num_seqs"] = 8
    config["checkpoint"] = {"rows": 5, "seconds": 60}
    r = run_workflow(tmp_path, config, "local")
    assert "rule generate_shard:" not in r.stdout + r.stderr
    assert [p.stat().st_mtime_ns for p in shard_files] == mtimes
    # a change of one sampling key reruns every shard
    config["sampling"]["max_tokens"] = 5
    run_workflow(tmp_path, config, "local")
    table, rerun = check_output(tmp_path, [r["id"] for r in rows])
    assert rerun["config_fingerprint"] != stats["config_fingerprint"]
    assert [s["rows_generated"] for s in rerun["shards"]] == [10, 4]
    assert max(table.column("generated_tokens").to_pylist()) <= 5
