"""What the Slurm cluster can run, asked of Slurm itself: no job waits forever without a word.

- Before any job is submitted (the workflow's ``onstart``): each generate
  job's request (GPUs on one node, CPUs, memory, time) against the nodes that
  ``sinfo`` lists for its partition. A request no node can ever satisfy is
  refused with both sides' numbers; Slurm would accept it and leave the job
  pending, with the reason ``PartitionConfig``, for ever.
- While the run goes on (a thread of the workflow's process): the run's
  pending jobs, from ``squeue``. A job pending for a reason that cannot
  resolve by itself (an invalid account or QoS, a request above a partition's
  or an association's limits) is reported and the run is stopped, its jobs
  cancelled; a job pending for any reason longer than ``STUCK_AFTER_S`` is
  reported, again every ``STUCK_AFTER_S``.
"""

from __future__ import annotations

import logging
import re
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from shardgen.errors import ShardgenError
from shardgen.profile import raw_value

log = logging.getLogger(__name__)

# Pending reasons (squeue %r) that cannot resolve by themselves: the request is above what the
# partition, the association or the QoS can ever give, or names what does not exist. From
# Slurm's squeue(1) "JOB REASON CODES" and resource_limits documentation.
NEVER_RESOLVE = (
    "PartitionConfig",
    "PartitionNodeLimit",
    "PartitionTimeLimit",
    "BadConstraints",
    "InvalidAccount",
    "InvalidQOS",
    "QOSMaxWallDurationPerJobLimit",
    "QOSMaxCpuPerJobLimit",
    "QOSMaxGRESPerJob",
    "QOSMaxMemoryPerJob",
    "QOSMaxNodePerJobLimit",
    "QOSMinGRES",
    "AssocMaxWallDurationPerJobLimit",
    "AssocMaxCpuPerJobLimit",
    "AssocMaxGRESPerJob",
    "AssocMaxMemPerJob",
    "AssocMaxNodePerJobLimit",
)
# How often the watcher asks squeue, and after how long any pending job is reported.
POLL_S = 30.0
STUCK_AFTER_S = 1800.0


class Unsatisfiable(ShardgenError):
    """No node of the partition can ever run the job as requested."""


@dataclass(frozen=True)
class Node:
    name: str
    partition: str
    cpus: int
    mem_mb: int
    gpus: dict[str, int]  # GPU type ('' when untyped) -> count
    time_limit_min: float | None  # the partition's; None: unlimited
    features: frozenset[str]
    state: str

    @property
    def gpu_count(self) -> int:
        return sum(self.gpus.values())


@dataclass(frozen=True)
class Request:
    """One generate job, as the workflow will submit it."""

    gpus: int  # on each node
    cpus: int
    mem_mb: int
    runtime_min: float
    partition: str | None = None  # None: the cluster's default partition
    gpu_model: str | None = None
    constraint: str | None = None
    rule: str = "generate_shard"
    nodes: int = 1

    def describe(self) -> str:
        gpu = f"{self.gpus} GPU(s)" + (f" of type {self.gpu_model}" if self.gpu_model else "")
        each = f"{self.nodes} nodes, each with " if self.nodes > 1 else ""
        return f"{each}{gpu}, {self.cpus} CPUs, {self.mem_mb} MB memory, {self.runtime_min:g} min"


def parse_gres(text: str) -> dict[str, int]:
    """GPUs of a node from sinfo's %G: ``gpu:h100:8(S:0-1),gpu:a100:2`` -> ``{'h100': 8, 'a100': 2}``."""
    out: dict[str, int] = {}
    for item in re.split(r",(?![^(]*\))", text or ""):
        parts = re.sub(r"\(.*\)", "", item).split(":")
        if parts[0] != "gpu" or len(parts) < 2:
            continue
        kind, count = ("", parts[1]) if len(parts) == 2 else (parts[1], parts[2])
        m = re.match(r"\d+", count)
        if m and int(m.group()):
            out[kind] = out.get(kind, 0) + int(m.group())
    return out


def parse_time_limit(text: str) -> float | None:
    """Minutes from Slurm's time format (``[days-]hours:minutes:seconds``, ``minutes``); None when unlimited."""
    text = text.strip()
    if text.lower() in ("infinite", "unlimited", "n/a", ""):
        return None
    days = 0
    if "-" in text:
        d, text = text.split("-", 1)
        days = int(d)
    parts = [int(p) for p in text.split(":")]
    if len(parts) == 1:  # minutes
        h, m, s = 0, parts[0], 0
    elif len(parts) == 2:  # minutes:seconds
        h, m, s = 0, parts[0], parts[1]
    else:
        h, m, s = parts[-3:]
    return days * 1440 + h * 60 + m + s / 60


SINFO_FORMAT = "%N|%P|%c|%m|%G|%l|%f|%t"


