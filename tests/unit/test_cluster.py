"""The Slurm side of 'nothing waits silently': sinfo's nodes against a job's request, squeue's
pending reasons. Parsing is tested on real output formats; the real scheduler in
tests/integration/test_slurm_checks.py."""

from types import SimpleNamespace

import pytest

from shardgen import cluster
from shardgen.cluster import PendingWatcher, Request, Unsatisfiable, check_request, parse_sinfo
from tests.conftest import base_config

# sinfo -h -N -o '%N|%P|%c|%m|%G|%l|%f|%t' on a cluster with two node kinds and a CPU partition
SINFO = """\
gpu01|gpu*|64|512000|gpu:h100:8(S:0-1)|2-00:00:00|h100,ib|mix
gpu02|gpu*|64|512000|gpu:h100:8(S:0-1)|2-00:00:00|h100,ib|idle
big01|gpu|128|1024000|gpu:h200:8(S:0-1),gpu:nvme:0|2-00:00:00|h200|idle
cpu01|cpu|32|128000|(null)|infinite|(null)|idle
"""


def test_sinfo_lines_become_nodes_with_typed_gpus_and_minutes():
    nodes = parse_sinfo(SINFO)
    assert [n.name for n in nodes] == ["gpu01", "gpu02", "big01", "cpu01"]
    assert nodes[0].gpus == {"h100": 8} and nodes[0].time_limit_min == 2880 and nodes[0].partition == "gpu"
    assert nodes[2].gpus == {"h200": 8} and nodes[3].gpus == {} and nodes[3].time_limit_min is None
    assert cluster.default_partition(SINFO) == "gpu"
    assert cluster.parse_gres("gpu:4") == {"": 4}


@pytest.mark.parametrize(
    ("text", "minutes"),
    [("30", 30), ("1:30:00", 90), ("1-00:00:00", 1440), ("45:30", 45.5), ("infinite", None), ("UNLIMITED", None)],
)
def test_slurm_time_limits_in_minutes(text, minutes):
    assert cluster.parse_time_limit(text) == minutes


def test_a_request_some_node_can_run_passes():
    check_request(parse_sinfo(SINFO), Request(gpus=8, cpus=100, mem_mb=900000, runtime_min=600, partition="gpu"))


def test_more_cpus_than_any_node_has_is_refused_with_both_numbers():
    with pytest.raises(Unsatisfiable) as e:
        check_request(parse_sinfo(SINFO), Request(gpus=1, cpus=200, mem_mb=1000, runtime_min=60), default="gpu")
    text = str(e.value)
    assert "asks for 1 GPU(s), 200 CPUs, 1000 MB memory, 60 min" in text
    assert "2 node(s) (gpu01, gpu02): 64 CPUs, 512000 MB memory, GPUs h100:8, time limit 2880 min" in text
    assert "1 node(s) (big01): 128 CPUs" in text and "short of CPUs" in text
    assert "PartitionConfig" in text


@pytest.mark.parametrize(
    ("request_", "short"),
    [
        (Request(gpus=9, cpus=8, mem_mb=1000, runtime_min=60, partition="gpu"), "short of GPUs"),
        (Request(gpus=1, cpus=8, mem_mb=2_000_000, runtime_min=60, partition="gpu"), "short of memory"),
        (Request(gpus=1, cpus=8, mem_mb=1000, runtime_min=5000, partition="gpu"), "short of time"),
        (Request(gpus=1, cpus=8, mem_mb=1000, runtime_min=60, partition="cpu"), "short of GPUs"),
        (Request(gpus=1, cpus=8, mem_mb=1000, runtime_min=60, partition="gpu", gpu_model="b200"), "short of GPUs"),
        (Request(gpus=1, cpus=8, mem_mb=1000, runtime_min=60, partition="gpu", constraint="a100"), "feature a100"),
    ],
)
def test_each_kind_of_shortfall_is_named(request_, short):
    with pytest.raises(Unsatisfiable, match=short):
        check_request(parse_sinfo(SINFO), request_)


def test_an_unknown_partition_is_refused_naming_the_known_ones():
    with pytest.raises(Unsatisfiable, match="partition 'gpus' has no nodes .*cpu, gpu"):
        check_request(parse_sinfo(SINFO), Request(gpus=1, cpus=8, mem_mb=1000, runtime_min=60, partition="gpus"))


