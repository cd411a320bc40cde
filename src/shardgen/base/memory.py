"""Out-of-memory retries that help: tell the failure kinds apart, and step each setting the way that cures it.

vLLM 0.32 fails for memory in three ways, and each has its own cure
(messages from ``v1/core/kv_cache_utils.py`` ``_check_enough_kv_cache_memory``,
``v1/worker/utils.py`` ``request_memory``, ``v1/worker/cpu_worker.py``,
``v1/worker/gpu_model_runner.py``):

- ``kv_cache_too_small``: at start, the KV cache cannot hold one sequence of
  ``max_model_len`` tokens ("No available memory for the cache blocks", "...
  KV cache is needed, which is larger than the available KV cache memory").
  Cured by *more* memory for the cache: ``gpu_memory_utilization`` up by 0.05
  (at most 0.98), or ``kv_cache_memory_bytes`` doubled when the config sets it.
  Lowering ``max_model_len`` would also cure it, but changes which rows fit,
  so shardgen says so instead of doing it.
- ``device_memory_short``: at start, less memory is free than
  ``gpu_memory_utilization`` asks for (another process holds some: "Free
  memory on device ... is less than desired GPU memory utilization"; on the
  CPU build "Available memory on node ... less than desired CPU memory
  utilization"). Cured by asking for less: ``gpu_memory_utilization`` down by 0.05.
- ``weights_too_large``: CUDA ran out while loading the weights ("Failed to
  load model - not enough GPU memory", ``gpu_model_runner.py``
  ``GPUModelRunner.load_model``). The weights are loaded before the KV cache
  is allocated, so no memory setting cures it: more GPUs, a quantized
  checkpoint or a smaller model do. No step is taken, and a retry on the same
  GPUs with the same model and parallelism stops before it loads anything
  (``same_layout``).
- ``out_of_memory``: CUDA ran out while profiling, warming up the sampler
  or generating. Cured by a smaller batch: ``max_num_seqs`` halved and
  ``gpu_memory_utilization`` down by 0.05 (more room outside the KV cache),
  but never below what an earlier ``kv_cache_too_small`` raised it to: the
  steps converge instead of bouncing between the two (``overrides``).

Each retry takes one step from the settings the failed attempt actually used
(its engine's values, or vLLM's defaults for its GPUs where the engine never
started: ``max_num_seqs`` 1024 on GPUs of 70 GiB and more, ``EngineArgs.get_batch_defaults``;
``gpu_memory_utilization`` 0.92, ``CacheConfig``). The KV cache dtype stays what the config says.
On GPUs, what a retry changes (the batch size, the memory) can change a row's text in the last
digits of its logits, as the batch a row lands in does; ``model.batch_invariant`` makes the text
independent of both.
"""

from __future__ import annotations

import traceback
from typing import Any

from shardgen.base import jobinfo, records
from shardgen.errors import ShardgenError

# What vLLM and PyTorch print, lower-cased, per failure kind (first match wins).
FAILURE_PATTERNS = {
    "weights_too_large": ("failed to load model - not enough gpu memory",),
    "kv_cache_too_small": (
        "no available memory for the cache blocks",
        "larger than the available kv cache memory",
        "less than requested memory for kv",
    ),
    "device_memory_short": (
        "is less than desired gpu memory utilization",
        "is less than desired cpu memory utilization",
    ),
    "out_of_memory": ("out of memory", "outofmemoryerror", "insufficient memory", "not enough gpu memory"),
}
# The settings a memory failure is recorded with and a retry changes.
SETTINGS = ("max_num_seqs", "gpu_memory_utilization", "kv_cache_memory_bytes")
UTILIZATION_STEP = 0.05
UTILIZATION_MAX = 0.98
UTILIZATION_MIN = 0.5


def failure_kind(text: str) -> str | None:
    """Which memory failure ``text`` (a traceback and the job's log) reports, or None."""
    low = text.lower()
    for kind, patterns in FAILURE_PATTERNS.items():
        if any(p in low for p in patterns):
            return kind
    return None