def parse_sinfo(text: str) -> list[Node]:
    """Nodes from ``sinfo -h -N -o SINFO_FORMAT`` (a node once per partition it is in)."""
    nodes = []
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 8:
            continue
        name, part, cpus, mem, gres, limit, features, state = fields
        features_set = frozenset(f for f in features.split(",") if f and f != "(null)")
        nodes.append(
            Node(
                name,
                part.rstrip("*"),
                int(cpus.rstrip("+")),
                int(mem.rstrip("+")),
                parse_gres(gres),
                parse_time_limit(limit),
                features_set,
                state,
            )
        )
    return nodes


def default_partition(text: str) -> str | None:
    """The partition sinfo marks with '*'."""
    for line in text.splitlines():
        part = line.split("|")[1] if line.count("|") >= 1 else ""
        if part.endswith("*"):
            return part.rstrip("*")
    return None


def sinfo(run: Callable[[list[str]], str] | None = None) -> tuple[list[Node], str | None]:
    """All nodes and the default partition, from one ``sinfo`` call."""
    text = (run or _run)(["sinfo", "-h", "-N", "-o", SINFO_FORMAT])
    return parse_sinfo(text), default_partition(text)


def _fits(node: Node, req: Request) -> list[str]:
    """What of the request this node cannot give (empty: it can run the job)."""
    short = []
    gpus = node.gpus.get(req.gpu_model, 0) if req.gpu_model else node.gpu_count
    if gpus < req.gpus:
        short.append("GPUs")
    if node.cpus < req.cpus:
        short.append("CPUs")
    if node.mem_mb < req.mem_mb:
        short.append("memory")
    if node.time_limit_min is not None and node.time_limit_min < req.runtime_min:
        short.append("time")
    if req.constraint and re.fullmatch(r"[\w.]+", req.constraint) and req.constraint not in node.features:
        short.append(f"feature {req.constraint}")
    return short


def check_request(nodes: list[Node], req: Request, default: str | None = None) -> None:
    """Refuse a request that no node of its partition(s) can ever run.

    Raises:
        Unsatisfiable: naming what is asked and what each kind of node has.
    """
    wanted = (req.partition or default or "").split(",")
    candidates = [n for n in nodes if n.partition in wanted]
    where = f"partition {','.join(wanted)!r}" if any(wanted) else "the default partition"
    if not candidates:
        known = sorted({n.partition for n in nodes})
        raise Unsatisfiable(
            f"{req.rule}: {where} has no nodes (sinfo lists the partitions {', '.join(known) or 'none'}); "
            "set slurm_partition in the profile's default-resources"
        )
    fitting = [n.name for n in candidates if not _fits(n, req)]
    if len(set(fitting)) >= req.nodes:
        return
    if fitting:
        raise Unsatisfiable(
            f"{req.rule}: a generate job asks for {req.describe()} (resources.nodes), but only "
            f"{len(set(fitting))} node(s) of {where} can give that ({', '.join(sorted(set(fitting)))}); Slurm "
            "would leave it pending for ever (reason PartitionConfig). Lower resources.nodes with "
            "model.pipeline_parallel_size, or choose a partition with more such nodes"
        )
    kinds: dict[tuple, list[str]] = {}
    for n in candidates:
        gres = ",".join(f"{k + ':' if k else ''}{v}" for k, v in sorted(n.gpus.items())) or "none"
        limit = "unlimited" if n.time_limit_min is None else f"{n.time_limit_min:g} min"
        key = (n.cpus, n.mem_mb, gres, limit, tuple(_fits(n, req)))
        kinds.setdefault(key, []).append(n.name)
    lines = [
        f"  {len(names)} node(s) ({', '.join(sorted(names)[:3])}{', ...' if len(names) > 3 else ''}): {cpus} CPUs, "
        f"{mem} MB memory, GPUs {gres}, time limit {limit}; short of {', '.join(short)}"
        for (cpus, mem, gres, limit, short), names in sorted(kinds.items())
    ]
    raise Unsatisfiable(
        f"{req.rule}: no node of {where} can ever run a generate job, which asks for {req.describe()}; Slurm "
        "would leave it pending for ever (reason PartitionConfig). The nodes:\n" + "\n".join(lines) + "\n"
        "Lower resources.cpus_per_task / resources.mem_mb / resources.runtime or the model's GPUs in the run "
        "config, or choose another partition in the profile"
    )


# -- while running ---------------------------------------------------------------------------------

SQUEUE_FORMAT = "%i|%T|%r|%j|%k|%V|%Z"


@dataclass(frozen=True)
class QueuedJob:
    job_id: str
    state: str
    reason: str
    name: str
    comment: str
    submitted: str
    workdir: str


