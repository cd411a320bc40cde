"""One engine across several nodes (resources.nodes): the layout's rules, what Slurm is asked for,
and what each node passes vLLM. The launch itself runs on the real Slurm and engine in
tests/integration/test_multinode.py (a module name of its own: pytest imports both by basename)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from shardgen import cluster
from shardgen.cluster import Request, Unsatisfiable, check_request, parse_sinfo
from shardgen.engines import multinode
from shardgen.errors import ConfigError
from tests.conftest import base_config

SINFO = """\
gpu01|gpu*|64|512000|gpu:h100:8(S:0-1)|2-00:00:00|h100,ib|idle
gpu02|gpu*|64|512000|gpu:h100:8(S:0-1)|2-00:00:00|h100,ib|idle
big01|big|128|1024000|gpu:h200:8(S:0-1)|2-00:00:00|h200|idle
"""


def test_two_nodes_split_the_pipeline_stages_and_keep_tensor_parallelism_inside_a_node():
    run = base_config({"parquet": ["x.parquet"]}, model={"tensor_parallel_size": 8, "pipeline_parallel_size": 2},
                      resources={"nodes": 2})  # fmt: skip
    assert run.model.gpus == 16 and run.gpus_per_node == 8
    assert run.cpus_per_job == 4 + 2 * 8, "CPUs per node follow the GPUs of a node"
    one = base_config({"parquet": ["x.parquet"]}, model={"tensor_parallel_size": 2, "pipeline_parallel_size": 2})
    assert one.resources.nodes == 1 and one.gpus_per_node == 4


@pytest.mark.parametrize(("tp", "pp", "nodes"), [(8, 1, 2), (4, 3, 2)])
def test_nodes_that_do_not_divide_the_pipeline_stages_are_a_config_error_naming_both_keys(tp, pp, nodes):
    message = rf"resources.nodes \({nodes}\) must divide model.pipeline_parallel_size \({pp}\)"
    with pytest.raises(ConfigError, match=message):
        base_config({"parquet": ["x.parquet"]}, model={"tensor_parallel_size": tp, "pipeline_parallel_size": pp},
                    resources={"nodes": nodes})  # fmt: skip


def test_a_job_over_two_nodes_asks_slurm_for_the_same_gpus_on_each_and_one_task_per_node():
    run = base_config({"parquet": ["x.parquet"]}, model={"tensor_parallel_size": 8, "pipeline_parallel_size": 2},
                      resources={"nodes": 2})  # fmt: skip
    assert cluster.multinode_options(run, None) == ["--gpus-per-node=8", "--ntasks-per-node=1"]
    assert cluster.multinode_options(run, "h100")[0] == "--gpus-per-node=h100:8"


def test_two_nodes_of_eight_gpus_fit_a_partition_with_two_such_nodes_and_not_one_with_one():
    req = Request(gpus=8, cpus=20, mem_mb=100000, runtime_min=600, partition="gpu", nodes=2)
    check_request(parse_sinfo(SINFO), req)
    with pytest.raises(Unsatisfiable, match=r"2 nodes, each with 8 GPU\(s\).*only 1 node\(s\) of partition 'big'"):
        check_request(parse_sinfo(SINFO), Request(**{**req.__dict__, "partition": "big"}))
    with pytest.raises(Unsatisfiable, match=r"short of GPUs"):
        check_request(parse_sinfo(SINFO), Request(**{**req.__dict__, "gpus": 16}))


def test_every_node_passes_vllm_the_head_s_rendezvous_and_its_own_rank():
    head = multinode.Head(nodes=2, address="10.0.0.5", port=41234)
    assert head.engine_args(1) == {"nnodes": 2, "node_rank": 1, "master_addr": "10.0.0.5", "master_port": 41234,
                                   "distributed_executor_backend": "mp"}  # fmt: skip


def test_a_node_binds_to_the_interface_that_holds_its_slurm_address_and_a_user_s_choice_is_kept(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    env = multinode.node_environment("127.0.0.1")
    assert env == {"VLLM_HOST_IP": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo"}, "the user's NCCL_SOCKET_IFNAME stays"
    assert multinode.interface_of("192.0.2.1") is None  # TEST-NET: no interface here holds it


def test_more_than_one_node_outside_a_slurm_job_over_that_many_nodes_is_refused_naming_the_key(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
    with pytest.raises(multinode.NotMultiNode, match=r"resources.nodes is 2, but this runs in no Slurm job"):
        multinode.this_job(2)


def test_the_workers_build_the_engine_arguments_as_vllm_llm_does():
    """vllm/entrypoints/llm.py, LLM.__init__: dict sections become config objects, stats logging off."""
    from vllm.config import CompilationConfig

    args = multinode._as_llm_makes_them({"model": "m", "compilation_config": {"cudagraph_capture_sizes": [1, 2]}})
    assert isinstance(args["compilation_config"], CompilationConfig)
    assert args["compilation_config"].cudagraph_capture_sizes == [1, 2]
    assert args["disable_log_stats"] is True and args["model"] == "m"


def test_the_guide_s_two_node_config_is_valid_and_asks_for_two_nodes_of_eight_gpus():
    import re

    import yaml

    from tests.conftest import ROOT

    guide = (ROOT / "docs" / "deployment.md").read_text().split("### A model across nodes", 1)[1]
    block = yaml.safe_load(re.search(r"```yaml\n(.*?)```", guide, re.S).group(1))
    run = base_config({"parquet": ["x.parquet"]}, model=block["model"], resources=block["resources"])
    assert run.resources.nodes == 2 and run.gpus_per_node == 8 and run.model.gpus == 16


def fake_srun(tmp_path, monkeypatch, script: str) -> None:
    """An ``srun`` first on PATH that runs ``script`` (the real one runs in tests/integration)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/sh\n" + script)
    (bin_dir / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)


