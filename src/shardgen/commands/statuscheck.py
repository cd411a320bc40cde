"""The executor plugin's job status checks never lose one of the run's jobs.

Snakemake's remote executors (``snakemake_interface_executor_plugins``,
``RemoteExecutor._wait_for_jobs``) hand the plugin's ``check_active_jobs`` the
active jobs and keep as active only the ones it yields back; the others must
have been reported ended (``report_job_success``/``report_job_error``). The
Slurm plugin (2.8.0, ``Executor.check_active_jobs``) yields nothing when every
status query of a check fails: the jobs leave the active list without a word,
and Snakemake waits for ever on jobs it no longer looks at. That happens when
``squeue`` fails a few times in a row (a busy ``slurmctld``), and on a cluster
without accounting whenever ``scontrol show config`` fails once: the plugin
then reads MinJobAge as unknown and, for that check, queries ``sacct`` instead
of the ``squeue`` the profile names, which fails there (seen in CI: a job of
3 minutes, and a controller still waiting 8 minutes later).

``keep_unseen_jobs`` wraps the executor class so that a job neither reported
nor yielded by a check is yielded back and checked again, as the plugin itself
does for a job its query does not list yet. A warning says so once per spell
of failed checks; after ``GIVE_UP_S`` of them the run is stopped, naming why,
rather than waiting on jobs whose end it cannot see.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import wraps

# How long the status checks may fail one after another before the run is stopped: long enough for
# a restart of slurmctld or a busy hour of its database, short against a generate job.
GIVE_UP_S = 15 * 60.0


def keep_unseen_jobs(
    executor_cls: type,
    stop: Callable[[str], None],
    *,
    give_up_s: float = GIVE_UP_S,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Wrap ``executor_cls`` (a remote executor class) so that its status checks yield back every
    active job they neither report ended nor yield; ``stop(message)`` is called once the checks have
    lost jobs for ``give_up_s`` in a row. The class is wrapped once; a later call (the next run in
    the same process) gives the checks its own ``stop``, ``give_up_s`` and ``clock``."""
    already = "_shardgen_give_up" in executor_cls.__dict__
    executor_cls._shardgen_give_up = (stop, give_up_s, clock)
    if already:
        return
    check = executor_cls.check_active_jobs
    success = executor_cls.report_job_success
    error = executor_cls.report_job_error

    def ended(self) -> set[int]:
        return self.__dict__.setdefault("_shardgen_ended", set())

    @wraps(success)
    def report_job_success(self, job_info, *args, **kwargs):
        ended(self).add(id(job_info))
        return success(self, job_info, *args, **kwargs)

    @wraps(error)
    def report_job_error(self, job_info, *args, **kwargs):
        ended(self).add(id(job_info))
        return error(self, job_info, *args, **kwargs)

    @wraps(check)
    async def check_active_jobs(self, active_jobs):
        ended(self).clear()
        yielded = set()
        async for job_info in check(self, active_jobs):
            yielded.add(id(job_info))
            yield job_info
        unseen = [j for j in active_jobs if id(j) not in yielded and id(j) not in ended(self)]
        stop, give_up_s, clock = executor_cls._shardgen_give_up
        state = self.__dict__.setdefault("_shardgen_failing", {})
        if not unseen:
            state.clear()
            return
        now = clock()
        if "since" not in state:
            state["since"] = now
            self.logger.warning(
                f"shardgen: warning: Slurm's job status query failed (all its attempts in this check); "
                f"the {len(unseen)} job(s) it could not see are kept as running and looked at again. "
                f"The run is stopped if the queries fail for {give_up_s / 60:.0f} min in a row"
            )
        elif now - state["since"] >= give_up_s and not state.get("stopped"):
            state["stopped"] = True
            ids = ", ".join(str(j.external_jobid) for j in unseen)
            stop(
                f"Slurm's job status query (the executor plugin's squeue, or sacct where it falls back to it) "
                f"has failed for {(now - state['since']) / 60:.0f} min: the run cannot see its jobs ({ids}) end. "
                "Stopping the run; a job that could not be cancelled may still be running (squeue --me). "
                "Check that slurmctld answers (squeue, scontrol ping) and run the workflow again"
            )
        for job_info in unseen:
            yield job_info

    executor_cls.check_active_jobs = check_active_jobs
    executor_cls.report_job_success = report_job_success
    executor_cls.report_job_error = report_job_error
