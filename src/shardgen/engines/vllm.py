"""The vLLM engine in this process (``engine.kind: vllm``): one handle on it however it was started,
vLLM's request parameters, its counters, and what the preflight asks of the installed vLLM.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from shardgen.base import memory
from shardgen.engines import multinode
from shardgen.engines.kinds import KINDS, EngineSettings, Tokenizer
from shardgen.requests.results import EngineRequest

if TYPE_CHECKING:
    from shardgen.config import RunConfig

log = logging.getLogger(__name__)

# Seconds a job's engine gets to end on its own once the job is done with it (Engine.close): none, its
# rows are committed and nothing the engine holds is needed; a graceful end (the workers' teardown,
# then the engine core's) took 5 s of a one-minute job, and a second's grace ended none (bench/overhead.py).
STOP_WAIT_SECONDS = 0.0


def _fail_when_engine_core_dies(llm: Any) -> None:
    """Make the job's wait for the engine's outputs fail when its engine core process ends.

    vLLM 0.32's offline client waits on its output queue for ever once the engine core died without a
    word (the kernel's OOM killer, a SIGKILL, ``multinode.stop_engine_core``): its monitor shuts the
    client down, and the thread that fills the queue then ends without putting anything in it
    (v1/engine/core_client.py: SyncMPClient.get_output, process_outputs_socket; BackgroundResources).
    A thread waits for the process and puts the engine's death there. After a deliberate shutdown
    nobody reads the queue again; after a death with a message, the job raised on that one first.
    """
    from multiprocessing import connection

    from vllm.v1.engine.exceptions import EngineDeadError

    client = llm.llm_engine.engine_core
    manager = getattr(getattr(client, "resources", None), "engine_manager", None)
    outputs = getattr(client, "outputs_queue", None)
    if manager is None or outputs is None:
        return  # the engine core runs in this process
    processes = list(manager.processes)

    def wait() -> None:
        connection.wait([p.sentinel for p in processes])
        codes = [p.exitcode for p in processes]
        outputs.put_nowait(EngineDeadError(f"the engine core process ended (exit code {codes})"))

    threading.Thread(target=wait, name="engine-core-watch", daemon=True).start()


class Engine:
    """One handle on a vLLM engine, however it came to be.

    ``Engine()`` starts one on the first ``start`` and stops it on ``close``;
    ``Engine(llm)`` wraps one already running, which ``close`` leaves running
    (tests and benchmarks share one). Several shards of a job share one handle,
    so the engine starts once per job.
    """

    def __init__(self, llm: Any = None) -> None:
        self.llm = llm
        self._owned = llm is None
        self._kwargs: dict[str, Any] | None = None
        self.starts = 0  # engines this handle started
        self._workers: Any = None  # multinode.Workers of an engine over several nodes
        self._counters = count_instead_of_prometheus(llm)
        self._loras: dict[Any, Any] = {}  # lora.Adapter -> vLLM's LoRARequest

    @classmethod
    def of(cls, config: RunConfig) -> Engine:
        """A handle for a job of ``config`` (``engine.kind: vllm``), to start with ``start``."""
        return cls()

    @staticmethod
    def memory_defaults(gpus: list[dict[str, Any]], world_size: int) -> dict[str, Any]:
        """The memory settings the engine takes where the config leaves them unset, on these GPUs."""
        return memory.vllm_defaults(gpus, world_size)

    # What a task asks each engine kind for: its requests' parameters (vLLM's own classes here;
    # results.sampling_params and results.pooling_params for the kinds that do not import vLLM).
    @staticmethod
    def sampling_params(fields: Mapping[str, Any], choice_token_ids: list[int] | None = None) -> Any:
        return make_sampling_params(fields, choice_token_ids)

    @staticmethod
    def pooling_params(task: str, use_activation: bool | None, dimensions: int | None) -> Any:
        return make_pooling_params(task, use_activation, dimensions)

    @property
    def running(self) -> bool:
        return self.llm is not None

    def start(self, settings: EngineSettings) -> Any:
        """The running ``vllm.LLM``, started from ``settings`` if there is none yet (seconds to minutes:
        weights, KV cache, CUDA graphs). An engine this handle started with other settings (a shard
        whose earlier attempts ran out of memory takes lower ones) is stopped and started again."""
        if self.llm is not None and self._owned and settings.kwargs != self._kwargs:
            self.close(wait=None)  # the next engine needs the memory this one holds: let it release it
        if self.llm is None:
            from vllm import LLM

            kwargs = settings.kwargs
            if settings.nodes > 1:
                kwargs, self._workers = multinode.launch(
                    kwargs, settings.nodes, settings.gpus_per_node, self._workers_gone
                )
            try:
                self.llm = LLM(**kwargs)
            except BaseException:
                self._stop_workers()
                raise
            self._kwargs = settings.kwargs
            self.starts += 1
            _fail_when_engine_core_dies(self.llm)
            self._counters = count_instead_of_prometheus(self.llm)
        return self.llm

    @property
    def worker_gpus(self) -> dict[str, list[dict[str, Any]]]:
        """The GPUs of the engine's other nodes, by node (empty on one node)."""
        return dict(self._workers.gpus) if self._workers is not None else {}

    @property
    def workers_lost(self) -> str | None:
        """Why the engine's workers on other nodes ended while it ran; None while they run (or on one node)."""
        return self._workers.lost if self._workers is not None else None

    def _workers_gone(self) -> None:
        """The engine's workers on other nodes ended while it ran: fail it now, not at vLLM's RPC timeout
        (the engine core's death wakes the job: ``_fail_when_engine_core_dies``)."""
        multinode.stop_engine_core()

    def _stop_workers(self) -> None:
        if self._workers is not None:
            self._workers.stop()

    def close(self, wait: float | None = STOP_WAIT_SECONDS) -> None:
        """Stop the engine's processes now, if this handle started them.

        Left to exit handlers, the engine core process can outlive its parent's
        join at exit and hang the process (seen with vLLM 0.32 on the CPU build).

        Args:
            wait: seconds the engine's processes get to end after SIGTERM before they are killed
                (vLLM's ``MPClient.shutdown(timeout)``, v1/utils.py ``shutdown``: SIGTERM, join, then
                ``kill_process_tree``, which kills the engine core's workers with it); None: vLLM's own
                5 s, for an engine stopped to start another, which needs the memory it releases.
        """
        if self.llm is not None and self._owned:
            if wait is not None:
                log.info("stopping the engine: its processes get %g s to end before they are killed (Python's "
                         "resource tracker then frees the shared memory they held, and says so)", wait)  # fmt: skip
            self.llm.llm_engine.engine_core.shutdown(timeout=wait)
            self.llm = None
            self._stop_workers()

    # -- Requests: what the feed asks of an engine (``feed.Feeder``) ---------------------------------

    def submit(self, requests: list[EngineRequest]) -> list[Exception | None]:
        """Add requests to the engine, in order; for each, None when it took it, or the error it was
        refused with (vLLM validates each request; the model's processor each row's images).

        The prompts go through vLLM's own input path (``renderer.render_cmpl``): one call for a batch
        of text prompts, one per prompt with images (a row's images may be refused, not the batch's).
        """
        engine = self.llm.llm_engine
        errors: list[Exception | None] = [None] * len(requests)
        prompts: list[Any] = [r.prompt for r in requests]
        renderer = getattr(engine, "renderer", None)
        if renderer is not None and hasattr(renderer, "render_cmpl") and requests:
            if not any("multi_modal_data" in p for p in prompts):
                prompts = renderer.render_cmpl(prompts)  # one call for the batch (vLLM's own input path)
            else:
                for i, prompt in enumerate(prompts):
                    try:
                        prompts[i] = renderer.render_cmpl([prompt])[0]
                    except Exception as e:  # noqa: BLE001 - the processor's validation of this row's images
                        errors[i] = e
        for i, (r, prompt) in enumerate(zip(requests, prompts, strict=True)):
            if errors[i] is None:
                try:
                    engine.add_request(r.request_id, prompt, r.params, lora_request=self._lora_request(r.lora))
                except Exception as e:  # noqa: BLE001 - vLLM's per-request validation
                    errors[i] = e
        return errors

    def _lora_request(self, adapter: Any) -> Any:
        """The adapter's ``LoRARequest``, one per adapter for the engine's life."""
        if adapter is None:
            return None
        if adapter not in self._loras:
            self._loras[adapter] = lora_request(adapter)
        return self._loras[adapter]

    def step(self) -> list[Any]:
        """One engine step: the outputs it made (vLLM's ``RequestOutput``/``PoolingRequestOutput``)."""
        return self.llm.llm_engine.step()

    def abort(self, request_ids: list[str]) -> None:
        """Drop requests the engine still holds."""
        self.llm.llm_engine.abort_request(request_ids)

    def tokenizer(self, generates: bool = True, chat_template_kwargs: Mapping[str, Any] | None = None) -> Tokenizer:
        max_len = self.llm.llm_engine.model_config.max_model_len
        return Tokenizer(self.llm.get_tokenizer(), max_len, generates, chat_template_kwargs)

    @property
    def max_num_seqs(self) -> int:
        return self.llm.llm_engine.vllm_config.scheduler_config.max_num_seqs

    def memory_settings(self) -> dict[str, Any]:
        """The memory settings the running engine uses (for the record of an out-of-memory failure)."""
        cfg = self.llm.llm_engine.vllm_config
        return {
            "max_num_seqs": cfg.scheduler_config.max_num_seqs,
            "gpu_memory_utilization": cfg.cache_config.gpu_memory_utilization,
            "kv_cache_memory_bytes": cfg.cache_config.kv_cache_memory_bytes,
        }

    def counters(self) -> dict[str, float]:
        """The engine's cumulative counters now (empty when stats logging is off)."""
        return dict(self._counters.totals) if self._counters is not None else {}


KINDS["vllm"] = Engine


class EngineCounters:
    """The engine-wide counters a shard's stats take deltas of, summed from each engine step's stats,
    in place of vLLM's Prometheus logger.

    With stats logging on (what gives each request its metrics: time to first token), ``LLMEngine``
    records every step into Prometheus histograms and gauges: a dozen ``observe`` calls per finished
    request, 13% of the frontend's time where the feed bounds a job (bench/feed.py's profile). A job
    serves no ``/metrics``; these six sums are all shardgen reads. It is one of the engine's stat
    loggers (vllm/v1/metrics/loggers.py: ``StatLoggerManager.record`` calls ``record`` of each, and
    ``log`` every ``VLLM_LOG_STATS_INTERVAL``), beside vLLM's log line of throughput.
    """

    def __init__(self) -> None:
        self.totals = dict.fromkeys(
            (
                "preemptions",
                "prefix_cache_queries",
                "prefix_cache_hits",
                "spec_decode_drafts",
                "spec_decode_draft_tokens",
                "spec_decode_accepted_tokens",
            ),
            0,
        )

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0):
        t = self.totals
        if iteration_stats is not None:
            t["preemptions"] += iteration_stats.num_preempted_reqs
        if scheduler_stats is not None:
            t["prefix_cache_queries"] += scheduler_stats.prefix_cache_stats.queries
            t["prefix_cache_hits"] += scheduler_stats.prefix_cache_stats.hits
            if (spec := scheduler_stats.spec_decoding_stats) is not None:
                t["spec_decode_drafts"] += spec.num_drafts
                t["spec_decode_draft_tokens"] += spec.num_draft_tokens
                t["spec_decode_accepted_tokens"] += spec.num_accepted_tokens

    def log(self) -> None:
        pass

    def log_engine_initialized(self) -> None:
        pass

    def record_sleep_state(self, is_awake: int, level: int) -> None:
        pass

    def record_admission_rejection(self, reason: str) -> None:
        pass