def parse_squeue(text: str) -> list[QueuedJob]:
    """``squeue -o SQUEUE_FORMAT`` output, a job a line."""
    return [QueuedJob(*fields) for line in text.splitlines() if len(fields := line.strip().split("|")) == 7]


def queued(*states: str, run: Callable[[list[str]], str] | None = None) -> list[QueuedJob]:
    """This user's jobs (of these states, or all that squeue shows).

    Raises:
        OSError, subprocess.SubprocessError: squeue could not be asked.
    """
    argv = ["squeue", "--me", "-h", "-o", SQUEUE_FORMAT, *(["-t", ",".join(states)] if states else [])]
    return parse_squeue((run or _run)(argv))


def squeue(*states: str, run: Callable[[list[str]], str] | None = None) -> list[QueuedJob]:
    """This user's jobs (of these states, or all); none when squeue cannot be asked."""
    try:
        return queued(*states, run=run)
    except (OSError, subprocess.SubprocessError) as e:
        log.debug("squeue failed: %s", e)
        return []


def job_state(job_id: str) -> str | None:
    """The state ``squeue`` shows for one job ('' once Slurm has forgotten it); None when squeue cannot
    be asked."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:  # "Invalid job id specified": purged since it ended
        return "" if "Invalid job id" in out.stderr else None
    return out.stdout.strip()


def is_run_job(job: QueuedJob, workdir: str, rules: Iterable[str]) -> bool:
    """Whether ``job`` was submitted by the Slurm executor plugin for a run in ``workdir``: from that
    directory, with a comment naming one of the run's rules (``rule_<name>`` or
    ``rule_<name>_wildcards_<...>``, as the plugin sets it)."""
    return job.workdir == workdir and any(
        job.comment == f"rule_{rule}" or job.comment.startswith(f"rule_{rule}_wildcards_") for rule in rules
    )


def run_jobs(workdir: str, rules: Iterable[str], run: Callable[[list[str]], str] | None = None) -> list[QueuedJob]:
    """The queued and running Slurm jobs of the run in ``workdir`` (``is_run_job``).

    Raises:
        OSError, subprocess.SubprocessError: squeue could not be asked.
    """
    rules = tuple(rules)
    return [job for job in queued(run=run) if job.state not in FINAL_STATES and is_run_job(job, workdir, rules)]


def earlier_jobs_warning(
    workdir: str, rules: Iterable[str], run: Callable[[list[str]], str] | None = None
) -> str | None:
    """At a run's start: the jobs an earlier run of ``workdir`` left in Slurm (a killed controller's
    run on, and keep the shards they write), for a warning; None when there are none or squeue fails."""
    try:
        earlier = run_jobs(workdir, rules, run)
    except (OSError, subprocess.SubprocessError):
        return None
    if not earlier:
        return None
    ids = " ".join(job.job_id for job in earlier)
    return (
        f"{len(earlier)} Slurm job(s) of an earlier run of this directory are still queued or running ({ids}); this "
        f"run's job for a shard one of them writes waits for it to end. To stop them instead: scancel {ids}"
    )


def cancel_run_jobs(workdir: str, rules: Iterable[str], run: Callable[[list[str]], str] | None = None) -> list[str]:
    """Cancel the queued and running Slurm jobs of the run in ``workdir`` (``run_jobs``), by job id
    with ``scancel`` as the executor plugin cancels them. Returns the ids it cancelled.

    Raises:
        OSError, subprocess.SubprocessError: squeue or scancel could not be asked.
    """
    ids = [job.job_id for job in run_jobs(workdir, rules, run)]
    if ids:
        (run or _run)(["scancel", *ids])
    return ids


# squeue's states of a job that has ended (squeue shows them for MinJobAge after the end).
FINAL_STATES = ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE",
                "OUT_OF_MEMORY", "SPECIAL_EXIT", "REVOKED")  # fmt: skip


@dataclass
class PendingWatcher:
    """Watches this run's pending jobs (by the working directory they were submitted from, and a
    comment naming one of the run's rules, as the Slurm executor plugin sets it).

    ``stop(message)`` is called once, for the first job pending for a reason in ``NEVER_RESOLVE``.
    """

    workdir: str
    stop: Callable[[str], None]
    rules: Iterable[str] = ("generate_shard", "generate_shards", "generate_worker")
    run: Callable[[list[str]], str] | None = None
    clock: Callable[[], float] = time.monotonic
    poll_s: float = POLL_S
    stuck_after_s: float = STUCK_AFTER_S
    _first_seen: dict[str, float] = field(default_factory=dict)
    _reported: dict[str, float] = field(default_factory=dict)
    _stopped: bool = False
    _thread: threading.Thread | None = None
    _halt: threading.Event = field(default_factory=threading.Event)

    def poll(self) -> list[str]:
        """One look at the queue; returns what it reported."""
        jobs = squeue("PENDING", run=self.run)
        now = self.clock()
        notes = []
        for job in jobs:
            if job.state != "PENDING" or job.workdir != self.workdir or not any(r in job.comment for r in self.rules):
                continue
            first = self._first_seen.setdefault(job.job_id, now)
            reason = job.reason.split(",")[0].strip("()")
            if reason in NEVER_RESOLVE and not self._stopped:
                self._stopped = True
                message = (
                    f"Slurm job {job.job_id} ({job.comment}) is pending with the reason {reason}, which does not "
                    "resolve by itself: the request exceeds what its partition, account or QoS allows, or names "
                    f"one that does not exist (see `scontrol show job {job.job_id}` and squeue(1) 'JOB REASON "
                    "CODES'). Stopping the run; its jobs are cancelled"
                )
                notes.append(message)
                self.stop(message)
            elif (
                now - first >= self.stuck_after_s and now - self._reported.get(job.job_id, first) >= self.stuck_after_s
            ):
                self._reported[job.job_id] = now
                notes.append(
                    f"Slurm job {job.job_id} ({job.comment}) has been pending for {(now - first) / 60:.0f} min "
                    f"(reason: {job.reason})"
                )
                log.warning("shardgen: %s", notes[-1])
        return notes

    def start(self) -> PendingWatcher:
        def loop() -> None:
            while not self._halt.wait(self.poll_s) and not self._stopped:
                self.poll()

        self._thread = threading.Thread(target=loop, name="shardgen-pending-watcher", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._halt.set()


def _run(argv: list[str]) -> str:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True).stdout


def multinode_options(run_config, gpu_model: str | None) -> list[str]:
    """sbatch options of a generate job over ``resources.nodes`` nodes, beside the plugin's own
    ``--nodes`` and ``--gpus`` (the job's total): the same GPUs on every node (Slurm would otherwise
    spread the total as it likes) and one task per node, which the engine's workers run in."""
    gpus = f"{gpu_model}:{run_config.gpus_per_node}" if gpu_model else str(run_config.gpus_per_node)
    return [f"--gpus-per-node={gpus}", "--ntasks-per-node=1"]


