"""What a job knows about where it runs: the host, the Slurm job, its memory, its own log.

Recorded in each attempt's entry of a shard's ``attempts.jsonl`` and in the
shard's stats, so a user can tell which node and which Slurm job made which
rows, how long Slurm gave it, and how long it waited in the queue.
"""

from __future__ import annotations

import datetime
import os
import resource
import socket
import subprocess
from typing import Any

# Slurm's environment variables a job records, by the name stats use.
SLURM_ENV = {
    "job_id": "SLURM_JOB_ID",
    "array_task_id": "SLURM_ARRAY_TASK_ID",
    "restart_count": "SLURM_RESTART_COUNT",
    "partition": "SLURM_JOB_PARTITION",
    "nodelist": "SLURM_JOB_NODELIST",
    "gpus_on_node": "SLURM_GPUS_ON_NODE",
}


def host() -> str:
    return socket.gethostname()


def process_gone(on_host: str | None, pid: object) -> bool:
    """Whether process ``pid`` of host ``on_host`` has certainly ended: only a process of this host can
    be asked (False for one elsewhere, or one that may still run)."""
    if on_host != host() or not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def slurm_info() -> dict[str, Any]:
    """The Slurm job this process runs in (empty outside Slurm), with its queue times and time limit."""
    info: dict[str, Any] = {k: os.environ[v] for k, v in SLURM_ENV.items() if v in os.environ}
    if "job_id" in info:
        info.update(slurm_times(info["job_id"]))
    return info


def slurm_times(job_id: str) -> dict[str, Any]:
    """When Slurm queued and started this job, the wait between, and its time limit (from ``scontrol``;
    empty if unavailable)."""
    jobs = scontrol_jobs(job_id)
    fields = jobs[0] if jobs else {}
    try:
        submit = datetime.datetime.fromisoformat(fields["SubmitTime"])
        start = datetime.datetime.fromisoformat(fields["StartTime"])
    except (KeyError, ValueError):
        return {}
    return {
        "submit_time": fields["SubmitTime"],
        "start_time": fields["StartTime"],
        "queue_wait_seconds": (start - submit).total_seconds(),
        "time_limit": fields.get("TimeLimit"),
    }


def scontrol_jobs(job_id: str | None = None) -> list[dict[str, str]]:
    """``scontrol show job -o``: the fields of this job (or of every job Slurm still lists), a dict
    each; none when scontrol cannot be asked."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "job", "-o", *([job_id] if job_id else [])],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [dict(f.split("=", 1) for f in line.split() if "=" in f) for line in out.splitlines() if line.strip()]


def peak_rss_mib() -> float:
    """The largest resident memory of this process and of its finished children (the engine's), in MiB."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return round(max(own, children) / 1024, 1)


def own_log_size() -> int:
    """How much this process's stderr holds now, when it is a file (the job's log); else 0."""
    try:
        return os.fstat(2).st_size if os.path.isfile(os.readlink("/proc/self/fd/2")) else 0
    except OSError:
        return 0


def own_log_tail(limit: int = 200_000, since: int = 0) -> str:
    """The end of this process's stderr when it is a file (the job's log), from offset ``since`` on.

    vLLM's engine core runs in a child process that writes the real cause of
    a failed start there; the parent only sees "initialization failed".
    """
    try:
        path = os.readlink("/proc/self/fd/2")
        with open(path, "rb") as f:
            f.seek(max(since, os.fstat(f.fileno()).st_size - limit))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def cache_root(host: str) -> str:
    """Where vLLM keeps its caches in a job (``VLLM_CACHE_ROOT``): one directory per node.

    vLLM's custom all-reduce keeps whether GPUs reach each other peer to peer
    in a file keyed by ``CUDA_VISIBLE_DEVICES`` alone
    (vllm/distributed/device_communicators/all_reduce_utils.py), so on a
    shared home directory a PCIe node could read the answer an NVLink node
    wrote; and many jobs would write one torch.compile cache at once. A
    ``VLLM_CACHE_ROOT`` set in the environment is taken as it is.
    """
    if os.environ.get("VLLM_CACHE_ROOT"):
        return os.environ["VLLM_CACHE_ROOT"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "vllm", "shardgen-nodes", host)
