"""Running the real workflow (snakemake, a profile, the real engine) from tests."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import pyarrow.parquet as pq
import yaml

from shardgen.cluster import FINAL_STATES
from tests.conftest import ROOT, SLURM_PARTITION, TEST_MODEL_CFG

BIN = Path(sys.executable).parent
# The longest a workflow run of the suite may take before it is taken for hung: its processes' stacks
# are dumped and it is killed. The slowest run here (the two-node test's) takes under 5 minutes on a
# 2-core machine with AVX-512 beside the other process of `make test`, and may take 2.5 times that on
# an AVX2-only one.
RUN_BOUND_S = 900.0
# snakemake, polling Slurm every few seconds (snakemake_polled.py says why)
SNAKEMAKE = [sys.executable, str(Path(__file__).with_name("snakemake_polled.py"))]


def stacks(pid: int, workdir: Path | None = None) -> str:
    """The Python stacks (py-spy) of process ``pid``, its descendants, and the processes working in
    ``workdir`` (a run's Slurm jobs, which are not its children): what a hung run was doing."""
    procs: dict[int, psutil.Process] = {}
    try:
        top = psutil.Process(pid)
        procs = {p.pid: p for p in [top, *top.children(recursive=True)]}
    except psutil.Error:
        pass
    if workdir is not None:
        for p in psutil.process_iter(["cwd"]):
            if p.info["cwd"] == str(workdir):
                procs.setdefault(p.pid, p)
    out = []
    for p in procs.values():
        try:
            cmd = " ".join(p.cmdline())[:300]
        except psutil.Error:
            continue
        if "python" not in cmd and "snakemake" not in cmd and "shardgen" not in cmd:
            out.append(f"--- {p.pid}: {cmd}")
            continue
        try:
            r = subprocess.run([str(BIN / "py-spy"), "dump", "--pid", str(p.pid)], capture_output=True, text=True,
                               timeout=60)  # fmt: skip
            dump = r.stdout + r.stderr
        except (OSError, subprocess.SubprocessError) as e:
            dump = f"py-spy failed: {e}"
        out.append(f"--- {p.pid}: {cmd}\n{dump}")
    return "\n".join(out)


def slurm_jobs(workdir: Path) -> dict[str, str]:
    """Slurm job id -> state, of every job submitted from ``workdir`` that squeue still shows."""
    out = subprocess.run(["squeue", "--me", "-h", "-t", "all", "-o", "%i|%T|%Z"], capture_output=True, text=True)
    return {i: state for i, state, wd in (line.split("|") for line in out.stdout.splitlines()) if wd == str(workdir)}


def end_hung(proc: subprocess.Popen, workdir: Path | None, bound: float, output: str = "") -> AssertionError:
    """A run that outlived its bound: its stacks, then it is killed with its children and its Slurm jobs."""
    dump = stacks(proc.pid, workdir)
    # every job on the cluster (a job of something else may hold the node: a CI run once waited 9 minutes
    # behind another run's job): state, time used and limit, reason, directory
    queue = subprocess.run(["squeue", "-h", "-t", "all", "-o", "%i %T %M/%l %R %Z"], capture_output=True, text=True)
    try:
        victims = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        victims = []
    for p in victims:
        try:
            p.kill()
        except psutil.Error:
            pass
    proc.kill()
    proc.wait()
    jobs = slurm_jobs(workdir) if workdir is not None else {}
    ids = [i for i, state in jobs.items() if state not in FINAL_STATES]
    if ids:  # its Slurm jobs, so that the next test's do not wait behind them
        subprocess.run(["scancel", *ids])
    return AssertionError(
        f"{' '.join(map(str, proc.args))[:300]} did not end within {bound:.0f} s; its Slurm jobs then: {jobs}; "
        f"the cluster's queue:\n{queue.stdout[-3000:]}\nthe stacks of its processes (py-spy):\n{dump}\n"
        f"--- its output:\n{output[-5000:]}"
    )


def run_bounded(
    cmd: list[str], bound: float = RUN_BOUND_S, workdir: Path | None = None, **popen: object
) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)``, but a command still running after
    ``bound`` seconds fails the test with the stacks of its processes (``end_hung``)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, **popen)
        try:
            rc = proc.wait(bound)
        except subprocess.TimeoutExpired:
            out.seek(0)
            err.seek(0)
            raise end_hung(proc, workdir, bound, out.read() + err.read()) from None
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(cmd, rc, out.read(), err.read())