def container_multinode_problem(run_config, deployment_methods: Iterable[object]) -> str | None:
    """Why a model across nodes cannot run in the run's container, or None.

    A job over ``resources.nodes`` nodes starts the engine's workers on its
    other nodes with ``srun`` from inside the job (``multinode.py``), and asks
    ``scontrol`` for its nodes; in the container (the vLLM image) there is no
    Slurm client, nor the cluster's munge socket it needs."""
    apptainer = any(getattr(m, "name", str(m)).lower() == "apptainer" for m in deployment_methods)
    if run_config.resources.nodes > 1 and run_config.software.container and apptainer:
        return (
            f"resources.nodes is {run_config.resources.nodes} and generate_shard would run in software.container "
            "(--software-deployment-method apptainer): a job across nodes starts vLLM's workers on its other "
            "nodes with srun from inside the job, and the container has no Slurm client (srun, scontrol) nor "
            "the cluster's munge socket. Run a model across nodes from the venv of `make setup` or the conda "
            "environment (docs/deployment.md), or on one node"
        )
    return None


def generate_request(run_config, resource_settings, rule: str, runtime_min: float) -> Request:
    """The request of the run's generate jobs: the rule's own resources (from the run config), with
    what the profile sets (``default-resources``, and ``set-resources`` for ``rule``) over them."""
    defaults = getattr(resource_settings, "default_resources", None) or {}
    per_rule = (getattr(resource_settings, "overwrite_resources", None) or {}).get(rule, {})

    def value(name: str, own=None):
        for source in (per_rule, {name: own} if own is not None else {}, defaults):
            if name in source and source[name] is not None:
                raw = raw_value(source[name])
                return None if raw in ("", "None") else raw
        return None

    def number(name: str, own) -> float:
        raw = value(name, own)
        try:
            return float(raw)
        except (TypeError, ValueError):
            return float(own)

    return Request(
        gpus=run_config.gpus_per_node,
        nodes=run_config.resources.nodes,
        cpus=int(number("cpus_per_task", run_config.cpus_per_job)),
        mem_mb=int(number("mem_mb", run_config.resources.mem_mb)),
        runtime_min=number("runtime", runtime_min),
        partition=value("slurm_partition"),
        gpu_model=value("gpu_model"),
        constraint=value("constraint"),
        rule=rule,
    )


def partition_time_limit(nodes: list[Node], partition: str | None, default: str | None) -> float | None:
    """The longest time limit among the request's partitions (minutes; None: unlimited or unknown)."""
    wanted = (partition or default or "").split(",")
    limits = [n.time_limit_min for n in nodes if n.partition in wanted]
    if not limits or any(limit is None for limit in limits):
        return None
    return max(limits)