def vllm_defaults(gpus: list[dict[str, Any]], world_size: int) -> dict[str, Any]:
    """The ``max_num_seqs`` and ``gpu_memory_utilization`` vLLM uses when the config leaves them unset,
    for these GPUs (vLLM's own ``EngineArgs.get_batch_defaults``, asked about the job's GPU instead of
    the platform it imports on; ``CacheConfig``'s default)."""
    from unittest import mock

    import vllm.engine.arg_utils as arg_utils
    from vllm.config import CacheConfig
    from vllm.usage.usage_lib import UsageContext

    utilization = CacheConfig().gpu_memory_utilization
    if not gpus:
        _, seqs = arg_utils.EngineArgs.get_batch_defaults(world_size)
        return {"max_num_seqs": seqs[UsageContext.LLM_CLASS], "gpu_memory_utilization": utilization}
    gpu = min(gpus, key=lambda g: g.get("memory_mib") or 0)

    class _JobGpu:
        def get_device_total_memory(self, device_id: int = 0) -> int:
            return (gpu.get("memory_mib") or 0) * 2**20

        def get_device_name(self, device_id: int = 0) -> str:
            return gpu.get("name") or ""

        def is_tpu(self) -> bool:
            return False

        def is_cpu(self) -> bool:
            return False

    with mock.patch.object(arg_utils, "current_platform", _JobGpu()):
        _, seqs = arg_utils.EngineArgs.get_batch_defaults(world_size)
    return {"max_num_seqs": seqs[UsageContext.LLM_CLASS], "gpu_memory_utilization": utilization}


def used_settings(model_cfg: dict[str, Any], defaults: dict[str, Any], llm: Any = None) -> dict[str, Any]:
    """The memory settings an attempt ran with: the running engine's own, else the config's, else vLLM's defaults."""
    if llm is not None:
        cfg = llm.llm_engine.vllm_config
        return {
            "max_num_seqs": cfg.scheduler_config.max_num_seqs,
            "gpu_memory_utilization": cfg.cache_config.gpu_memory_utilization,
            "kv_cache_memory_bytes": cfg.cache_config.kv_cache_memory_bytes,
        }
    return {k: model_cfg.get(k) if model_cfg.get(k) is not None else defaults.get(k) for k in SETTINGS}


