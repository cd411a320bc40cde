"""The Slurm executor plugin's own status check (``Executor.check_active_jobs`` of the installed
snakemake-executor-plugin-slurm), run against stand-ins of ``scontrol``, ``squeue`` and ``sacct``
on PATH: a check whose queries all fail loses the run's jobs without shardgen's guard, and keeps
them with it (shardgen.commands.statuscheck)."""

import asyncio
import logging
import textwrap
from types import SimpleNamespace

import pytest
from snakemake_executor_plugin_slurm import Executor
from snakemake_interface_executor_plugins.executors.base import SubmittedJobInfo

from shardgen.commands.statuscheck import keep_unseen_jobs


class FakeJob:
    """What the plugin reads of a Snakemake job in a status check: nothing but identity."""


class Checker(Executor):
    """The plugin's executor with only what ``check_active_jobs`` reads (no workflow, no thread),
    and the reports recorded instead of handed to a scheduler."""

    def __init__(self):  # not the plugin's, which starts a status thread
        self.workflow = SimpleNamespace(
            executor_settings=SimpleNamespace(
                status_command="squeue",
                status_attempts=2,
                init_seconds_before_status_checks=10,
                keep_successful_logs=True,
                requeue=False,
            ),
            remote_execution_settings=SimpleNamespace(seconds_between_status_checks=10),
        )
        self.logger = logging.getLogger("test-statuscheck")
        self.run_uuid = "run-1"
        self.status_rate_limiter = _NoLimit()
        self._next_seconds_between_status_checks = None
        self._preemption_warning = False
        self._failed_nodes = set()
        self._status_query_calls = self._status_query_failures = 0
        self._status_query_total_seconds = self._status_query_max_seconds = 0.0
        self._status_query_min_seconds = None
        self._status_query_cycle_rows = []
        self.reports = []

    def report_job_success(self, job_info):
        self.reports.append(("success", job_info.external_jobid))

    def report_job_error(self, job_info, msg=None, **kwargs):
        self.reports.append(("error", job_info.external_jobid))


class _NoLimit:
    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False


def _slurm(tmp_path, monkeypatch, *, scontrol_ok: bool, squeue: str | None):
    """Stand-ins for the Slurm commands the plugin runs: scontrol (MinJobAge 900 or failing), squeue
    (printing ``squeue`` or failing like a busy controller), sacct (failing as without accounting)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    scripts = {
        "scontrol": "echo 'MinJobAge               = 900 sec'" if scontrol_ok else "exit 1",
        "squeue": f"printf '{squeue}'" if squeue is not None else "echo 'Socket timed out' >&2; exit 1",
        "sacct": "echo 'Slurm accounting storage is disabled' >&2; exit 1",
    }
    for name, body in scripts.items():
        (bin_dir / name).write_text(textwrap.dedent(f"#!/bin/sh\n{body}\n"))
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")


def _check(checker, jobs) -> list[str]:
    async def run():
        return [j.external_jobid async for j in checker.check_active_jobs(jobs)]

    return asyncio.run(run())


def _jobs(*ids):
    return [SubmittedJobInfo(job=FakeJob(), external_jobid=i, aux={}) for i in ids]


@pytest.fixture
def guarded():
    cls = type("Guarded", (Checker,), {})
    stops = []
    now = [0.0]
    keep_unseen_jobs(cls, stops.append, give_up_s=600, clock=lambda: now[0])
    return cls, stops, now


def test_without_the_guard_the_plugin_drops_jobs_when_scontrol_fails_once(tmp_path, monkeypatch):
    """The defect the guard is for, in the installed plugin (if this fails, the plugin has changed)."""
    _slurm(tmp_path, monkeypatch, scontrol_ok=False, squeue="85|RUNNING\n")
    checker = Checker()
    assert _check(checker, _jobs("85")) == [] and checker.reports == []


def test_a_check_that_cannot_see_a_job_keeps_it_and_warns_once(tmp_path, monkeypatch, guarded, caplog):
    cls, stops, now = guarded
    _slurm(tmp_path, monkeypatch, scontrol_ok=False, squeue="85|RUNNING\n")
    checker = cls()
    jobs = _jobs("85", "86")
    with caplog.at_level(logging.WARNING, logger="test-statuscheck"):
        assert _check(checker, jobs) == ["85", "86"]
        now[0] = 60
        assert _check(checker, jobs) == ["85", "86"]
    assert [r.message for r in caplog.records if "status query failed" in r.message] != []
    assert len(caplog.records) == 1, "one warning per spell of failed checks"
    assert stops == [] and checker.reports == []


def test_jobs_seen_again_are_reported_and_only_the_unseen_kept(tmp_path, monkeypatch, guarded):
    cls, stops, _ = guarded
    _slurm(tmp_path, monkeypatch, scontrol_ok=True, squeue="85|COMPLETED\n86|TIMEOUT\n87|RUNNING\n")
    checker = cls()
    assert _check(checker, _jobs("85", "86", "87", "88")) == ["87", "88"]
    assert checker.reports == [("success", "85"), ("error", "86")] and stops == []


def test_queries_failing_past_the_bound_stop_the_run_once_naming_why(tmp_path, monkeypatch, guarded):
    cls, stops, now = guarded
    _slurm(tmp_path, monkeypatch, scontrol_ok=True, squeue=None)
    checker = cls()
    jobs = _jobs("85")
    for t in (0, 300, 599):
        now[0] = t
        assert _check(checker, jobs) == ["85"]
    assert stops == []
    for t in (600, 700):
        now[0] = t
        assert _check(checker, jobs) == ["85"]
    assert len(stops) == 1 and "has failed for 10 min" in stops[0] and "(85)" in stops[0]
    # a check that sees the job again ends the spell: a later failure starts a new one
    _slurm(tmp_path / "ok", monkeypatch, scontrol_ok=True, squeue="85|RUNNING\n")
    now[0] = 800
    assert _check(checker, jobs) == ["85"] and checker.__dict__["_shardgen_failing"] == {}


def test_the_guard_wraps_a_class_once_and_a_later_run_gets_its_own_stop(tmp_path, monkeypatch, guarded):
    cls, first, _ = guarded
    wrapped = cls.check_active_jobs
    second = []
    keep_unseen_jobs(cls, second.append, give_up_s=0)
    assert cls.check_active_jobs is wrapped
    _slurm(tmp_path, monkeypatch, scontrol_ok=True, squeue=None)
    checker = cls()
    jobs = _jobs("85")
    assert _check(checker, jobs) == ["85"] and _check(checker, jobs) == ["85"]
    assert first == [] and len(second) == 1