def count_instead_of_prometheus(llm: Any) -> EngineCounters | None:
    """Put ``EngineCounters`` in the place of the Prometheus logger of a running ``vllm.LLM``; the ones
    already there on an engine another handle wraps. None where stats logging is off (or ``llm`` is no
    engine: a test's stand-in)."""
    manager = getattr(getattr(llm, "llm_engine", None), "logger_manager", None)
    if manager is None:
        return None
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    for logger in manager.stat_loggers:
        if isinstance(logger, EngineCounters):
            return logger
    counters = EngineCounters()
    manager.stat_loggers = [x for x in manager.stat_loggers if not isinstance(x, PrometheusStatLogger)] + [counters]
    return counters


# -- Sampling -------------------------------------------------------------------------------------

# Keys of `sampling` in the config that shardgen handles itself rather than
# passing to SamplingParams as they are (reasoning_parser is an engine argument).
_OWN_SAMPLING_KEYS = {"structured_outputs", "seed", "reasoning_parser"}


def make_sampling_params(sampling_cfg: Any, choice_token_ids: list[int] | None = None):
    """``SamplingParams`` from the config; only the final output of each request is returned.

    ``structured_outputs`` becomes vLLM's ``StructuredOutputsParams``;
    ``choice_token_ids`` asks for the log-probabilities of the labels' first
    tokens (``output.choice_probs``). The seed is per row (``row_seed``), not here.

    Raises:
        ValueError, TypeError: a value vLLM refuses (``SamplingParams._verify_args``), with its message.
    """
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    kwargs = {k: v for k, v in sampling_cfg.items() if k not in _OWN_SAMPLING_KEYS and v is not None}
    if sampling_cfg.get("structured_outputs"):
        kwargs["structured_outputs"] = StructuredOutputsParams(**sampling_cfg["structured_outputs"])
    if choice_token_ids:
        kwargs["logprob_token_ids"] = list(choice_token_ids)
    try:
        return SamplingParams(**kwargs, output_kind=RequestOutputKind.FINAL_ONLY)
    except VLLMValidationError as e:
        raise ValueError(str(e)) from None


