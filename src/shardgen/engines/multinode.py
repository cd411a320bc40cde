"""One engine across several nodes of a Slurm job (``resources.nodes`` > 1).

vLLM 0.32 spans nodes with its multiprocessing executor: every node runs the
workers of its GPUs, given ``nnodes``, ``node_rank``, ``master_addr`` and
``master_port`` (``vllm/config/parallel.py``); node 0 runs ``vllm.LLM`` (the
scheduler and its own workers) and every other node a headless
``MultiprocExecutor``, which is what ``vllm serve --headless`` runs
(``vllm/entrypoints/cli/serve.py``, ``run_headless``). Chosen over Ray, vLLM's
other way: no Ray cluster (its head, its dozen ports, its object store) has to
be started and torn down inside each job, nothing is added to the environment,
and the CPU build refuses Ray (``vllm/v1/executor/ray_utils.py``), so only this
way can be tested here.

In a job, the first node runs shardgen. Before its engine starts it launches
the other nodes' workers as one ``srun`` step over the rest of the allocation
(``Workers``), each ``shardgen engine-worker`` with the head's exact engine
arguments, and watches that step:

- ports: the rendezvous port is one the head node's kernel has free at launch
  (other jobs on the node hold theirs); every other socket vLLM opens (gloo,
  ZMQ) takes a kernel-assigned one;
- addresses: each node binds to its address on the network Slurm's daemons
  reach it on (the node's ``NodeAddr``), never the default route's interface,
  which vLLM would pick (``vllm/utils/network_utils.py``, ``get_ip``);
- a worker node that dies fails the job at once: vLLM notices a remote worker
  only by an RPC timeout (``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS``, 300 s), so
  when the step ends the head stops its engine core, the shard's attempt ends
  ``workers_lost`` with its finished rows saved, and the retry resumes;
- Slurm's SIGTERM before the time limit (``--signal``) reaches the job's
  steps but not its batch step, where the head runs (the plugins run a
  multi-node rule's command there: ``MULTINODE_RESOURCES`` in
  workflow/rules/common.smk): the workers leave on it with exit status 0, and
  the head then stops as if the signal had reached it, saving its rows;
- workers leave with the head: ``close`` ends the step, and a head that was
  killed ends the batch script, whose end makes Slurm kill the step (headless
  workers would otherwise wait on their socket for ever).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any

from shardgen.base import gpus, jobenv, jobinfo
from shardgen.base.jobinfo import scontrol_jobs
from shardgen.errors import ShardgenError

log = logging.getLogger(__name__)

# The line a worker node prints with its GPUs, for the head's stats.
NODE_RECORD = "shardgen-node: "


class WorkersLost(ShardgenError):
    """The engine's workers on the job's other nodes ended while it ran."""

    outcome = "workers_lost"


class NotMultiNode(ShardgenError):
    """``resources.nodes`` > 1 outside a Slurm job over that many nodes."""

    outcome = "not_multi_node"


@dataclass(frozen=True)
class Head:
    """Where the workers reach the engine's first node."""

    nodes: int
    address: str
    port: int

    def engine_args(self, node_rank: int) -> dict[str, Any]:
        """What ``vllm.LLM`` (node 0) and each headless executor add to the engine's arguments."""
        return {"nnodes": self.nodes, "node_rank": node_rank, "master_addr": self.address,
                "master_port": self.port, "distributed_executor_backend": "mp"}  # fmt: skip


# -- Slurm's nodes and their addresses ---------------------------------------------------------------


def job_record() -> dict[str, str]:
    """``scontrol show job`` of this job (empty outside Slurm).

    Asked, not read from ``SLURM_*`` variables: the Slurm plugin's job step removes them from
    the rule's environment (snakemake-executor-plugin-slurm-jobstep, ``run_job``), all but the job id.
    """
    job_id = os.environ.get("SLURM_JOB_ID")
    jobs = scontrol_jobs(job_id) if job_id else []
    return jobs[0] if jobs else {}


def job_nodes() -> list[str]:
    """The job's nodes, in Slurm's order (the first runs the batch script); empty outside Slurm."""
    nodelist = job_record().get("NodeList")
    if not nodelist or nodelist == "(null)":
        return []
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
    return out.stdout.split()


def node_address(node: str) -> str:
    """The IPv4 address Slurm reaches ``node`` on (its ``NodeAddr``, resolved)."""
    out = subprocess.run(["scontrol", "show", "node", "-o", node], capture_output=True, text=True, check=False)
    fields = dict(f.split("=", 1) for f in out.stdout.split() if "=" in f)
    return socket.gethostbyname(fields.get("NodeAddr") or node)