def test_the_request_takes_the_run_config_then_the_profile_per_rule_over_it():
    run = base_config({"parquet": ["x.parquet"]}, resources={"cpus_per_task": 12, "mem_mb": 64000, "runtime": 90})
    settings = SimpleNamespace(
        default_resources={"slurm_partition": "'gpu'", "gpu_model": "h100"},
        overwrite_resources={"generate_shard": {"mem_mb": 128000}},
    )
    req = cluster.generate_request(run, settings, "generate_shard", 90)
    assert (req.cpus, req.mem_mb, req.runtime_min, req.partition, req.gpu_model) == (12, 128000, 90, "gpu", "h100")
    assert cluster.partition_time_limit(parse_sinfo(SINFO), req.partition, None) == 2880


SQUEUE = """\
101|PENDING|PartitionConfig|uuid|rule_generate_shard_wildcards_00001|2026-12-03T10:00:00|/work/run
102|PENDING|Priority|uuid|rule_generate_shard_wildcards_00002|2026-12-03T10:00:00|/work/run
103|PENDING|PartitionConfig|uuid|rule_generate_shard_wildcards_00003|2026-12-03T10:00:00|/elsewhere
"""


def test_a_job_of_this_run_pending_for_a_reason_that_never_resolves_stops_the_run_once():
    stopped = []
    w = PendingWatcher("/work/run", stop=stopped.append, run=lambda argv: SQUEUE)
    notes = w.poll()
    assert len(stopped) == 1 and "Slurm job 101" in stopped[0] and "PartitionConfig" in stopped[0]
    assert notes == stopped
    w.poll()
    assert len(stopped) == 1  # the job of another directory (103) is not this run's


def test_a_job_pending_for_long_for_any_reason_is_reported_again_every_interval():
    clock = [0.0]
    w = PendingWatcher("/work/run", stop=pytest.fail, run=lambda argv: SQUEUE.splitlines()[1],
                       clock=lambda: clock[0], stuck_after_s=100)  # fmt: skip
    assert w.poll() == []
    clock[0] = 150
    assert ["pending for 2 min (reason: Priority)" in n for n in w.poll()] == [True]
    clock[0] = 200
    assert w.poll() == []
    clock[0] = 260
    assert len(w.poll()) == 1


def test_a_failing_squeue_reports_nothing_and_stops_nothing():
    def broken(argv):
        raise OSError("squeue: not found")

    assert PendingWatcher("/work/run", stop=pytest.fail, run=broken).poll() == []


def test_cancelling_a_run_cancels_by_id_only_its_own_unfinished_jobs():
    queue = """\
201|RUNNING|None|uuid|rule_generate_shard_wildcards_00001|2026-12-03T10:00:00|/work/run
202|PENDING|PartitionConfig|uuid|rule_generate_shard_wildcards_00002|2026-12-03T10:00:00|/work/run
203|COMPLETED|None|uuid|rule_generate_shard_wildcards_00003|2026-12-03T10:00:00|/work/run
204|PENDING|Priority|uuid|rule_generate_shard_wildcards_00004|2026-12-03T10:00:00|/elsewhere
205|PENDING|Priority|uuid|rule_generate_shardsX_wildcards_00005|2026-12-03T10:00:00|/work/run
206|RUNNING|None|other|my-own-job|2026-12-03T10:00:00|/work/run
207|PENDING|Priority|uuid|rule_merge_shards|2026-12-03T10:00:00|/work/run
"""
    calls = []

    def run(argv):
        calls.append(argv)
        return queue if argv[0] == "squeue" else ""

    rules = ["generate_shard", "merge_shards"]
    assert cluster.cancel_run_jobs("/work/run", rules, run=run) == ["201", "202", "207"]
    assert calls[-1] == ["scancel", "201", "202", "207"]
    calls.clear()
    assert cluster.cancel_run_jobs("/nothing/here", rules, run=run) == []
    assert [argv[0] for argv in calls] == ["squeue"], "no scancel without a job"


def test_a_run_is_warned_of_an_earlier_runs_jobs_still_in_slurm_with_their_ids():
    queue = """\
301|RUNNING|None|old-uuid|rule_generate_shard_wildcards_00001|2026-12-03T10:00:00|/work/run
302|COMPLETED|None|old-uuid|rule_generate_shard_wildcards_00002|2026-12-03T10:00:00|/work/run
"""
    text = cluster.earlier_jobs_warning("/work/run", ["generate_shard"], run=lambda argv: queue)
    assert "1 Slurm job(s) of an earlier run" in text and "scancel 301" in text
    assert cluster.earlier_jobs_warning("/elsewhere", ["generate_shard"], run=lambda argv: queue) is None

    def broken(argv):
        raise OSError("squeue: not found")

    assert cluster.earlier_jobs_warning("/work/run", ["generate_shard"], run=broken) is None