def make_pooling_params(task: str, use_activation: bool | None, dimensions: int | None) -> Any:
    """vLLM's ``PoolingParams`` of one pooling request (its own: vLLM sets fields on it)."""
    from vllm import PoolingParams

    return PoolingParams(task=task, use_activation=use_activation, dimensions=dimensions)


def lora_request(adapter: Any) -> Any:
    """vLLM's ``LoRARequest`` of an adapter (``lora.Adapter``); None for the base model."""
    if adapter is None:
        return None
    from vllm.lora.request import LoRARequest

    return LoRARequest(adapter.name, adapter.id, adapter.path)


def engine_died(error: BaseException) -> bool:
    """Whether ``error`` is vLLM's report that its engine core process died (``EngineDeadError``)."""
    from vllm.v1.engine.exceptions import EngineDeadError

    return isinstance(error, EngineDeadError)


def kv_cache_dtypes() -> set[str]:
    """The ``kv_cache_dtype`` values the installed vLLM knows (``vllm.config.cache.CacheDType``)."""
    import typing

    from vllm.config.cache import CacheDType

    return set(typing.get_args(CacheDType))


def engine_argument_names() -> set[str]:
    """The arguments of the installed vLLM's engine (``EngineArgs``' fields): what ``model.extra`` may set."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    return {f.name for f in dataclasses.fields(EngineArgs)}
