# Glue: paths, config lookups and input functions. Logic lives in the package.
import json
import shlex
from pathlib import Path

from shardgen import config as shardgen_config
from shardgen.formats import output_path
from shardgen.io import restrict_umask
from shardgen.runlock import RunLock
from shardgen.sources import input_signature
from shardgen.stats import summary_text

# Files this run creates (its config and lock here, the rules' outputs and
# logs in the commands, which inherit the umask) get no permissions for other
# users unless output.world_readable: the outputs carry the input's columns.
restrict_umask(RUN.output.world_readable)

OUT = RUN.output.dir
PLAN_DIR = f"{OUT}/plan"
SHARD_DIR = f"{OUT}/shards"
LOG_DIR = f"{OUT}/logs"
MERGED = output_path(OUT, RUN.output.format)
MODEL_RECORD = f"{PLAN_DIR}/model.json"
# The validated config with defaults filled, which the shardgen commands
# read: rules pass its path, never a config value. Written while the workflow
# is parsed, named by the digest of its content (plan/configs/<digest>.json),
# so a dry run or a second invocation with another config cannot change what
# this run's jobs read. (Not a rule's output: a rule that reruns on every
# config change would, through Snakemake's masking of downstream jobs, hide
# which shards a change of sampling must rerun.)
CONFIG_JSON = shardgen_config.write_resolved(config, PLAN_DIR)
GPUS = RUN.model.gpus
PER_JOB = RUN.shards.per_job


def run_config(wildcards, output):
    """The run's config file, for a rule's params. A function of the output only so that Snakemake
    does not record it as a parameter: its name changes with every setting, and only the settings a
    rule's own params name (the content fingerprint) may rerun its jobs."""
    return CONFIG_JSON


def lock_output_dir():
    """Hold output.dir for this run (onstart); refuses when another run holds it."""
    global RUN_LOCK
    RUN_LOCK = RunLock.acquire(OUT, Path.cwd(), RUN.fingerprint)


wildcard_constraints:
    shard=r"\d+",
    job=r"\d+",


def shard_ids():
    """Shard ids from the plan (available once the plan_shards checkpoint ran)."""
    manifest = checkpoints.plan_shards.get().output.manifest
    return [s["id"] for s in json.loads(Path(manifest).read_text())["shards"]]


def job_shards():
    """shards.per_job > 1: the shards of each job, by the id of its first shard."""
    ids = shard_ids()
    return {ids[i]: ids[i : i + PER_JOB] for i in range(0, len(ids), PER_JOB)}


def all_shard_outputs(wildcards):
    if PER_JOB > 1:
        return {"jobs": expand(f"{SHARD_DIR}/job-{{job}}.json", job=list(job_shards()))}
    ids = shard_ids()
    return {
        "parquet": expand(f"{SHARD_DIR}/{{shard}}.parquet", shard=ids),
        "stats": expand(f"{SHARD_DIR}/{{shard}}.stats.json", shard=ids),
    }


def shards_of(wildcards):
    """The shard ids a generate job runs, as one comma-separated argument (quoted by the rule)."""
    ids = (
        job_shards()[wildcards.job] if "job" in wildcards.keys() else [wildcards.shard]
    )
    return ",".join(ids)


def generate_outputs(wildcards, output):
    """Where a generate job writes: one shard's files, or a directory of several and the job's record."""
    if "record" in output.keys():
        return f"--shard-dir {shlex.quote(SHARD_DIR)} --record {shlex.quote(output.record)}"
    return f"--output {shlex.quote(output.parquet)} --stats {shlex.quote(output.stats)}"


def generate_runtime(wildcards, attempt):
    """Minutes: the configured limit per shard of the job, growing with each retry."""
    shards = len(job_shards()[wildcards.job]) if "job" in wildcards.keys() else 1
    return RUN.resources.runtime * shards * attempt


def slurm_signal(wildcards, attempt):
    """Ask Slurm for SIGTERM a while before the time limit, so a job saves its
    rows with time to spare (Slurm sends SIGTERM at the limit anyway, and
    SIGKILL after KillWait). Only for limits of 10 minutes or more: Slurm may
    signal up to a minute early."""
    minutes = generate_runtime(wildcards, attempt)
    return f"--signal=TERM@{min(300, minutes * 6)}" if minutes >= 10 else ""


def print_summary():
    stats = Path(f"{OUT}/stats.json")
    if stats.exists():
        print(f"\n{summary_text(json.loads(stats.read_text()))}")
        print(f"\noutput: {MERGED}\nstats:  {stats}")
