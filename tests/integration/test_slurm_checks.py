"""Nothing waits silently on the real Slurm: a request no node can run is refused before any job is
submitted, and a job left pending for a reason that never resolves stops the run."""

from __future__ import annotations

import re
import subprocess
import time

import pyarrow.parquet as pq
import pytest

from shardgen import runstop
from shardgen.cluster import FINAL_STATES, PendingWatcher
from shardgen.rundir import RunDir
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


def test_the_controller_runs_as_a_slurm_job_and_submits_the_generate_jobs_from_inside_it(tmp_path, slurm_cluster):
    """For clusters that forbid long processes on login nodes: profiles/slurm/controller.sbatch runs
    the controller as a small Slurm job, which submits the generate job from inside it; the run ends
    with the merged output, and the controller's log is where the script says."""
    import yaml

    from tests.conftest import ROOT
    from tests.integration.workflow import SNAKEMAKE, snakemake_command

    config = one_shard(tmp_path, resources={"mem_mb": 4000, "cpus_per_task": 1, "runtime": 10})
    configfile = tmp_path / "config.yaml"
    configfile.write_text(yaml.safe_dump(config))
    cmd, env = snakemake_command(tmp_path, configfile, "--profile", str(ROOT / "profiles" / "slurm"),
                                 "--default-resources", "slurm_partition=debug")  # fmt: skip
    script = ROOT / "profiles" / "slurm" / "controller.sbatch"
    sbatch = ["sbatch", "--parsable", "--partition=debug", "--time=15", str(script), *cmd[len(SNAKEMAKE) :]]
    controller = subprocess.run(sbatch, cwd=tmp_path, env=env, capture_output=True, text=True, check=True).stdout
    controller = controller.strip()
    log = tmp_path / f"shardgen-controller-{controller}.log"
    deadline = time.time() + 480
    while (state := slurm_jobs(tmp_path).get(controller, "")) not in FINAL_STATES and time.time() < deadline:
        time.sleep(2)
    text = log.read_text() if log.exists() else "(no log)"
    if state not in FINAL_STATES:
        subprocess.run(["scancel", controller], check=False)
        raise AssertionError(f"the controller job {controller} ({state}) did not end within 480 s:\n{text[-5000:]}")
    assert state == "COMPLETED", f"{state}:\n{text[-5000:]}"
    assert f"shardgen controller: Slurm job {controller}" in text
    generate = re.findall(r"submitted with SLURM jobid (\d+)", text)
    assert len(generate) == 1 and generate[0] != controller, text[-3000:]
    assert pq.read_table(tmp_path / "results" / "output.parquet").num_rows == 4
