"""The run directory (``output.dir``): every path under it, and what makes a shard committed.

The files under ``output.dir`` are the only contract between the controller, the shard jobs, their
retries, elastic workers, the merge, ``shardgen status`` and the report. This module is the one
place that names them; the workflow's rules (``common.smk``) ask it for their inputs and outputs
rather than formatting paths, and every command that reads or writes the directory does the same::

    plan/manifest.json            the shards (plan_shards)
    plan/manifest.last.json       its copy, whose shards the next plan keeps (plan.last_plan)
    plan/model.json               where the model is (fetch_model)
    plan/preflight.json           the checks before any GPU job (preflight)
    plan/configs/<digest>.json    the resolved config each command reads, named by its content
    shards/<shard>.parquet        a committed shard ...
    shards/<shard>.stats.json     ... and its stats: both, or it is not committed
    shards/kept/<shard>-<start>-<fingerprint>.*   links to a committed shard's file and stats, which
                                  a job links back where Snakemake removed them (generate.keep)
    shards/job-<shard>.json       shards.per_job: a job's record of its shards
    shards/workers/<i>.json       shards.workers: a worker's record of its shards
    checkpoints/<shard>/          a shard in progress: parts, attempts.jsonl, progress.json
    claims/<shard>.<gen>.claim    who writes a shard (claims.ClaimBoard)
    splits/<shard>.<row>.cut      a shard of elastic workers split at a row (splits); pieces
                                  <shard>-<row> have the files of a shard of that name
    logs/<rule>/<key>.log         the rules' logs; logs/stopped.json: why the last run stopped
    stats.json, output.*          the merge's stats and dataset; pushed.json, uploaded.json, plots/
    .shardgen-run.lock            the run that holds the directory (runlock)
"""

from __future__ import annotations

import os
from pathlib import Path

# The key of a shard's Parquet metadata that holds its fingerprint: its input rows and everything
# that decides their text (outputs stamps it on every part and on the committed file).
FINGERPRINT_KEY = b"shardgen.fingerprint"
# What a shard's checkpoint directory holds besides its parts (outputs.ShardCheckpoint writes them).
ATTEMPTS = "attempts.jsonl"  # one line per attempt's start and end (records)
PROGRESS = "progress.json"  # rows finished so far, rewritten every few seconds while a job runs
DISCARDED = "discarded"  # parts that cannot be reused, moved aside
# Where a run's resolved configs are kept (config.write_resolved), under plan/.
CONFIG_DIR = "configs"
LOCK_NAME = ".shardgen-run.lock"
# The file of the run lock's fallback where the file system has no record locks (runlock).
HELD_NAME = ".shardgen-run.held"
_MERGED = {"parquet": "output.parquet", "jsonl": "output.jsonl", "hf": "output", "openai_batch": "openai"}


class RunDir:
    """The paths of one run directory. Ids and names may be Snakemake wildcards (``"{shard}"``):
    the rules get their patterns from the same methods the commands use."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"RunDir({str(self.root)!r})"

    # plan/: what the run decided before any GPU job
    @property
    def plan(self) -> Path:
        return self.root / "plan"

    @property
    def manifest(self) -> Path:
        return self.plan / "manifest.json"

    @property
    def model_record(self) -> Path:
        return self.plan / "model.json"

    @property
    def preflight(self) -> Path:
        return self.plan / "preflight.json"

    @property
    def storage_reach(self) -> Path:
        """What a compute job read of the input's objects, and from where (``preflight.reach_storage``)."""
        return self.plan / "storage-reach.json"

    @property
    def configs(self) -> Path:
        return self.plan / CONFIG_DIR

    # shards/: what generating committed
    @property
    def shards(self) -> Path:
        return self.root / "shards"

    def shard_file(self, shard: str) -> Path:
        return self.shards / f"{shard}.parquet"

    def shard_stats(self, shard: str) -> Path:
        return self.shards / f"{shard}.stats.json"

    def kept(self, shard: str, start: int, fingerprint: str) -> tuple[Path, Path]:
        """The links to a committed shard's file and stats under its content (``generate.keep``)."""
        stem = self.shards / "kept" / f"{shard}-{start}-{fingerprint}"
        return stem.with_suffix(".parquet"), stem.with_suffix(".stats.json")

    def job_record(self, first_shard: str) -> Path:
        return self.shards / f"job-{first_shard}.json"

    def worker_record(self, worker: str | int) -> Path:
        return self.shards / "workers" / f"{worker}.json"

    # checkpoints/ and claims/: what is in progress, and who writes it
    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def checkpoint(self, shard: str) -> Path:
        return self.checkpoints / shard

    def attempts(self, shard: str) -> Path:
        return self.checkpoint(shard) / ATTEMPTS

    def progress(self, shard: str) -> Path:
        return self.checkpoint(shard) / PROGRESS

    @property
    def claims(self) -> Path:
        return self.root / "claims"

    # logs/
    @property
    def splits(self) -> Path:
        return self.root / "splits"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def log(self, rule: str, key: str | None = None) -> Path:
        return self.logs / rule / f"{key}.log" if key is not None else self.logs / f"{rule}.log"

    @property
    def stopped(self) -> Path:
        return self.logs / "stopped.json"

    # the run's own files, and what the merge and the report make
    @property
    def lock(self) -> Path:
        return self.root / LOCK_NAME

    @property
    def held(self) -> Path:
        return self.root / HELD_NAME

    @property
    def stats(self) -> Path:
        return self.root / "stats.json"

    def merged(self, fmt: str) -> Path:
        """The merged output of ``output.format`` (``hf`` and ``openai_batch``: a directory)."""
        return self.root / _MERGED[fmt]

    @property
    def pushed(self) -> Path:
        return self.root / "pushed.json"

    @property
    def uploaded(self) -> Path:
        """What the last upload (output.upload) uploaded and skipped."""
        return self.root / "uploaded.json"

    @property
    def upload_state(self) -> Path:
        """Each object uploaded, with its checksum and ETag: kept across reruns, which skip what it holds."""
        return self.root / "plan" / "upload-state.json"

    @property
    def plots(self) -> Path:
        return self.root / "plots"

    def committed_shards(self) -> set[str]:
        """The shards that are committed (``committed_fingerprint``: file and stats both there), from
        one listing of ``shards/`` (``shardgen status`` at 10,000 shards reads no file of them)."""
        try:
            names = set(os.listdir(self.shards))
        except FileNotFoundError:
            return set()
        return {n.removesuffix(".parquet") for n in names if n.endswith(".parquet")
                and self.shard_stats(n.removesuffix(".parquet")).name in names}  # fmt: skip


def committed_fingerprint(path: str | Path, stats: str | Path) -> str | None:
    """The fingerprint of a committed shard file; None when the shard is not committed.

    The one definition of committed: the shard's file and its stats are both there (the commit
    writes the file, then its stats, and removes the parts only after both:
    ``outputs.ShardCheckpoint.commit``). Whether it was made with a given configuration is its
    fingerprint's question: generate keeps a committed shard whose fingerprint is its own,
    ``shardgen status`` counts every committed shard as done, and the merge verifies each one's rows
    and configuration before it copies it."""
    import pyarrow.parquet as pq

    path = Path(path)
    if not (Path(stats).exists() and path.exists()):
        return None
    try:
        meta = pq.read_schema(path).metadata or {}
    except (OSError, ValueError):  # cut or replaced under us: not a shard anyone can keep
        return ""
    return meta.get(FINGERPRINT_KEY, b"").decode()