def node_name() -> str:
    """This node's name in Slurm (two slurmd daemons on one machine have one host name)."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def interface_of(address: str) -> str | None:
    """The network interface that holds ``address`` on this machine."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addrs):
            return name
    return None


def node_environment(address: str) -> dict[str, str]:
    """This node's address for vLLM's sockets (``VLLM_HOST_IP``) and its interface for gloo and NCCL,
    where the user has not chosen one (a choice of theirs stays as it is, on every node)."""
    env = {"VLLM_HOST_IP": address}
    ifname = interface_of(address)
    if ifname:
        env.update({k: ifname for k in jobenv.IFNAME_VARS if not os.environ.get(k) or k in jobenv.set_here})
    return env


def free_port(address: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def this_job(nodes: int) -> list[str]:
    """The job's nodes, checked against ``resources.nodes``.

    Raises:
        NotMultiNode: not in a Slurm job, or in one over another number of nodes.
    """
    names = job_nodes()
    if len(names) != nodes:
        where = f"a Slurm job over {len(names)} node(s)" if names else "no Slurm job"
        raise NotMultiNode(
            f"resources.nodes is {nodes}, but this runs in {where}: run the workflow with the Slurm profile "
            "(snakemake --profile profiles/slurm), which asks for the nodes"
        )
    return names


# -- The head's side -------------------------------------------------------------------------------


class Workers:
    """The engine's workers on the job's other nodes: one ``srun`` step, watched.

    ``on_lost`` runs on the watching thread when the step ends before ``stop``: the head stops its
    engine core with it, so that the engine fails now rather than after vLLM's RPC timeout. Workers
    that ended with an error are ``lost``; workers that left on a signal raise it here too.
    """

    def __init__(self, head: Head, kwargs: dict[str, Any], nodes: list[str], gpus_per_node: int, on_lost) -> None:
        self.head = head
        self.nodes = nodes
        self.lost: str | None = None
        self.gpus: dict[str, list[dict[str, Any]]] = {}  # each worker node's GPUs, as it reported them
        self._stopping = False
        # not the head's own address, interfaces and cache: each node computes its own (jobenv)
        env = {**jobenv.for_other_nodes(), "SHARDGEN_ENGINE_ARGS": json.dumps(kwargs),
               "SHARDGEN_ENGINE_HEAD": json.dumps([head.nodes, head.address, head.port])}  # fmt: skip
        # the job's total (--gpus) read by srun as the step's own would ask for all of them on fewer
        # nodes: "Invalid generic resource (gres) specification" (Slurm 22.05); the step asks per node
        env.pop("SLURM_GPUS", None)
        others = len(nodes) - 1
        cmd = [
            shutil.which("srun") or "srun",
            f"--nodes={others}",
            f"--ntasks={others}",
            "--ntasks-per-node=1",
            "--relative=1",  # the nodes after this one
            "--kill-on-bad-exit=1",
            f"--job-name=engine-workers-{os.environ.get('SLURM_JOB_ID', '')}",
        ]
        cpus = job_record().get("CPUs/Task")
        if cpus and cpus.isdigit():
            cmd.append(f"--cpus-per-task={cpus}")
        cmd += [f"--gpus-per-node={gpus_per_node}", sys.executable, "-m", "shardgen.cli", "engine-worker"]
        log.info("starting the engine's workers on %s: %s", ", ".join(nodes[1:]), " ".join(cmd))
        self._proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
        self._on_lost = on_lost
        self._thread = threading.Thread(target=self._watch, name="engine-workers", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        for line in self._proc.stdout:  # the workers' output goes on to the job's log
            if line.startswith(NODE_RECORD):
                record = json.loads(line[len(NODE_RECORD) :])
                self.gpus[record["node"]] = record["gpus"]
            else:
                sys.stdout.write(line)
                sys.stdout.flush()
        code = self._proc.wait()
        if self._stopping:
            return
        if code == 0:
            # The workers left on a SIGTERM (they exit 0 then): Slurm's early --signal reaches a job's
            # steps but not its batch step, where this process runs. Stop as if it had come here. The
            # signal cannot be lost: the job's handler (stopflag.StopFlag, installed for the whole
            # job, between its shards too) only sets a flag, which the feed loop and the next shard
            # read, and raises during the engine's start, after setting it.
            log.warning("the engine's workers left on a signal from Slurm: stopping after saving finished rows")
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            self.lost = (
                f"the engine's workers on {', '.join(self.nodes[1:])} ended (srun exit status {code}) while it "
                "ran; the job's log has their output. The finished rows are saved and the retry resumes"
            )
            log.error("%s", self.lost)
        self._on_lost()  # the engine cannot go on without them

    def stop(self, timeout: float = 30.0) -> None:
        """End the step: its tasks get SIGTERM (the headless executors shut their workers down)."""
        self._stopping = True
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


def launch(kwargs: dict[str, Any], nodes: int, gpus_per_node: int, on_lost) -> tuple[dict[str, Any], Workers]:
    """Start the workers of the job's other nodes; return the head's engine arguments and them."""
    names = this_job(nodes)
    address = node_address(names[0])
    jobenv.apply(node_environment(address))  # before vLLM spawns its processes, which inherit it
    head = Head(nodes, address, free_port(address))
    workers = Workers(head, kwargs, names, gpus_per_node, on_lost)
    return {**kwargs, **head.engine_args(0)}, workers


def stop_engine_core() -> None:
    """Kill this process's engine core: vLLM's client notices its death at once and shuts itself down
    (``MPClient.start_engine_core_monitor``; ``Engine._workers_gone`` then wakes the request the job
    waits on, which that shutdown leaves waiting). A SIGTERM would not do:
    the engine core's handler only asks its busy loop to stop, and that loop waits for the lost
    workers' answer until the RPC timeout (``vllm/v1/engine/core.py``, ``run_engine_core``; seen here).

    Called once the workers' ``srun`` has ended, when the engine core (titled ``VLLM::EngineCore``) is
    this process's only child but multiprocessing's resource tracker, which stays. The engine core's
    own workers on this node leave when it dies (their death pipe, ``multiproc_executor.py``).
    """
    import psutil

    for child in psutil.Process().children():
        try:
            if "resource_tracker" not in " ".join(child.cmdline()):
                child.kill()
        except psutil.Error:
            pass


# -- A worker node's side --------------------------------------------------------------------------


def main_worker() -> int:
    """One node's headless executor: the workers of its GPUs, until the head ends the step."""
    kwargs = json.loads(os.environ.pop("SHARDGEN_ENGINE_ARGS"))
    nodes, address, port = json.loads(os.environ.pop("SHARDGEN_ENGINE_HEAD"))

    rank = int(os.environ["SLURM_PROCID"]) + 1  # the step runs on the job's nodes after the first (srun sets it)
    node = node_name()
    # this node's addresses and compile cache, not the head's
    jobenv.apply(node_environment(node_address(node)) | jobenv.node_caches(jobinfo.cache_root(jobinfo.host())))
    print(NODE_RECORD + json.dumps({"node": node, "gpus": gpus.describe_gpus()}), flush=True)
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    def leave(signum, _frame):
        raise SystemExit(0)  # the executor's finalizer stops its workers

    signal.signal(signal.SIGTERM, leave)
    signal.signal(signal.SIGINT, leave)
    args = _as_llm_makes_them({**kwargs, **Head(nodes, address, port).engine_args(rank)})
    log.info("node rank %d of %d: joining the engine at %s:%d", rank, nodes, address, port)
    config = EngineArgs(**args).create_engine_config(UsageContext.LLM_CLASS, headless=True)
    executor = MultiprocExecutor(config, monitor_workers=False)
    executor.start_worker_monitor(inline=True)  # returns when one of this node's workers dies
    log.error("node rank %d: a worker of this node ended; leaving the engine", rank)
    return 1


def _as_llm_makes_them(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``vllm.LLM``'s keyword arguments as ``LLM.__init__`` hands them to ``EngineArgs``
    (``vllm/entrypoints/llm.py``): its config sections made from dicts, its default of no stats
    logging; so that every node builds the same engine config as the head."""
    from vllm.config import AttentionConfig, CompilationConfig, ProfilerConfig, StructuredOutputsConfig, is_init_field

    out = {"disable_log_stats": True, **kwargs}
    sections = {"compilation_config": CompilationConfig, "structured_outputs_config": StructuredOutputsConfig,
                "profiler_config": ProfilerConfig, "attention_config": AttentionConfig}  # fmt: skip
    for key, cls in sections.items():
        value = out.get(key)
        if isinstance(value, dict):
            out[key] = cls(**{k: v for k, v in value.items() if is_init_field(cls, k)})
    return out
