"""Running the real workflow (snakemake, a profile, the real engine) from tests."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pyarrow.parquet as pq
import yaml

from tests.conftest import ROOT, TEST_MODEL_CFG

BIN = Path(sys.executable).parent


def workflow_config(inputs: dict[str, Any], **sections: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "input": inputs,
        "shards": {"rows_per_shard": 10},
        "prompt": {"system": "Answer in one short sentence.", "template": "What is {{ topic }}?"},
        "model": dict(TEST_MODEL_CFG),
        "sampling": {"temperature": 0.0, "max_tokens": 8},
        "resources": {"mem_mb": 6000, "cpus_per_task": 2, "runtime": 20},
    }
    config.update(sections)
    return config


def snakemake_command(workdir: Path, configfile: Path, *options: str) -> tuple[list[str], dict[str, str]]:
    """``snakemake`` on the project's Snakefile in ``workdir``, and an environment with the venv's tools on PATH."""
    cmd = [
        str(BIN / "snakemake"),
        "--snakefile",
        str(ROOT / "Snakefile"),
        "--directory",
        str(workdir),
        *options,
        "--configfile",
        str(configfile),
    ]
    return cmd, dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}")


def _command(workdir: Path, config: dict[str, Any], profile: str, args: tuple[str, ...]) -> tuple[list[str], dict]:
    configfile = workdir / "config.yaml"
    configfile.write_text(yaml.safe_dump(config))
    cmd, env = snakemake_command(
        workdir,
        configfile,
        "--profile",
        str(ROOT / "profiles" / profile),
        # the test cluster's partition, for the profile's SET_ME placeholder
        *(["--default-resources", "slurm_partition=debug"] if profile == "slurm" else []),
    )
    return cmd + list(args), env


def _failure(workdir: Path, rc: int, stdout: str, stderr: str) -> AssertionError:
    logs = "\n".join(f"--- {p}\n{p.read_text()[-3000:]}" for p in sorted(workdir.glob("results/logs/**/*.log")))
    return AssertionError(f"snakemake failed ({rc}):\n{stdout[-4000:]}\n{stderr[-6000:]}\n{logs}")


def run_workflow(
    workdir: Path, config: dict[str, Any], profile: str, *args: str, check: bool = True
) -> subprocess.CompletedProcess:
    """``snakemake --profile profiles/<profile> --configfile <config>`` in ``workdir``."""
    cmd, env = _command(workdir, config, profile, args)
    r = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=1500)
    if check and r.returncode != 0:
        raise _failure(workdir, r.returncode, r.stdout, r.stderr)
    return r


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
        self.proc.kill()
        raise AssertionError(f"timed out waiting for {what}:\n{self.output()[-5000:]}")

    def output(self) -> str:
        self.out.flush()
        return (self.workdir / "snakemake.out").read_text()

    def wait(self, timeout: float = 1500) -> str:
        rc = self.proc.wait(timeout=timeout)
        text = self.output()
        self.out.close()
        if rc != 0:
            raise _failure(self.workdir, rc, text, "")
        return text


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
