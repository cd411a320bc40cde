"""Engine settings: pass-through of config keys, and what a retry after an out-of-memory changes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from shardgen.base import memory
from shardgen.engines.kinds import engine_kwargs


def test_engine_kwargs_drop_nulls_add_extra_and_turn_on_request_metrics():
    kw = engine_kwargs({"model": "m", "max_model_len": None, "dtype": "auto", "extra": {"swap_space": 2}})
    assert kw == {"model": "m", "dtype": "auto", "swap_space": 2, "disable_log_stats": False}


# vLLM 0.32.0's own messages (v1/core/kv_cache_utils.py _check_enough_kv_cache_memory, v1/worker/utils.py
# request_memory, v1/worker/gpu_model_runner.py), as they reach a job's log.
RECORDED = {
    "kv_cache_too_small": [
        "ValueError: To serve at least one request with the model's max seq len (1024), (0.04 GiB KV cache is "
        "needed, which is larger than the available KV cache memory (0.01 GiB). Based on the available memory, "
        "the estimated maximum model length is 256. Try increasing `gpu_memory_utilization` (which also controls "
        "CPU memory on the CPU backend) or decreasing `max_model_len` when initializing the engine.",
        "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
        "initializing the engine (this flag also controls CPU memory reservation on the CPU backend).",
    ],
    "device_memory_short": [
        "ValueError: Free memory on device cuda:0 (60.1/79.2 GiB) on startup is less than desired GPU memory "
        "utilization (0.92, 72.9 GiB). Decrease GPU memory utilization or reduce GPU memory used by other processes.",
    ],
    # vllm/v1/worker/gpu_model_runner.py, GPUModelRunner.load_model: logged before the error is raised on
    "weights_too_large": [
        "ERROR Failed to load model - not enough GPU memory. Try lowering --gpu-memory-utilization to free memory "
        "for weights, increasing --tensor-parallel-size, or using --quantization. (original error: CUDA out of "
        "memory. Tried to allocate 1.75 GiB. GPU 0 has a total capacity of 79.19 GiB)",
    ],
    "out_of_memory": [
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79 GiB",
        "RuntimeError: CUDA out of memory occurred when warming up sampler with 1024 dummy requests. Please try "
        "lowering `max_num_seqs` or `gpu_memory_utilization` when initializing the engine.",
    ],
}


def test_each_kind_of_memory_failure_is_told_apart_from_vllms_own_messages():
    for kind, messages in RECORDED.items():
        for message in messages:
            assert memory.failure_kind(message) == kind, message
    assert memory.failure_kind("FileNotFoundError: models/x/config.json") is None


def test_a_kv_cache_too_small_for_one_sequence_gets_more_memory_not_less():
    used = {"max_num_seqs": 1024, "gpu_memory_utilization": 0.92, "kv_cache_memory_bytes": None}
    assert memory.next_settings("kv_cache_too_small", used) == {"gpu_memory_utilization": 0.97}
    higher = {**used, "gpu_memory_utilization": 0.97}
    assert memory.next_settings("kv_cache_too_small", higher) == {"gpu_memory_utilization": 0.98}
    set_bytes = {**used, "kv_cache_memory_bytes": 32 * 2**20}
    assert memory.next_settings("kv_cache_too_small", set_bytes) == {"kv_cache_memory_bytes": 64 * 2**20}


def test_out_of_memory_halves_the_batch_the_engine_used_and_leaves_more_room_outside_the_cache():
    # an H100's offline default is 1024 sequences: the first retry runs 512, not 128
    used = {"max_num_seqs": 1024, "gpu_memory_utilization": 0.92, "kv_cache_memory_bytes": None}
    assert memory.next_settings("out_of_memory", used) == {"max_num_seqs": 512, "gpu_memory_utilization": 0.87}
    assert memory.next_settings("device_memory_short", used) == {"gpu_memory_utilization": 0.87}
    low = {"max_num_seqs": 1, "gpu_memory_utilization": 0.5}
    assert memory.next_settings("out_of_memory", low) == {"max_num_seqs": 1, "gpu_memory_utilization": 0.5}


def test_retries_step_from_what_the_last_failed_attempt_used():
    first = {"kind": "kv_cache_too_small", "settings": {"max_num_seqs": 256, "gpu_memory_utilization": 0.9}}
    second = {"kind": "out_of_memory", "settings": {"max_num_seqs": 256, "gpu_memory_utilization": 0.95}}
    assert memory.overrides([]) == {}
    assert memory.overrides([first]) == {"gpu_memory_utilization": 0.95}
    # the cache needed 0.95: the batch is halved instead of giving its memory back
    assert memory.overrides([first, second]) == {"gpu_memory_utilization": 0.95, "max_num_seqs": 128}


def test_alternating_cache_and_batch_failures_converge_instead_of_bouncing():
    """A KV cache raised to 0.97, then out of memory in CUDA-graph capture, used to go back to 0.92,
    where the cache was too small again: retries bounced until they were spent."""
    failures, used = [], {"max_num_seqs": 1024, "gpu_memory_utilization": 0.92}
    seen = []
    for kind in ["kv_cache_too_small", "out_of_memory"] * 3:
        failures.append({"kind": kind, "settings": dict(used)})
        used = {**used, **memory.overrides(failures)}
        seen.append((used["gpu_memory_utilization"], used["max_num_seqs"]))
    assert [u for u, _ in seen] == sorted(u for u, _ in seen), f"the memory only goes up: {seen}"
    assert seen[-1] == (0.98, 128)


def test_weights_that_do_not_fit_take_no_step_and_a_retry_on_the_same_gpus_stops_before_loading():
    gpus = [{"name": "NVIDIA H100 80GB HBM3", "memory_mib": 81559}]
    layout = memory.layout({"model": "big-70b", "tensor_parallel_size": 1, "pipeline_parallel_size": 1}, gpus)
    failure = {"kind": "weights_too_large", "settings": {"gpu_memory_utilization": 0.92}, "layout": layout}
    assert memory.next_settings("weights_too_large", failure["settings"]) == {} and memory.overrides([failure]) == {}
    assert memory.same_layout([failure], layout) is failure
    more = memory.layout({"model": "big-70b", "tensor_parallel_size": 4, "pipeline_parallel_size": 1}, gpus * 4)
    assert memory.same_layout([failure], more) is None, "more GPUs: worth loading again"
    assert "tensor_parallel_size" in memory.advice("weights_too_large")


@pytest.mark.parametrize(
    ("name", "mib", "seqs"),
    [
        ("NVIDIA H100 80GB HBM3", 81559, 1024),
        ("NVIDIA H200", 143771, 1024),
        ("NVIDIA RTX PRO 6000 Blackwell Server Edition", 97887, 1024),
        ("NVIDIA A100-SXM4-80GB", 81920, 256),
        ("NVIDIA L40S", 46068, 256),
    ],
)
def test_vllms_own_default_batch_for_each_gpu_is_what_a_retry_starts_from(name, mib, seqs):
    """vLLM's EngineArgs.get_batch_defaults, asked about the job's GPU on the CPU build."""
    gpu = {"name": name, "memory_mib": mib}
    defaults = memory.vllm_defaults([gpu], 1)
    assert defaults == {"max_num_seqs": seqs, "gpu_memory_utilization": 0.92}
    used = memory.used_settings({"max_num_seqs": None, "gpu_memory_utilization": None}, defaults)
    assert used["max_num_seqs"] == seqs and used["kv_cache_memory_bytes"] is None


def test_a_rows_seed_depends_on_the_run_seed_and_the_row_id_only():
    from shardgen.engines.kinds import row_seed

    assert row_seed(1, "r00001") == row_seed(1, "r00001")
    assert row_seed(1, "r00001") != row_seed(2, "r00001") != row_seed(1, "r00002")
    assert 0 <= row_seed(123, 10**9) < 2**62


# row_seed(7, "r00001"), row_seed(7, 12), row_seed(0, "r00001"), as blake2b gives them: any process, any machine.
EXPECTED_SEEDS = ["1354073146287614557", "3682996439558678303", "2094624078275236626"]


def test_row_seeds_are_fixed_values_whatever_the_process_and_its_hash_seed():
    """Seeds must not come from Python's per-process hash(): the same fixed values in fresh processes."""
    code = (
        "from shardgen.engines.kinds import row_seed; "
        "print(row_seed(7, 'r00001'), row_seed(7, 12), row_seed(0, 'r00001'))"
    )
    results = [
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        for seed in ("1", "2")
    ]
    assert results[0] == results[1] == EXPECTED_SEEDS


