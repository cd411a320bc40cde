"""Nothing waits silently on the real Slurm: a request no node can run is refused before any job is
submitted, and a job left pending for a reason that never resolves stops the run."""

from __future__ import annotations

import subprocess
import time

import pytest

from shardgen.base.rundir import RunDir
from shardgen.cluster import PendingWatcher
from shardgen.commands import runstop
from tests.conftest import make_rows, write_parquet
from tests.integration.workflow import BIN, Background, run_workflow, slurm_jobs, workflow_config

pytestmark = pytest.mark.slurm


def node_cpus() -> int:
    return int(
        subprocess.run(["sinfo", "-h", "-o", "%c"], capture_output=True, text=True, check=True).stdout.split()[0]
    )


def one_shard(tmp_path, **sections):
    write_parquet(tmp_path / "data" / "in.parquet", make_rows(4))
    return workflow_config({"parquet": [str(tmp_path / "data" / "in.parquet")]}, **sections)


def test_more_cpus_than_the_node_has_is_refused_before_any_job_with_both_numbers(tmp_path, slurm_cluster):
    cpus = node_cpus()
    config = one_shard(tmp_path, resources={"mem_mb": 2000, "cpus_per_task": cpus + 62, "runtime": 10})
    r = run_workflow(tmp_path, config, "slurm", check=False)
    text = r.stdout + r.stderr
    assert r.returncode != 0
    assert f"asks for 1 GPU(s), {cpus + 62} CPUs" in text and f": {cpus} CPUs," in text and "short of CPUs" in text
    assert slurm_jobs(tmp_path) == {}, "nothing was submitted"
    assert not (tmp_path / "results" / "plan" / "manifest.json").exists(), "not even the local jobs ran"


def test_a_job_pending_with_partition_config_is_reported(tmp_path, slurm_cluster):
    """The watcher on a job submitted as the executor plugin submits one (its comment names the rule)."""
    job = subprocess.run(
        [
            "sbatch",
            "--parsable",
            f"--cpus-per-task={node_cpus() + 62}",
            "--comment",
            "rule_generate_shard_wildcards_00000",
            "-D",
            str(tmp_path),
            "--wrap",
            "true",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    try:
        stopped: list[str] = []
        watcher = PendingWatcher(str(tmp_path), stop=stopped.append)
        deadline = time.time() + 60
        while not stopped and time.time() < deadline:  # Slurm decides the reason at its next scheduling pass
            watcher.poll()
            time.sleep(1)
        assert len(stopped) == 1 and f"Slurm job {job} " in stopped[0] and "PartitionConfig" in stopped[0]
    finally:
        subprocess.run(["scancel", job])


def test_a_run_whose_job_can_never_start_stops_and_cancels_it_instead_of_waiting(tmp_path, slurm_cluster):
    """What the request check cannot see (here an sbatch option of the profile's slurm_extra that no
    node satisfies) leaves the job pending with PartitionConfig: the run stops with the reason, its
    job is cancelled and the controller has ended within a minute of the message."""
    config = one_shard(tmp_path)
    run = Background(tmp_path, config, "slurm", "--set-resources", "generate_shard:slurm_extra='--ntasks-per-node=64'")
    said = "is pending with the reason PartitionConfig"
    run.wait_until(lambda: said in run.output(), 240, "the watcher's message")  # it polls every 30 s
    told = time.time()
    with pytest.raises(AssertionError, match=said):  # the run fails, with the reason
        run.wait(60)
    assert time.time() - told < 60
    text = run.output()
    assert "Stopping the run; its jobs are cancelled" in text and "cancelled the run's Slurm job(s)" in text
    jobs = slurm_jobs(tmp_path)
    assert jobs and set(jobs.values()) == {"CANCELLED"}, jobs
    record = runstop.read_record(RunDir(tmp_path / "results").stopped)
    assert said in record["reason"] and record["cancelled_jobs"] == sorted(jobs)
    status = subprocess.run([str(BIN / "shardgen"), "status", "--dir", "results"], cwd=tmp_path, capture_output=True,
                            text=True).stdout  # fmt: skip
    assert f"stopped at {record['stopped']}: Slurm job {next(iter(jobs))} " in status, status