def workflow_config(inputs: dict[str, Any], **sections: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "input": inputs,
        "shards": {"rows_per_shard": 10},
        "prompt": {"system": "Answer in one short sentence.", "template": "What is {{ topic }}?"},
        "model": dict(TEST_MODEL_CFG),
        "sampling": {"temperature": 0.0, "max_tokens": 8},
        "resources": {"mem_mb": 6000, "cpus_per_task": 2, "runtime": 20},
        # the rows repeat 8 topics: what these runs count is the engine's work on every row (the request
        # store has runs of its own, which pass `cache`)
        "cache": {"enabled": False},
    }
    config.update(sections)
    return config


def snakemake_command(
    workdir: Path, configfile: Path, *options: str, snakefile: Path = ROOT / "Snakefile"
) -> tuple[list[str], dict[str, str]]:
    """``snakemake`` on the project's Snakefile (or ``snakefile``) in ``workdir``, and an environment with
    the venv's tools on PATH."""
    cmd = [
        *SNAKEMAKE,
        "--snakefile",
        str(snakefile),
        "--directory",
        str(workdir),
        *options,
        "--configfile",
        str(configfile),
    ]
    return cmd, dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}")


def _command(
    workdir: Path, config: dict[str, Any], profile: str, args: tuple[str, ...], snakefile: Path = ROOT / "Snakefile"
) -> tuple[list[str], dict]:
    configfile = workdir / "config.yaml"
    configfile.write_text(yaml.safe_dump(config))
    cmd, env = snakemake_command(
        workdir,
        configfile,
        "--profile",
        str(ROOT / "profiles" / profile),
        # the test cluster's partition, for the profile's SET_ME placeholder
        *(["--default-resources", f"slurm_partition={SLURM_PARTITION}"] if profile == "slurm" else []),
        snakefile=snakefile,
    )
    return cmd + list(args), env


def _failure(workdir: Path, rc: int, stdout: str, stderr: str) -> AssertionError:
    logs = "\n".join(f"--- {p}\n{p.read_text()[-3000:]}" for p in sorted(workdir.glob("results/**/logs/**/*.log")))
    return AssertionError(f"snakemake failed ({rc}):\n{stdout[-4000:]}\n{stderr[-6000:]}\n{logs}")


def run_workflow(
    workdir: Path,
    config: dict[str, Any],
    profile: str,
    *args: str,
    check: bool = True,
    bound: float = RUN_BOUND_S,
    snakefile: Path = ROOT / "Snakefile",
) -> subprocess.CompletedProcess:
    """``snakemake --profile profiles/<profile> --configfile <config>`` in ``workdir``, for at most ``bound`` s."""
    cmd, env = _command(workdir, config, profile, args, snakefile)
    r = run_bounded(cmd, bound, workdir, cwd=workdir, env=env)
    if check and r.returncode != 0:
        raise _failure(workdir, r.returncode, r.stdout, r.stderr)
    return r


def controller_job(workdir: Path, config: dict[str, Any], bound: float = 480) -> tuple[str, str]:
    """The run as the README's controller job (profiles/slurm/controller.sbatch: the controller is a
    small Slurm job that submits the generate jobs from inside it), to its end: its Slurm job id and
    its log. Fails unless it ended COMPLETED within ``bound`` s (then cancelled)."""
    cmd, env = _command(workdir, config, "slurm", ())
    script = ROOT / "profiles" / "slurm" / "controller.sbatch"
    sbatch = ["sbatch", "--parsable", f"--partition={SLURM_PARTITION}", "--time=15", str(script),
              *cmd[len(SNAKEMAKE) :]]  # fmt: skip
    job = subprocess.run(sbatch, cwd=workdir, env=env, capture_output=True, text=True, check=True).stdout.strip()
    log = workdir / f"shardgen-controller-{job}.log"
    deadline = time.time() + bound
    while (state := slurm_jobs(workdir).get(job, "")) not in FINAL_STATES and time.time() < deadline:
        time.sleep(2)
    text = log.read_text() if log.exists() else "(no log)"
    if state not in FINAL_STATES:
        subprocess.run(["scancel", job], check=False)
        raise AssertionError(f"the controller job {job} ({state}) did not end within {bound:g} s:\n{text[-5000:]}")
    assert state == "COMPLETED", f"{state}:\n{text[-5000:]}\n{_failure(workdir, 0, '', '')}"
    assert f"shardgen controller: Slurm job {job}" in text, text[:2000]
    return job, text