def test_no_out_of_memory_retry_changes_what_decides_a_rows_text():
    """A retry steps only runtime settings: the fingerprint (and a row's precision) stays what it was."""
    from shardgen.config import RUNTIME_MODEL_KEYS

    used = {"max_num_seqs": 1024, "gpu_memory_utilization": 0.92, "kv_cache_memory_bytes": 2**30}
    for kind in memory.FAILURE_PATTERNS:
        assert set(memory.next_settings(kind, used)) <= RUNTIME_MODEL_KEYS, kind


# -- The settings of a job on a GPU (nvidia-smi output as in test_gpus.py; vLLM's CPU build) ---------------------

H100_550 = "0, GPU-5d5ba0d6-1a2b-3c4d-5e6f-000000000000, NVIDIA H100 80GB HBM3, 81559, 550.54.15, 9.0\n"
H100_580 = "0, GPU-5d5ba0d6-1a2b-3c4d-5e6f-000000000000, NVIDIA H100 80GB HBM3, 81559, 580.65.06, 9.0\n"
V100 = "0, GPU-12345678-1234-1234-1234-123456789012, Tesla V100-SXM2-32GB, 32768, 580.65.06, 7.0\n"


def job_settings(monkeypatch, tmp_path, smi: str | None = None, cuda: str | None = None, **model):
    from shardgen.base import gpus, kernels
    from shardgen.config import RunConfig
    from shardgen.engines import kinds as engine
    from tests.conftest import MODEL

    if smi is not None:
        monkeypatch.setattr(engine, "vllm_build", lambda: "cuda")
        monkeypatch.setattr(gpus, "describe_gpus", lambda *a, **k: gpus.parse_nvidia_smi(smi))
        monkeypatch.setattr(kernels, "torch_cuda", lambda: cuda)
    monkeypatch.delenv("VLLM_CACHE_ROOT", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    config = RunConfig.from_dict(
        {
            "input": {"parquet": ["x.parquet"]},
            "prompt": {"template": "{{ t }}"},
            "model": {"model": str(MODEL), **model},
        }
    )
    return engine.EngineSettings.for_job(config, {"path": str(MODEL)}, [])


def test_a_job_spawns_vllms_processes_and_keeps_its_caches_per_node(monkeypatch, tmp_path):
    from shardgen.base import jobinfo

    for name in ("FLASHINFER_WORKSPACE_BASE", "TRITON_CACHE_DIR", "FLASHINFER_NO_DOWNLOAD"):
        monkeypatch.delenv(name, raising=False)
    settings = job_settings(monkeypatch, tmp_path)
    root = str(tmp_path / "vllm" / "shardgen-nodes" / jobinfo.host())
    assert settings.environment == {
        "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
        "VLLM_CACHE_ROOT": root,
        "FLASHINFER_WORKSPACE_BASE": root,  # FlashInfer's JIT kernels: <root>/.cache/flashinfer
        "TRITON_CACHE_DIR": f"{root}/triton",
        "FLASHINFER_NO_DOWNLOAD": "1",  # a compute node downloads no kernel: a missing one fails at once
    }
    monkeypatch.setenv("VLLM_CACHE_ROOT", "/scratch/mine")  # the documented override
    from shardgen.base.jobinfo import cache_root

    assert cache_root("node17") == "/scratch/mine"


def test_batch_invariance_is_an_environment_switch_for_the_engine_and_not_an_engine_argument(monkeypatch, tmp_path):
    settings = job_settings(monkeypatch, tmp_path, H100_580, "13.0", batch_invariant=True)
    assert settings.environment["VLLM_BATCH_INVARIANT"] == "1"
    assert "batch_invariant" not in settings.kwargs


def test_a_node_whose_driver_is_too_old_for_the_cuda_build_stops_before_the_engine(monkeypatch, tmp_path):
    from shardgen.engines.kinds import WrongGpus

    with pytest.raises(WrongGpus, match=r"driver on this node is 550.54.15.*CUDA 13.0, which needs driver 580.00"):
        job_settings(monkeypatch, tmp_path, H100_550, "13.0")
    assert job_settings(monkeypatch, tmp_path, H100_580, "13.0").gpus[0]["driver"] == "580.65.06"


def test_batch_invariance_on_gpus_without_its_kernels_stops_before_the_engine(monkeypatch, tmp_path):
    from shardgen.engines.kinds import WrongGpus

    with pytest.raises(WrongGpus, match=r"model.batch_invariant: Tesla V100-SXM2-32GB has compute capability 7.0"):
        job_settings(monkeypatch, tmp_path, V100, "13.0", batch_invariant=True)


def test_a_job_on_another_vllm_than_the_supported_one_stops_naming_both(monkeypatch, tmp_path):
    from shardgen.base import installed
    from shardgen.engines.kinds import UnsupportedVllm

    monkeypatch.setattr(installed, "vllm", lambda: ("cuda", "0.33.1"))
    with pytest.raises(UnsupportedVllm, match=r"vLLM 0.33.1 is installed, and shardgen supports vLLM 0.32.0"):
        job_settings(monkeypatch, tmp_path)


def test_an_engine_the_handle_started_is_started_again_only_for_other_settings_and_a_wrapped_one_never(monkeypatch):
    """A worker runs many shards on one handle: the same settings reuse the engine; a shard whose
    earlier attempts ran out of memory (lower settings) gets a new one, once the old one ended on its
    own (vLLM's grace: it releases the memory the next one needs); an engine handed in is kept. The
    job's last stop kills the processes at once (its rows are committed)."""
    import types

    import vllm

    from shardgen.engines.kinds import EngineSettings
    from shardgen.engines.vllm import STOP_WAIT_SECONDS, Engine

    started, stopped, waits = [], [], []

    class FakeLLM:
        def __init__(self, **kwargs):
            started.append(kwargs)

            def shutdown(timeout=None):
                stopped.append(kwargs)
                waits.append(timeout)

            self.llm_engine = types.SimpleNamespace(engine_core=types.SimpleNamespace(shutdown=shutdown))

    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    base = {"model": "/m", "max_num_seqs": 8}
    handle = Engine()
    first = handle.start(EngineSettings(model=base))
    assert handle.start(EngineSettings(model=dict(base))) is first and handle.starts == 1
    second = handle.start(EngineSettings(model={**base, "max_num_seqs": 4}))
    assert second is not first and handle.starts == 2 and stopped == [started[0]]
    handle.close()
    assert stopped == started
    assert waits == [None, STOP_WAIT_SECONDS] == [None, 0]

    wrapped = FakeLLM(**base)
    shared = Engine(wrapped)
    assert shared.start(EngineSettings(model={**base, "max_num_seqs": 4})) is wrapped and shared.starts == 0
    shared.close()
    assert len(stopped) == 2, "a wrapped engine is left running"


def test_the_engine_counts_what_stats_read_in_place_of_its_prometheus_logger():
    """Stats logging on (each request's time to first token) records every step into vLLM's Prometheus
    histograms; a job reads six sums of them. The handle puts its own counters in the Prometheus
    logger's place (once per engine, however many handles wrap it), beside vLLM's other loggers."""
    import types

    from vllm.v1.metrics.loggers import PrometheusStatLogger

    from shardgen.engines.vllm import Engine

    prometheus = object.__new__(PrometheusStatLogger)  # the type is what is looked at
    line = types.SimpleNamespace(name="vLLM's log line")
    manager = types.SimpleNamespace(stat_loggers=[line, prometheus])
    llm = types.SimpleNamespace(llm_engine=types.SimpleNamespace(logger_manager=manager))
    engine = Engine(llm)
    assert manager.stat_loggers[0] is line and len(manager.stat_loggers) == 2
    (counters,) = manager.stat_loggers[1:]
    assert Engine(llm).counters() == engine.counters() and manager.stat_loggers[1] is counters, "one per engine"

    def step(hits, queries, preempted, spec=None):
        scheduler = types.SimpleNamespace(
            prefix_cache_stats=types.SimpleNamespace(hits=hits, queries=queries), spec_decoding_stats=spec
        )
        counters.record(scheduler, types.SimpleNamespace(num_preempted_reqs=preempted), mm_cache_stats=None)

    step(3, 10, 0)
    step(5, 8, 1, types.SimpleNamespace(num_drafts=2, num_draft_tokens=6, num_accepted_tokens=4))
    counters.record(None, None)  # a step without stats
    assert engine.counters() == {
        "preemptions": 1,
        "prefix_cache_queries": 18,
        "prefix_cache_hits": 8,
        "spec_decode_drafts": 2,
        "spec_decode_draft_tokens": 6,
        "spec_decode_accepted_tokens": 4,
    }
    counters.log(), counters.log_engine_initialized(), counters.record_sleep_state(1, 0)  # the manager calls them
    no_stats = types.SimpleNamespace(llm_engine=types.SimpleNamespace(logger_manager=None))
    assert Engine(no_stats).counters() == {} and Engine(object()).counters() == {}