def test_workers_that_die_are_lost_and_stop_the_engine_and_their_gpus_and_output_come_through(
    tmp_path, monkeypatch, capfd
):
    fake_srun(tmp_path, monkeypatch, 'echo \'shardgen-node: {"node": "n1", "gpus": [{"name": "H100"}]}\'\n'
              "echo loading weights\nexit 137\n")  # fmt: skip
    stopped = threading.Event()
    workers = multinode.Workers(multinode.Head(2, "127.0.0.1", 1), {"model": "m"}, ["n0", "n1"], 8, stopped.set)
    assert stopped.wait(30), "the engine was stopped when the workers died"
    assert "ended (srun exit status 137)" in workers.lost and "n1" in workers.lost
    assert workers.gpus == {"n1": [{"name": "H100"}]}
    assert "loading weights" in capfd.readouterr().out


def test_worker_nodes_compute_their_own_interfaces_and_cache_and_keep_what_the_user_set(tmp_path, monkeypatch):
    """The head sets its own address, interfaces and compile cache before it starts the workers'
    srun step, which copies its environment: a worker whose interface is ens3f0 must not get the
    head's eno1, nor cache under the head's directory. A user's own choice reaches every node."""
    from shardgen.base import jobenv

    monkeypatch.setattr(jobenv, "set_here", set())
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "ib0")  # the user's
    for name in ("VLLM_HOST_IP", "NCCL_SOCKET_IFNAME", "VLLM_CACHE_ROOT"):
        monkeypatch.setenv(name, "")  # so that the test's end removes what apply sets below
        monkeypatch.delenv(name)
    jobenv.apply({"VLLM_CACHE_ROOT": "/local/head/vllm"})  # the head's engine settings
    jobenv.apply({"VLLM_HOST_IP": "10.0.0.5", "NCCL_SOCKET_IFNAME": "eno1"})  # the head's node_environment
    out = tmp_path / "worker-env"
    seen = "$VLLM_HOST_IP|$NCCL_SOCKET_IFNAME|$GLOO_SOCKET_IFNAME|$VLLM_CACHE_ROOT"
    fake_srun(tmp_path, monkeypatch, f'echo "{seen}" > {out}\nexit 1\n')
    ended = threading.Event()
    multinode.Workers(multinode.Head(2, "10.0.0.5", 1), {"model": "m"}, ["n0", "n1"], 8, ended.set)
    assert ended.wait(30)
    assert out.read_text().strip() == "||ib0|", "only the user's own setting reached the worker node"


def test_workers_that_leave_with_status_0_pass_slurm_s_signal_on_to_the_head(tmp_path, monkeypatch):
    """--signal reaches the job's steps, not the batch step the head runs in."""
    fake_srun(tmp_path, monkeypatch, "exit 0\n")
    got, stopped = [], threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: got.append(signum))
    try:
        workers = multinode.Workers(multinode.Head(2, "127.0.0.1", 1), {}, ["n0", "n1"], 8, stopped.set)
        assert stopped.wait(30)
        deadline = time.time() + 10
        while not got and time.time() < deadline:
            time.sleep(0.05)  # the handler runs on the main thread
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert got == [signal.SIGTERM] and workers.lost is None


def test_workers_stopped_by_the_head_are_not_lost(tmp_path, monkeypatch):
    fake_srun(tmp_path, monkeypatch, "trap 'exit 0' TERM\nwhile :; do sleep 0.1; done\n")
    stopped = threading.Event()
    workers = multinode.Workers(multinode.Head(2, "127.0.0.1", 1), {}, ["n0", "n1"], 8, stopped.set)
    workers.stop(timeout=10)
    assert workers.lost is None and not stopped.wait(1)
