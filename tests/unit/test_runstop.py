"""A stop requested from another thread ends the run whatever the main thread does: the scheduler
is told through its executor-error callback, the run's jobs are cancelled until it has ended, and a
controller that does not end is ended. Snakemake's objects are stand-ins here; the real scheduler
and Slurm in tests/integration/test_run_stop.py."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from types import SimpleNamespace

import pytest

from shardgen.base.rundir import RunDir
from shardgen.commands import runstop
from shardgen.commands.runstop import RunStop, RunStopped


class Scheduler:
    def __init__(self) -> None:
        self.errors: list[Exception] = []

    def executor_error_callback(self, exception: Exception) -> None:
        self.errors.append(exception)


def make(tmp_path, cancel, **kwargs):
    unlocked, exits = [], []
    workflow = SimpleNamespace(scheduler=Scheduler(), persistence=SimpleNamespace(unlock=lambda: unlocked.append(1)))
    stop = RunStop(workflow, tmp_path, ["generate_shard"], record=RunDir(tmp_path).stopped,
                   cancel=cancel, exit=exits.append, poll_s=0.01, **kwargs)  # fmt: skip
    return stop, workflow.scheduler, unlocked, exits


def test_a_stop_tells_the_scheduler_once_cancels_the_jobs_and_records_why(tmp_path):
    queued = {"11", "12"}
    stop, scheduler, unlocked, exits = make(tmp_path, lambda workdir, rules: sorted(queued))
    threads = [threading.Thread(target=stop.request, args=(f"stop {i}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(scheduler.errors) == 1 and isinstance(scheduler.errors[0], RunStopped)
    reason = str(scheduler.errors[0])
    deadline = time.time() + 5
    while stop.cancelled != {"11", "12"} and time.time() < deadline:
        time.sleep(0.01)
    queued.add("13")  # submitted by a submission under way when the stop came
    stop.finish()  # the scheduler has returned
    stop.thread.join(5)
    assert not stop.thread.is_alive() and exits == [] and unlocked == []
    record = runstop.read_record(RunDir(tmp_path).stopped)
    assert record["reason"] == reason and record["cancelled_jobs"] == ["11", "12", "13"]


def test_a_controller_that_does_not_end_is_ended_with_its_jobs_cancelled_and_its_lock_released(tmp_path):
    cancels = []

    def cancel(workdir, rules):
        cancels.append(time.time())
        if len(cancels) == 1:
            raise OSError("squeue: timed out")  # a failing squeue does not stop the enforcement
        return ["21"]

    stop, _, unlocked, exits = make(tmp_path, cancel, grace_s=0.2)
    stop.request("the pending watcher's reason")
    stop.thread.join(5)
    assert exits == [1] and unlocked == [1]
    assert len(cancels) >= 3 and stop.cancelled == {"21"}
    assert json.loads(RunDir(tmp_path).stopped.read_text())["cancelled_jobs"] == ["21"]


def test_without_a_stop_the_end_cancels_nothing_and_a_new_run_clears_the_old_record(tmp_path):
    stop, _, _, exits = make(tmp_path, lambda workdir, rules: ["31"])
    stop.request("stopped")
    stop.finish()
    assert runstop.read_record(RunDir(tmp_path).stopped) is not None and exits == []
    again, scheduler, _, _ = make(tmp_path, lambda workdir, rules: pytest.fail("cancelled without a stop"))
    assert runstop.read_record(RunDir(tmp_path).stopped) is None
    again.finish()
    assert scheduler.errors == [] and not again.requested


def test_ctrl_c_is_a_stop_request_a_second_one_ends_the_controller_and_the_handler_ends_with_the_run(tmp_path):
    """SIGINT starts a request on a thread of its own (nothing is raised where the main thread is, so
    nothing there can absorb it); a second one cancels the jobs and ends the controller at once; once
    the run has ended (finish), SIGINT is what it was before."""
    stop, scheduler, unlocked, exits = make(tmp_path, lambda workdir, rules: ["11"], grace_s=600)
    before = signal.getsignal(signal.SIGINT)

    def wait_for(what) -> None:
        deadline = time.time() + 5
        while not what() and time.time() < deadline:
            time.sleep(0.01)

    try:
        stop.stop_on_interrupt()
        os.kill(os.getpid(), signal.SIGINT)
        wait_for(lambda: scheduler.errors)
        assert [str(e) for e in scheduler.errors] == [runstop.INTERRUPTED] and exits == []
        assert runstop.read_record(RunDir(tmp_path).stopped)["reason"] == runstop.INTERRUPTED
        os.kill(os.getpid(), signal.SIGINT)
        wait_for(lambda: exits)
        assert exits == [1] and unlocked == [1] and stop.cancelled == {"11"} and len(scheduler.errors) == 1
    finally:
        stop.finish()
        assert signal.getsignal(signal.SIGINT) is before
        signal.signal(signal.SIGINT, before)


def test_the_end_of_a_run_cancels_the_schedulers_pending_replan_timer(tmp_path):
    """Snakemake's scheduler leaves a timer of its job rate limit (a non-daemon threading.Timer, 1 s by
    default) that the process would wait for at its end: onsuccess and onerror cancel it."""
    fired = threading.Event()
    timer = threading.Timer(30, fired.set)  # as snakemake/scheduling/job_scheduler.py starts it
    timer.start()
    stop, _, _, _ = make(tmp_path, lambda workdir, rules: [])
    t = time.monotonic()
    stop.finish()
    timer.join(5)
    assert not timer.is_alive() and not fired.is_set() and time.monotonic() - t < 5
