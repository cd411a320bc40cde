"""Stopping a running workflow from another thread, in a way nothing can swallow.

The pending watcher (``cluster.PendingWatcher``) runs on a thread of the
controller. It used to stop the run by sending SIGINT to its own process and
relied on Snakemake turning it into a ``KeyboardInterrupt`` that reaches the
scheduler's ``except (KeyboardInterrupt, SystemExit)``, which cancels the
jobs. Where the signal landed decided whether that happened: the main thread
runs code that catches the interrupt itself (a checkpoint's re-evaluation, a
job's callbacks, the executor's event loop), and then the scheduler went back
to waiting on its semaphore for a job that, pending for ever, never finished
(seen in CI: the controller waited 13 minutes beside a PENDING job).

``RunStop.request`` takes no part of that path. Each step is a state change that
stays until it is read, so it does not matter where the main thread is:

1. the reason is logged and recorded in ``<output.dir>/logs/stopped.json``;
2. the scheduler is told through ``executor_error_callback``, the callback
   Snakemake hands its executors for exactly this (its remote executors call
   it from their status thread, ``RemoteExecutor._wait_thread``). It sets an
   error under the scheduler's lock and releases the semaphore the scheduler
   waits on: the next time the scheduler loops, whatever it did meanwhile, it
   finds the error before it selects a job, shuts the executor down and
   returns; Snakemake then runs ``onerror`` and exits with an error;
3. this thread cancels the run's Slurm jobs itself, by job id (found with
   ``squeue`` by the working directory they were submitted from and the
   rule named in their comment, as the executor plugin sets it), at once and
   again every ``POLL_S`` until the scheduler has ended: a job submitted by
   a submission that was already under way when the stop came is cancelled
   too, and ``finish`` (``onerror``, on the main thread once no job can be
   submitted any more) cancels whatever is left;
4. a controller still alive ``GRACE_S`` after the request (the executor's
   shutdown waiting out a long status-check sleep, or the main thread stuck
   in something that does not return) is ended here: its jobs cancelled once
   more, logs flushed, Snakemake's lock released, ``os._exit(1)``.

Ctrl-C (SIGINT) is such a stop too (``stop_on_interrupt``). As a
``KeyboardInterrupt`` it could be lost the same way: seen here, a run
interrupted just after a job ended went on to its end. Where it landed is
not known; one such place is a coroutine Snakemake runs with ``asyncio.run``
(there asyncio turns SIGINT into the task's cancellation, which the code it
interrupts may absorb). The handler only starts a thread that calls
``request``; a second Ctrl-C ends the controller at once, as step 4 does.
The handler is the run's only (``finish`` puts the earlier one back).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from shardgen import cluster
from shardgen.base.io import atomic_write_text
from shardgen.errors import ShardgenError

log = logging.getLogger(__name__)

# How long a stopped controller may take to end by Snakemake's own path: the scheduler's next loop,
# then the executor's shutdown, which waits out the status thread's sleep. The Slurm plugin lengthens
# that sleep by 10 s after each check in which no job ended, up to 180 s, so after a long wait this
# bound, not the sleep, ends the controller: within a minute of the stop, as the README says.
GRACE_S = 50.0
# How often the run's jobs are looked for and cancelled until the scheduler has ended.
POLL_S = 2.0
# Why a run stopped by Ctrl-C stopped.
INTERRUPTED = (
    "interrupted (SIGINT, Ctrl-C): stopping the run and cancelling its Slurm jobs; what they committed is "
    "kept, and running the workflow again goes on from there (Ctrl-C again ends the controller at once)"
)


class RunStopped(ShardgenError):
    """The run was stopped on purpose (the error Snakemake's scheduler is given)."""


class RunStop:
    """Stops one workflow run; ``request`` may be called from any thread, any number of times.

    Args:
        workflow: Snakemake's ``workflow`` object of the running controller (its ``scheduler`` and
            ``persistence`` are used).
        workdir: where the run's jobs were submitted from (the controller's working directory).
        rules: the workflow's rule names; a job whose comment names one of them is the run's.
        record: where the reason is written, as JSON (None: nowhere).
        logger: where the stop is told (the controller's own log: Snakemake's logger).
    """

    def __init__(
        self,
        workflow: Any,
        workdir: str | Path,
        rules: Iterable[str],
        record: str | Path | None = None,
        grace_s: float = GRACE_S,
        poll_s: float = POLL_S,
        cancel: Callable[[str, Iterable[str]], list[str]] = cluster.cancel_run_jobs,
        exit: Callable[[int], None] = os._exit,
        logger: logging.Logger = log,
    ) -> None:
        self._workflow = workflow
        self.workdir = str(Path(workdir).absolute())
        self.rules = tuple(rules)
        self.record = Path(record) if record else None
        self.grace_s = grace_s
        self.poll_s = poll_s
        self._cancel = cancel
        self._exit = exit
        self.log = logger
        self.reason: str | None = None
        self.cancelled: set[str] = set()
        self._lock = threading.Lock()
        self._ended = threading.Event()  # the scheduler has returned (finish was called)
        self._sigint: Any = None  # the SIGINT handler before stop_on_interrupt's
        self.thread: threading.Thread | None = None
        if self.record is not None:
            self.record.unlink(missing_ok=True)  # an earlier run's

    @property
    def requested(self) -> bool:
        return self.reason is not None

    def request(self, message: str) -> None:
        """Stop the run: see the module's docstring for why this cannot be lost. Returns at once."""
        with self._lock:
            if self.reason is not None:
                return
            self.reason = message
        self.log.error(f"shardgen: error: {message}")
        self._write_record()
        self._workflow.scheduler.executor_error_callback(RunStopped(message))
        self.thread = threading.Thread(target=self._enforce, name="shardgen-run-stop", daemon=True)
        self.thread.start()

    def stop_on_interrupt(self) -> None:
        """Make Ctrl-C (SIGINT) a ``request``, and a second one the end at once; from the main thread
        (Snakemake's ``onstart``: elsewhere, as when Snakemake runs on a thread, nothing changes)."""

        def interrupted(signum: int, frame: Any) -> None:
            if self.requested:
                target, args = self._end_now, ("Ctrl-C again",)
            else:
                target, args = self.request, (INTERRUPTED,)
            threading.Thread(target=target, args=args, name="shardgen-interrupt", daemon=True).start()

        try:
            previous = signal.signal(signal.SIGINT, interrupted)
        except ValueError:  # not the main thread
            return
        self._sigint = signal.default_int_handler if previous is None else previous

    def finish(self) -> None:
        """Once the scheduler has returned (``onerror``/``onsuccess``): after a stop, cancel what is left
        of the run's jobs; nothing can be submitted any more.

        Snakemake's scheduler plans again when a timer of its job rate limit fires (a
        ``threading.Timer`` of ``--max-jobs-per-timespan``'s span, 1 s by default:
        snakemake/scheduling/job_scheduler.py, ``_schedule_reevalutation``); the last one, not a
        daemon, would hold the end of the process for up to that span (1 s of a one-minute run,
        bench/overhead.py), with nothing left to plan. They are cancelled here.
        """
        for thread in threading.enumerate():
            if isinstance(thread, threading.Timer):
                thread.cancel()
        if self._sigint is not None:  # a Ctrl-C from now on is no stop of this run's
            try:
                signal.signal(signal.SIGINT, self._sigint)
            except ValueError:
                pass
            self._sigint = None
        if self.requested:
            self._cancel_jobs()
            self._write_record()
        self._ended.set()

    def _enforce(self) -> None:
        deadline = time.monotonic() + self.grace_s
        while True:
            self._cancel_jobs()
            if self._ended.wait(self.poll_s):
                return
            if time.monotonic() >= deadline:
                break
        self._end_now(f"Snakemake has not ended {self.grace_s:.0f} s after the stop (its Slurm executor can wait "
                      "up to 3 min between status checks)")  # fmt: skip

    def _end_now(self, why: str) -> None:
        """Cancel the run's jobs, release Snakemake's lock and end the controller."""
        self._cancel_jobs()
        self._write_record()
        # f-strings: Snakemake's logger, which the controller passes, does not format arguments
        self.log.error(
            f"shardgen: error: {why}; the run's Slurm jobs are cancelled "
            f"({', '.join(sorted(self.cancelled)) or 'none'}); ending it now"
        )
        _flush_logs(self.log)
        try:
            self._workflow.persistence.unlock()  # else the next run must be started with --unlock
        except Exception as e:  # noqa: BLE001 - the exit must happen whatever this does
            self.log.warning(f"shardgen: could not release Snakemake's lock: {e}")
        _flush_logs(self.log)
        self._exit(1)

    def _cancel_jobs(self) -> None:
        try:
            cancelled = self._cancel(self.workdir, self.rules)
        except Exception as e:  # noqa: BLE001 - squeue/scancel failing must not end the enforcement
            self.log.warning(f"shardgen: cancelling the run's Slurm jobs failed: {e}")
            return
        new = set(cancelled) - self.cancelled
        if new:
            self.log.error(f"shardgen: cancelled the run's Slurm job(s) {', '.join(sorted(new))}")
            self.cancelled |= new

    def _write_record(self) -> None:
        if self.record is None:
            return
        record = {
            "stopped": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "reason": self.reason,
            "cancelled_jobs": sorted(self.cancelled),
        }
        try:
            self.record.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.record, json.dumps(record) + "\n")
        except OSError as e:
            self.log.warning(f"shardgen: could not record the stop in {self.record}: {e}")


def read_record(path: str | Path) -> dict[str, Any] | None:
    """The record of the last stopped run (``rundir.RunDir.stopped``); None when it was not stopped."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def _flush_logs(logger: logging.Logger | None) -> None:
    while logger is not None:
        for handler in logger.handlers:
            try:
                handler.flush()
            except Exception:  # noqa: BLE001 - flushing is best effort before an exit
                pass
        logger = logger.parent if logger.propagate else None
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
