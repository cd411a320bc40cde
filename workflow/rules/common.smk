# Glue: paths, config lookups and input functions. Logic lives in the package.
import json
import os
import shlex
from pathlib import Path

from shardgen import cluster
from shardgen import config as shardgen_config
from shardgen.base.installed import slurm_plugin_problem
from shardgen.base.io import restrict_umask
from shardgen.commands.runlock import RunLock, release_run
from shardgen.base.rundir import RunDir
from shardgen.commands.runstop import RunStop
from shardgen.commands.statuscheck import keep_unseen_jobs
from shardgen.data.sources import input_signature
from shardgen.data.stats import summary_text

# Files this run creates (its config and lock here, the rules' outputs and
# logs in the commands, which inherit the umask) get no permissions for other
# users unless output.world_readable: the outputs carry the input's columns.
restrict_umask(RUN.output.world_readable)

# Every path under output.dir, the rules' inputs, outputs and logs included
# (their wildcards are passed as names: RUN_DIR.shard_file("{shard}")).
RUN_DIR = RunDir(RUN.output.dir)
MERGED = RUN_DIR.merged(RUN.output.format)
# The validated config with defaults filled, which the shardgen commands
# read: rules pass its path, never a config value. Written while the workflow
# is parsed, named by the digest of its content (plan/configs/<digest>.json),
# so a dry run or a second invocation with another config cannot change what
# this run's jobs read. (Not a rule's output: a rule that reruns on every
# config change would, through Snakemake's masking of downstream jobs, hide
# which shards a change of sampling must rerun.)
CONFIG_JSON = shardgen_config.write_resolved(config, RUN_DIR.root)
GPUS = RUN.gpus
# A job over several nodes (resources.nodes): shardgen starts the other nodes'
# part of the engine itself (shardgen.engines.multinode). `mpi` makes the Slurm
# plugins run the rule's command in the batch step, with the whole
# allocation, instead of in a one-task srun step on the first node, which
# cannot hold more than one node's GPUs; one task per node.
MULTINODE_RESOURCES = (
    {"mpi": "srun", "tasks": RUN.resources.nodes} if RUN.resources.nodes > 1 else {}
)
PER_JOB = RUN.shards.per_job
WORKERS = RUN.shards.workers
# A later step of a run of steps plans from the step before it, and its shard i reads that step's
# committed shard i (shardgen.features.steps); every step's generate jobs wait for every step's preflight.
STEP_BEFORE = RunDir(RUN.input.step["dir"]) if RUN.input.step else None
# (ancient: whether they exist, not their times; a step's preflight reruns with its config, which
# reruns no other step's jobs)
STEP_PREFLIGHTS = [ancient(p) for p in RUN.step["preflights"]] if RUN.step else []


def run_config(wildcards, output):
    """The run's config file, for a rule's params. A function of the output only so that Snakemake
    does not record it as a parameter: its name changes with every setting, and only the settings a
    rule's own params name (the content fingerprint) may rerun its jobs."""
    return CONFIG_JSON


# Which generate rule runs (one shard, several, or a worker per job), and the
# longest a job may run on its partition in minutes (set at the start; None
# when unlimited or unknown), which caps what generate_runtime asks for.
GENERATE_RULE = (
    "generate_worker"
    if WORKERS
    else "generate_shards" if PER_JOB > 1 else "generate_shard"
)
TIME_LIMIT = None
# Stops the run from the pending watcher's thread (shardgen.commands.runstop: why it cannot be lost).
RUN_STOP = None
# The run's hold on output.dir, and the watcher of its pending jobs (start_run)
RUN_LOCK = WATCHER = None
# The rules that run before any shard is generated.
BEFORE_GENERATE = {"fetch_model", "plan_shards", "preflight"}