def dry_run_jobs(workdir: Path, config: dict[str, Any], profile: str = "local") -> dict[str, int]:
    """The jobs ``snakemake -n`` lists for ``config``, by rule (from its "Job stats" table)."""
    r = run_workflow(workdir, config, profile, "-n")
    text = r.stdout + r.stderr
    if "Nothing to be done" in text:
        return {}
    table = text.split("Job stats:", 1)[1].split("total", 1)[0]
    jobs = {}
    for line in table.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            jobs[parts[0]] = int(parts[1])
    return jobs


class Background:
    """A workflow run in the background, for tests that break it while it runs."""

    def __init__(self, workdir: Path, config: dict[str, Any], profile: str, *args: str) -> None:
        cmd, env = _command(workdir, config, profile, args)
        self.workdir = workdir
        self.out = open(workdir / "snakemake.out", "w+")  # closed in wait()
        self.proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=self.out, stderr=subprocess.STDOUT)

    def wait_until(self, predicate, timeout: float, what: str) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if predicate():
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"the workflow ended before {what}:\n{self.output()[-5000:]}")
            time.sleep(0.2)
        raise end_hung(self.proc, self.workdir, timeout, f"(waiting for {what})\n{self.output()}")

    def output(self) -> str:
        if not self.out.closed:
            self.out.flush()
        return (self.workdir / "snakemake.out").read_text()

    def wait(self, timeout: float = RUN_BOUND_S) -> str:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise end_hung(self.proc, self.workdir, timeout, self.output()) from None
        text = self.output()
        self.out.close()
        if rc != 0:
            raise _failure(self.workdir, rc, text, "")
        return text


def progress_of(out: Path, shard: str) -> dict[str, Any]:
    """What the shard's running attempt last reported (``progress.json``: rows done and saved, its Slurm
    job), or nothing yet."""
    try:
        return json.loads((out / "checkpoints" / shard / "progress.json").read_text())
    except (OSError, ValueError):
        return {}


def part_rows(checkpoint_dir: Path) -> int:
    """Rows in the checkpoint parts of a shard. Parts are written under a temporary name and renamed
    whole, so a part that cannot be read is a failure of the atomic write, not a part in progress."""
    return sum(pq.read_metadata(part).num_rows for part in checkpoint_dir.glob("part-[0-9]*.parquet"))


def generate_process(workdir: Path, *args: str) -> psutil.Process:
    """The run's ``shardgen generate`` process: the one working in ``workdir`` (not one of another
    test's run, or one a killed run left behind), whose command line holds ``args`` one after the other."""
    n = len(args)
    for p in psutil.process_iter(["cmdline", "cwd"]):
        cmd = p.info["cmdline"] or []
        if (
            p.info["cwd"] == str(workdir)
            and "generate" in cmd
            and any(a.endswith("shardgen") for a in cmd)
            and (not args or any(tuple(cmd[i : i + n]) == args for i in range(len(cmd))))
        ):
            return p
    raise AssertionError(f"no shardgen generate process works in {workdir} with {args}")


def finished_shards(text: str, rule: str) -> set[str]:
    """The shards whose ``rule`` jobs Snakemake saw finish, from its output (a job whose end it did
    not see yet is incomplete to it: a rerun removes that job's outputs and runs it again)."""
    shards = {}
    for block in re.finditer(rf"^(?:local)?rule {rule}:\n((?: {{4}}.*\n)+)", text, re.M):
        job, shard = re.search(r"jobid: (\d+)", block.group(1)), re.search(r"wildcards: shard=(\d+)", block.group(1))
        if job and shard:
            shards[job.group(1)] = shard.group(1)
    return {shards[j] for j in re.findall(rf"Finished jobid: (\d+) \(Rule: {rule}\)", text) if j in shards}
