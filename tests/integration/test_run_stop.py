"""A stop cannot be swallowed: wherever the controller is when the run is stopped, it ends, with an
error, soon, and leaves none of its Slurm jobs queued or running.

The stand-in workflow (``stopflow/Snakefile``) uses the real Slurm profile, executor plugin, scheduler
and ``shardgen.commands.runstop.RunStop``; its jobs only sleep, since the engine is not the point here. Each
moment is stopped ``REPEATS`` times (5 moments, 20 stops), two runs at a time."""

from __future__ import annotations

import datetime
import json
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import ROOT, SLURM_PARTITION
from tests.integration.workflow import BIN, run_bounded, slurm_jobs

pytestmark = pytest.mark.slurm

MOMENTS = ("submission", "status", "checkpoint", "running", "pending")
REPEATS = 4
# From the stop to the controller's exit: the scheduler's next loop, then the executor's shutdown,
# which waits out the status thread's sleep (2 s here).
STOPS_WITHIN_S = 20
# The wrapped sbatch and squeue make the trigger when the stand-in's moment is theirs, and answer late.
WRAPPER = """#!/bin/bash
if [ "$STOP_MOMENT" = {moment} ] && {when}; then touch "$STOP_TRIGGER"; sleep 3; fi
exec {real} "$@"
"""


def wrappers(bin_dir: Path) -> None:
    bin_dir.mkdir()
    for name, moment, when in (
        ("sbatch", "submission", "true"),
        # the plugin's status query (job_status_query.query_job_status_squeue), not the pending watcher's
        ("squeue", "status", '[[ " $* " == *" --states=all "* ]]'),
    ):
        real = subprocess.run(["which", name], capture_output=True, text=True, check=True).stdout.strip()
        (bin_dir / name).write_text(WRAPPER.format(moment=moment, when=when, real=real))
        (bin_dir / name).chmod(0o755)


def stop_once(workdir: Path, moment: str) -> None:
    workdir.mkdir()
    wrappers(workdir / "bin")
    trigger = workdir / "trigger"
    cmd = [
        str(BIN / "snakemake"),
        "--snakefile", str(ROOT / "tests" / "integration" / "stopflow" / "Snakefile"),
        "--profile", str(ROOT / "profiles" / "slurm"),
        "--default-resources", f"slurm_partition={SLURM_PARTITION}",
        # status queries soon and often, so that the 'status' moment comes within seconds
        "--slurm-init-seconds-before-status-checks", "1", "--seconds-between-status-checks", "2",
        "--config", f"moment={moment}", f"trigger={trigger}",
    ]  # fmt: skip
    env = {"PATH": f"{workdir / 'bin'}:{BIN}:/usr/bin:/bin", "STOP_MOMENT": moment, "STOP_TRIGGER": str(trigger)}
    r = run_bounded(cmd, 180, workdir, cwd=workdir, env=env)
    ended = time.time()
    text = r.stdout + r.stderr
    where = f"{moment} in {workdir}:\n{text[-4000:]}"
    assert r.returncode != 0, where
    said = "is pending with the reason PartitionConfig" if moment == "pending" else f"stand-in stop ({moment})"
    assert said in text.split("shardgen: error: ", 1)[-1], where
    assert "has not ended" not in text, f"the scheduler did not end by itself; {where}"
    record = json.loads((workdir / "logs" / "stopped.json").read_text())
    stopped = datetime.datetime.fromisoformat(record["stopped"]).timestamp()
    assert ended - stopped < STOPS_WITHIN_S, f"{ended - stopped:.0f} s from the stop to the exit; {where}"
    jobs = slurm_jobs(workdir)
    # A cancelled job that ran passes through COMPLETING: up to KillWait (30 s, scripts/slurm-up.sh)
    # from SIGTERM to SIGKILL, then the node's cleanup, slower under load (seen past 30 s in CI).
    deadline = time.time() + 90
    while any(state == "COMPLETING" for state in jobs.values()) and time.time() < deadline:
        time.sleep(0.5)
        jobs = slurm_jobs(workdir)
    if moment != "checkpoint":  # the others stop with a job submitted (pending, running, or being submitted)
        assert jobs, where
    # A job the test node failed to start (slurmd under load: Reason=JobLaunchFailure, seen once in CI)
    # ended by itself before the stop could cancel it; every other job was cancelled.
    launch_failed = {j for j, state in jobs.items() if state == "FAILED" and _launch_failed(j)}
    assert {s for j, s in jobs.items() if j not in launch_failed} <= {"CANCELLED"}, f"{jobs}; {where}"
    assert set(record["cancelled_jobs"]) <= set(jobs), where
    assert not any((workdir / ".snakemake" / "locks").glob("*")), f"Snakemake's lock was left; {where}"


def _launch_failed(job_id: str) -> bool:
    shown = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
    return "Reason=JobLaunchFailure" in shown


@pytest.mark.parametrize("moment", MOMENTS)
def test_a_stop_ends_the_run_and_cancels_its_jobs_wherever_the_controller_is(tmp_path, slurm_cluster, moment):
    with ThreadPoolExecutor(2) as pool:
        for done in [pool.submit(stop_once, tmp_path / f"run{i}", moment) for i in range(REPEATS)]:
            done.result()