def start_run():
    """onstart, before the first job: hold output.dir for this run (refused when another run holds
    it); with Slurm, refuse generate jobs no node can run, watch the queue for jobs that would
    wait for ever, keep jobs a failed status check missed, and stop on Ctrl-C."""
    global RUN_LOCK, RUN_STOP, TIME_LIMIT, WATCHER
    RUN_LOCK = RunLock.acquire(RUN_DIR.root, Path.cwd(), RUN.fingerprint)
    RUN_STOP = RunStop(  # clears an earlier run's record of its stop
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
    runtime = RUN.resources.runtime * (
        PER_JOB if GENERATE_RULE == "generate_shards" else 1
    )
    request = cluster.generate_request(
        RUN, workflow.resource_settings, GENERATE_RULE, runtime
    )
    # Not for a run of the steps before generating (`snakemake preflight` on the
    # login node), whose DAG holds nothing else; the generate jobs themselves
    # join the DAG only after the plan checkpoint, so they cannot be looked for.
    if any(job.rule.name not in BEFORE_GENERATE for job in workflow.dag.jobs):
        cluster.check_request(nodes, request, default)
    TIME_LIMIT = cluster.partition_time_limit(nodes, request.partition, default)
    WATCHER = cluster.PendingWatcher(str(Path.cwd()), stop=RUN_STOP.request).start()


def end_run():
    """onsuccess and onerror, once the scheduler has returned: after a stop, cancel what is left of
    the run's Slurm jobs (none can be submitted any more); then let go of the queue and of output.dir
    (a run from Python, shardgen.run, goes on in its process)."""
    if RUN_STOP is not None:
        RUN_STOP.finish()
    release_run(RUN_LOCK, WATCHER)


wildcard_constraints:
    shard=r"\d+",
    job=r"\d+",
    worker=r"\d+",


def shard_ids():
    """Shard ids from the plan (available once the plan_shards checkpoint ran)."""
    manifest = checkpoints.plan_shards.get().output.manifest
    return [s["id"] for s in json.loads(Path(manifest).read_text())["shards"]]


def job_shards():
    """shards.per_job > 1: the shards of each job, by the id of its first shard."""
    ids = shard_ids()
    return {ids[i]: ids[i : i + PER_JOB] for i in range(0, len(ids), PER_JOB)}


def worker_ids():
    """shards.workers: the workers' indexes (no more workers than shards)."""
    return [str(i) for i in range(min(WORKERS, len(shard_ids())))]


def all_shard_outputs(wildcards):
    """What the merge reads: the shards' files (or the jobs' or workers' records)."""
    if WORKERS:
        return {
            "workers": expand(
                str(RUN_DIR.worker_record("{worker}")), worker=worker_ids()
            ),
        }
    if PER_JOB > 1:
        return {
            "jobs": expand(str(RUN_DIR.job_record("{job}")), job=list(job_shards())),
        }
    ids = shard_ids()
    return {
        "parquet": expand(str(RUN_DIR.shard_file("{shard}")), shard=ids),
        "stats": expand(str(RUN_DIR.shard_stats("{shard}")), shard=ids),
    }


def step_before_shard(wildcards):
    """A later step of a run of steps: the same shard of the step before it, committed (a run of
    steps has a job per shard: shardgen.features.steps.step_configs)."""
    if STEP_BEFORE is None:
        return []
    return [
        STEP_BEFORE.shard_file(wildcards.shard),
        STEP_BEFORE.shard_stats(wildcards.shard),
    ]


def preflight_environment():
    """The GPU type and time limit the generate jobs ask for (the profile's), for the preflight's
    estimate of a shard's minutes (shardgen preflight --gpu-model, --time-limit). In the environment
    the preflight inherits, not a parameter: a change of them checks nothing again and reruns no shard.
    """
    request = cluster.generate_request(
        RUN, workflow.resource_settings, GENERATE_RULE, RUN.resources.runtime
    )
    return {
        "SHARDGEN_JOBS_TIME_LIMIT": f"{request.runtime_min:g}",
        "SHARDGEN_JOBS_GPU_MODEL": request.gpu_model or "",
    }


os.environ.update(preflight_environment())


def generate_args(wildcards, output):
    """What a generate job runs and where it writes, each value quoted: one shard and its files; the
    shards of a job (shards.per_job), their directory and the job's record; or an elastic worker
    (shards.workers), the shards' directory and the worker's record."""
    q = shlex.quote
    if "worker" in wildcards.keys():
        return f"--worker {q(wildcards.worker)} --record {q(output.record)}"
    if "job" in wildcards.keys():
        shards = ",".join(job_shards()[wildcards.job])
        return f"--shard {q(shards)} --record {q(output.record)}"
    return f"--shard {q(wildcards.shard)} --output {q(output.parquet)} --stats {q(output.stats)}"


def generate_runtime(wildcards, attempt):
    """Minutes: the configured limit per shard, times the shards of the job (a worker: its share of
    the plan), growing with each retry."""
    if "worker" in wildcards.keys():
        shards = -(-len(shard_ids()) // len(worker_ids()))
    else:
        shards = len(job_shards()[wildcards.job]) if "job" in wildcards.keys() else 1
    minutes = RUN.resources.runtime * shards * attempt
    return min(minutes, int(TIME_LIMIT)) if TIME_LIMIT else minutes


def slurm_extra(wildcards, attempt):
    """Ask Slurm for SIGTERM a while before the time limit, so a job saves its
    rows with time to spare (Slurm sends SIGTERM at the limit anyway, and
    SIGKILL after KillWait). Only for limits of 10 minutes or more: Slurm may
    signal up to a minute early. A job over several nodes also asks for the
    same GPUs on each node and one task per node."""
    minutes = generate_runtime(wildcards, attempt)
    options = [f"--signal=TERM@{min(300, minutes * 6)}"] if minutes >= 10 else []
    if RUN.resources.nodes > 1:
        gpu_model = cluster.generate_request(
            RUN, workflow.resource_settings, GENERATE_RULE, minutes
        ).gpu_model
        options += cluster.multinode_options(RUN, gpu_model)
    return " ".join(options)


def print_summary():
    stats = RUN_DIR.stats
    if stats.exists():
        print(f"\n{summary_text(json.loads(stats.read_text()))}")
        print(f"\noutput: {MERGED}\nstats:  {stats}")


def chain_handler(ours, theirs):
    """A workflow handler that runs ``ours`` (no arguments), then ``theirs`` (Snakemake's ``log``)."""

    def handler(log):
        ours()
        theirs(log)

    return handler