def next_settings(kind: str, used: dict[str, Any]) -> dict[str, Any]:
    """The settings for the attempt after one that failed with ``kind`` while using ``used``: one step
    in the direction that cures it."""
    util = used.get("gpu_memory_utilization") or 0.92
    if kind == "weights_too_large":
        return {}
    if kind == "kv_cache_too_small":
        if used.get("kv_cache_memory_bytes"):
            return {"kv_cache_memory_bytes": int(used["kv_cache_memory_bytes"]) * 2}
        return {"gpu_memory_utilization": round(min(UTILIZATION_MAX, util + UTILIZATION_STEP), 3)}
    if kind == "device_memory_short":
        return {"gpu_memory_utilization": round(max(UTILIZATION_MIN, util - UTILIZATION_STEP), 3)}
    out: dict[str, Any] = {"gpu_memory_utilization": round(max(UTILIZATION_MIN, util - UTILIZATION_STEP), 3)}
    if used.get("max_num_seqs"):
        out["max_num_seqs"] = max(1, int(used["max_num_seqs"]) // 2)
    return out


def failures_of(attempts: list[records.Attempt]) -> list[dict[str, Any]]:
    """Earlier attempts that ran out of memory, oldest first: kind, stage, error, settings used, layout."""
    return [{"kind": a.kind, "stage": a.stage, "error": a.error, "settings": a.settings, "layout": a.layout}
            for a in attempts if a.outcome == records.OUT_OF_MEMORY]  # fmt: skip


def overrides(failures: list[dict[str, Any]]) -> dict[str, Any]:
    """What this attempt changes after ``failures`` (the attempts that ran out of memory, oldest
    first): the last failure's step from the settings it used, on top of the steps before it."""
    out: dict[str, Any] = {}
    floor = 0.0  # what the KV cache needed: a later failure of the batch halves the batch instead
    for failure in failures:
        step = next_settings(failure["kind"], failure["settings"])
        util = step.get("gpu_memory_utilization")
        if util is not None and failure["kind"] == "kv_cache_too_small":
            floor = max(floor, util)
        elif util is not None and util < floor:
            step["gpu_memory_utilization"] = floor
        out = {**out, **step}
    return out


# What decides whether a model's weights fit: a retry with the same stops at once.
LAYOUT_KEYS = ("model", "quantization", "dtype", "tensor_parallel_size", "pipeline_parallel_size")


def layout(model_kwargs: dict[str, Any], gpus: list[dict[str, Any]]) -> dict[str, Any]:
    """The model, its precision and parallelism, and the GPUs (names and memory) it was loaded on."""
    return {k: model_kwargs.get(k) for k in LAYOUT_KEYS} | {
        "gpus": sorted(f"{g.get('name')} {g.get('memory_mib')}" for g in gpus)
    }


def same_layout(failures: list[dict[str, Any]], current: dict[str, Any]) -> dict[str, Any] | None:
    """The last failure, when its weights did not fit with the layout this attempt would load."""
    last = failures[-1] if failures else None
    if last and last["kind"] == "weights_too_large" and last.get("layout") == current:
        return last
    return None


def advice(kind: str) -> str:
    """What to change in the config when retries do not cure it."""
    if kind == "weights_too_large":
        return (
            "the model's weights do not fit in the job's GPU memory: use more GPUs (model.tensor_parallel_size, "
            "with model.gpus), a quantized checkpoint (FP8, AWQ, GPTQ) or a smaller model; no memory setting "
            "cures it"
        )
    if kind == "kv_cache_too_small":
        return (
            "the KV cache cannot hold one sequence of model.max_model_len tokens: lower model.max_model_len "
            "(vLLM's message above estimates what fits), use more GPUs (tensor_parallel_size) or an FP8 KV cache "
            "(model.kv_cache_dtype: fp8)"
        )
    if kind == "device_memory_short":
        return "another process holds GPU memory: lower model.gpu_memory_utilization, or ask Slurm for whole GPUs"
    return "lower model.max_num_seqs and model.max_num_batched_tokens, or use more GPUs (tensor_parallel_size)"


# -- The error an attempt ends with -------------------------------------------------------------------


class OutOfMemory(ShardgenError):
    """The engine ran out of memory; the next attempt takes one step from the settings this one used.

    ``record``: the kind, the stage, the error and the settings, kept in the attempt's entry of
    ``attempts.jsonl``.
    """

    outcome = records.OUT_OF_MEMORY

    def __init__(self, message: str, record: dict[str, Any]) -> None:
        super().__init__(message)
        self.record = record

    def attempt_fields(self) -> dict[str, Any]:
        return self.record


def raise_if_memory(error: Exception, stage: str, used: dict[str, Any], log_start: int, layout: dict[str, Any]) -> None:
    """When ``error`` was memory running out, raise ``OutOfMemory``: the attempt's record keeps the
    kind of failure, the settings it used, from which the next attempt takes one step, and what
    it loaded on (``layout``)."""
    # the engine core runs in a child process, which writes the real cause to the job's log
    text = "".join(traceback.format_exception(error)) + jobinfo.own_log_tail(since=log_start)
    kind = failure_kind(text)
    if kind is None:
        return
    record = {"kind": kind, "stage": stage, "error": f"{type(error).__name__}: {error}"[:500], "settings": used,
              "layout": layout}  # fmt: skip
    if kind == "weights_too_large":
        raise OutOfMemory(f"the model's weights did not fit during {stage}: {advice(kind)}", record) from error
    raise OutOfMemory(
        f"{kind.replace('_', ' ')} during {stage} with {used}; the next attempt uses "
        f"{next_settings(kind, used)}. If it keeps failing: {advice(kind)}",
        record,
    ) from error
