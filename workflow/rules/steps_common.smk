# Glue of a run of steps (steps.smk): its handlers. Logic lives in the package.
import json
from pathlib import Path

from shardgen import cluster
from shardgen.config import RunConfig
from shardgen.base.installed import slurm_plugin_problem
from shardgen.commands.runlock import RunLock, release_run
from shardgen.commands.runstop import RunStop
from shardgen.commands.statuscheck import keep_unseen_jobs
from shardgen.base.storage import require_writable

RUN_STOP = None
RUN_LOCK = WATCHER = None


def start_steps():
    """onstart: refuse an output.upload destination that cannot be written; hold output.dir for the
    run; with Slurm, refuse a step whose generate jobs no node can run, and watch the queue.
    """
    global RUN_LOCK, RUN_STOP, WATCHER
    # output.upload: the steps' preflights check their own steps; the destination is the run's
    require_writable(
        config["output"].get("upload"), config["input"].get("storage_options")
    )
    fingerprint = shardgen_steps.content_digest(STEPS)
    RUN_LOCK = RunLock.acquire(RUN_DIR.root, Path.cwd(), fingerprint)
    RUN_STOP = RunStop(
        workflow,
        Path.cwd(),
        [rule.name for rule in workflow.rules],
        record=RUN_DIR.stopped,
        logger=logger,
    )
    if workflow.executor_plugin is None or workflow.executor_plugin.name != "slurm":
        return
    keep_unseen_jobs(workflow.executor_plugin.executor, RUN_STOP.request)
    RUN_STOP.stop_on_interrupt()
    earlier = cluster.earlier_jobs_warning(RUN_STOP.workdir, RUN_STOP.rules)
    if earlier:
        logger.warning(f"shardgen: warning: {earlier}")
    problem = slurm_plugin_problem()
    if problem:
        logger.warning(f"shardgen: warning: {problem}")
    nodes, default = cluster.sinfo()
    for step in STEPS:
        run = RunConfig.from_dict(step)
        generate = f"{step['step']['name']}_generate_shard"
        request = cluster.generate_request(
            run, workflow.resource_settings, generate, run.resources.runtime
        )
        cluster.check_request(nodes, request, default)
    WATCHER = cluster.PendingWatcher(str(Path.cwd()), stop=RUN_STOP.request).start()


def end_steps():
    if RUN_STOP is not None:
        RUN_STOP.finish()
    release_run(RUN_LOCK, WATCHER)


def print_steps():
    if RUN_DIR.stats.exists():
        print(f"\n{shardgen_steps.summary_text(json.loads(RUN_DIR.stats.read_text()))}")
        print(f"\noutput: {MERGED}\nstats:  {RUN_DIR.stats}")
