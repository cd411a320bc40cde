"""The vLLM engine: its settings for a job, one handle on it however it was started, its tokenizer.

Typical use (a shard job)::

    settings = EngineSettings.for_job(config, model_record, failures)  # GPUs, precision, memory
    engine = Engine()              # or Engine(llm) for one already running (tests, benchmarks)
    llm = engine.start(settings)   # starts it once; a job's later shards reuse it
    ...
    engine.close()                 # stops it if this handle started it
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardgen import fetch, gpus, jobenv, jobinfo, kernels, memory, multinode, results
from shardgen.errors import RowError, ShardgenError
from shardgen.installed import version_problem, vllm_build
from shardgen.registry import Registry
from shardgen.results import EngineRequest

if TYPE_CHECKING:
    from shardgen.config import RunConfig
    from shardgen.prompts import Prompt

log = logging.getLogger(__name__)

# Seconds a job's engine gets to end on its own once the job is done with it (Engine.close): none, its
# rows are committed and nothing the engine holds is needed; a graceful end (the workers' teardown,
# then the engine core's) took 5 s of a one-minute job, and a second's grace ended none (bench/overhead.py).
STOP_WAIT_SECONDS = 0.0

# Keys of `model` in the config that are ours, not vllm.LLM arguments.
_NOT_ENGINE_ARGS = {"extra", "allow_unsafe_engine_args", "batch_invariant"}


class WrongGpus(ShardgenError):
    """The job got GPUs it cannot run on as configured (too few, without the precision asked for, a
    driver too old for the CUDA build)."""

    outcome = "wrong_gpus"


class UnsupportedVllm(ShardgenError):
    """The installed vLLM is not the version shardgen is tested with."""

    outcome = "unsupported_vllm"


def fp8_kv_cache_supported(build: str) -> bool:
    """Whether this machine can hold an FP8 KV cache.

    Every CUDA GPU vLLM runs on can. vLLM's CPU build needs x86 with AVX-512
    or AMX for it (its CPU attention kernels); on AVX2-only CPUs the engine
    refuses to start with it.
    """
    if build != "cpu":
        return True
    import torch

    return bool(torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())


def engine_kwargs(model_cfg: Any) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments: the set keys of ``model`` plus ``model.extra``.

    Null values mean "vLLM's default" and are left out. Stats logging is
    turned on: it is what gives per-request metrics (time to first token).
    """
    kwargs = {k: v for k, v in model_cfg.items() if v is not None and k not in _NOT_ENGINE_ARGS}
    kwargs.update(model_cfg.get("extra") or {})
    kwargs.setdefault("disable_log_stats", False)
    return kwargs


# -- The settings of one job's engine ---------------------------------------------------------------


@dataclass
class EngineSettings:
    """What a job gives ``vllm.LLM``, and what decided it.

    Attributes:
        model: the config's ``model`` section with the local model directory,
            the precision chosen for the job's GPUs and the memory overrides.
        gpus: the GPUs the job sees (``gpus.describe_gpus``).
        build: ``cpu`` or ``cuda``.
        precision: ``{"quantization", "kv_cache_dtype", "reason"}``.
        memory_overrides: what earlier out-of-memory failures changed.
        memory_defaults: vLLM's own ``max_num_seqs`` / ``gpu_memory_utilization``
            for these GPUs, for the record of a failure where the config set none.
        environment: variables the job sets before the engine starts.
        notes: warnings for the job's log.
        nodes: the nodes the engine spans (``resources.nodes``; ``multinode``).
    """

    model: dict[str, Any]
    gpus: list[dict[str, Any]] = field(default_factory=list)
    build: str = "cpu"
    precision: dict[str, Any] = field(default_factory=dict)
    memory_overrides: dict[str, Any] = field(default_factory=dict)
    memory_defaults: dict[str, Any] = field(default_factory=dict)
    environment: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    nodes: int = 1

    @property
    def gpus_per_node(self) -> int:
        return self.model["tensor_parallel_size"] * self.model["pipeline_parallel_size"] // self.nodes

    @property
    def kwargs(self) -> dict[str, Any]:
        return engine_kwargs(self.model)

    @classmethod
    def for_job(cls, config: RunConfig, model_record: dict[str, Any], failures: list[dict[str, Any]]) -> EngineSettings:
        """The engine settings of this job.

        The model is the local directory the fetch step found (no hub lookup in
        a job); ``auto`` precisions are chosen for the GPUs the job got, which
        are checked against what the config needs; an attempt after earlier ones
        ran out of memory (``failures``) takes one step from the settings they
        used (``memory.overrides``); seeded sampling on vLLM's CPU build turns
        chunked prefill off.

        Raises:
            WrongGpus: too few GPUs, a precision the GPUs cannot run, a driver
                too old for the CUDA build, or batch invariance on GPUs without it.
            UnsupportedVllm: the installed vLLM is not the version shardgen supports.
        """

        if problem := version_problem():
            raise UnsupportedVllm(problem)
        model = config.model
        build = vllm_build()
        devices = gpus.describe_gpus()
        hf_config = json.loads((Path(fetch.model_path(model_record)) / "config.json").read_text())
        checkpoint = gpus.checkpoint_quant_method(hf_config)
        precision = gpus.choose_precision(
            devices, model.get("quantization"), model.get("kv_cache_dtype"), checkpoint, build
        )
        settings = {**model, **fetch.engine_model_args(model_record)}
        settings.update(quantization=precision["quantization"], kv_cache_dtype=precision["kv_cache_dtype"])
        problems = gpus.check_gpus(
            devices,
            config.gpus_per_node,
            settings["quantization"] or checkpoint,
            settings["kv_cache_dtype"],
            build,
            from_checkpoint=settings["quantization"] is None,
        )
        if build == "cuda":
            problems += gpus.check_driver(devices, kernels.torch_cuda())
            if model.get("batch_invariant"):
                problems += gpus.check_batch_invariance(devices)
        if problems:
            raise WrongGpus("this job cannot run on the GPUs it got:\n  - " + "\n  - ".join(problems))
        if config.sampling.reasoning_parser:  # an engine argument, under sampling: it decides the columns
            settings["reasoning_parser"] = config.sampling.reasoning_parser
        if config.prompt.images:  # vLLM's per-prompt limit (default 1 image), from the columns
            settings["limit_mm_per_prompt"] = {"image": len(config.prompt.images)}
        notes = gpus.gpu_warnings(devices, settings["kv_cache_dtype"], build)
        overrides = memory.overrides(failures)
        settings.update(overrides)
        seeded = config.sampling.seed is not None or config.input.sampling_column  # a row may bring its own seed
        if build == "cpu" and seeded and settings.get("enable_chunked_prefill") is not False:
            settings["enable_chunked_prefill"] = False
            # without chunking, a step must hold a whole prompt
            if settings.get("max_num_batched_tokens") and settings.get("max_model_len"):
                settings["max_num_batched_tokens"] = max(settings["max_num_batched_tokens"], settings["max_model_len"])
            notes.append(
                "seeded sampling on vLLM's CPU build: chunked prefill is off (PyTorch's CPU generator cannot rewind "
                "the sample of a partly prefilled prompt, and the engine would fail)"
            )
        if build == "cpu" and settings.get("pipeline_parallel_size", 1) > 1 and settings.get("enforce_eager"):
            # one dynamo trace run eagerly (CompilationMode.DYNAMO_TRACE_ONCE, torch's "eager" backend): what
            # enforce_eager runs, plus the warm-up
            settings.update(enforce_eager=False, compilation_config={"mode": 2, "backend": "eager"})
            notes.append(
                "model.pipeline_parallel_size > 1 with enforce_eager on vLLM's CPU build: compilation mode "
                "DYNAMO_TRACE_ONCE with torch's eager backend instead. Eager, the CPU worker skips the warm-up run "
                "that allocates a later stage's buffer for the previous stage's activations "
                "(v1/worker/cpu_model_runner.py, warming_up_model; gpu_model_runner.py, _dummy_run), and that "
                "stage fails its first step (assert self.intermediate_tensors is not None)"
            )
        environment = {**jobenv.PROCESS_ENV, **jobenv.node_caches(jobinfo.cache_root(jobinfo.host()))}
        if model.get("batch_invariant"):
            # batch-invariant kernels: a row's text does not depend on the rows batched with it
            # (vllm/model_executor/determinism/batch_invariant.py; GPU workers only)
            environment["VLLM_BATCH_INVARIANT"] = "1"
            if build == "cpu":
                notes.append(
                    "model.batch_invariant on vLLM's CPU build: its worker ignores VLLM_BATCH_INVARIANT (the CPU "
                    "kernels do not depend on the batch here anyway)"
                )
        return cls(
            model=settings,
            gpus=devices,
            build=build,
            precision=precision,
            memory_overrides=overrides,
            memory_defaults=KINDS[config.engine.kind].memory_defaults(devices, model.gpus),
            environment=environment,
            notes=notes,
            nodes=config.resources.nodes,
        )


# -- The engine ------------------------------------------------------------------------------------

# The engines by ``engine.kind``: vLLM's here; another registers itself (``fake_engine``). Each is a class
# whose instance is a job's handle on its engine, with ``Engine``'s methods.
KINDS: dict[str, type] = Registry()


def for_config(config: RunConfig) -> Any:
    """A handle (not yet started) on the engine ``config.engine.kind`` names."""
    return KINDS[config.engine.kind].of(config)


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


class OutsideEngine:
    """What the engine kinds that are not vLLM in this process share (the fake engine, a server): their
    requests' parameters without vLLM (``results.sampling_params``), a batch of ``MAX_NUM_SEQS`` where
    the config sets none, no engine counters, one node."""

    MAX_NUM_SEQS = 256  # the requests a step answers (the fake's), or in flight (a server's)
    sampling_params = staticmethod(results.sampling_params)
    pooling_params = staticmethod(results.pooling_params)

    @property
    def worker_gpus(self) -> dict[str, list[dict[str, Any]]]:
        return {}

    @property
    def workers_lost(self) -> str | None:
        return None

    @classmethod
    def memory_defaults(cls, gpus: list[dict[str, Any]], world_size: int) -> dict[str, Any]:
        return {"max_num_seqs": cls.MAX_NUM_SEQS}

    @property
    def max_num_seqs(self) -> int:
        return int(self._settings.model.get("max_num_seqs") or self.MAX_NUM_SEQS)

    def counters(self) -> dict[str, float]:
        return {}

    def memory_settings(self) -> dict[str, Any]:
        return {"max_num_seqs": self.max_num_seqs}


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


def row_seed(seed: int, row_key: Any) -> int:
    """The sampling seed of one row: from the run's seed and the row's id, not its position in a batch.

    vLLM gives the samples of a request ``seed + i``; 62 bits leave room for them.
    """
    digest = hashlib.blake2b(f"{seed}\x00{row_key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 2


# -- Tokenization -----------------------------------------------------------------------------------


class Tokenizer:
    """Prompts to token ids, the way vLLM's ``chat``/``generate`` would make them, a batch at a time."""

    def __init__(
        self,
        tokenizer: Any,
        max_model_len: int,
        generates: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.hf = tokenizer
        self.max_model_len = max_model_len
        # prompt.chat_template_kwargs: the template's own variables (HF passes extra kwargs to it)
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        # a prompt to generate from must leave room for a token; one to pool may fill the context
        self.max_prompt_tokens = max_model_len - 1 if generates else max_model_len

    @property
    def max_prompt_chars(self) -> int:
        """Characters beyond which a prompt cannot fit ``max_model_len`` tokens.

        No token spells more characters than the longest entry of the
        vocabulary (a byte-level BPE entry has one character per byte), so a
        longer text has at least ``max_model_len`` tokens: such a prompt is a
        row error without being tokenized (a 1 GB cell would otherwise take
        many GB as token ids).
        """
        longest = max((len(t) for t in self.hf.get_vocab()), default=1)
        return self.max_model_len * max(longest, 1)

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of one prompt.

        Raises:
            RowError: the prompt does not fit the context (vLLM would reject
                the whole batch for it), or cannot be tokenized.
        """
        (ids,) = self.encode_batch([prompt])
        if isinstance(ids, RowError):
            raise ids
        return ids

    def encode_batch(self, prompts: list[Prompt]) -> list[list[int] | RowError]:
        """Token ids of each prompt, or the ``RowError`` that prompt gets.

        The chat template is applied to each conversation, then all texts are
        tokenized in one call of the fast tokenizer, which is several times
        cheaper per row than one call per row; a pair of texts (task score) is
        joined by the tokenizer as a text pair, the way vLLM's cross-encoder
        scoring makes its prompts (vllm/entrypoints/pooling/scoring/io_processor.py:
        ``CrossEncoderIOProcessor``, ``tokenizer(text=q, text_pair=d)``). A
        prompt that fails alone (a template error on one conversation) does
        not fail the others.
        """
        if not prompts:
            return []
        try:
            chat = [isinstance(p, list) for p in prompts]
            texts = list(prompts)
            if any(chat):  # one call renders every conversation (cheaper than one call each)
                rendered = iter(self._chat_texts([p for p, c in zip(prompts, chat, strict=True) if c]))
                texts = [next(rendered) if c else p for p, c in zip(prompts, chat, strict=True)]
            ids = self._tokenize(texts, chat)
        except Exception:  # noqa: BLE001 - find the row that fails, one at a time
            if len(prompts) == 1:
                return [self._one(prompts[0])]
            return [self._one(p) for p in prompts]
        return [self._fits(x) for x in ids]

    def _chat_texts(self, conversations: list[list[dict[str, str]]]) -> list[str]:
        return self.hf.apply_chat_template(
            conversations, add_generation_prompt=True, tokenize=False, **self.chat_template_kwargs
        )

    def _tokenize(self, texts: list[str | tuple[str, str]], chat: list[bool]) -> list[list[int]]:
        """Token ids of texts; a chat text already holds its template's special tokens (as
        ``apply_chat_template(tokenize=True)`` tokenizes it), a raw prompt or a pair gets the tokenizer's."""
        out: list[list[int]] = [[] for _ in texts]
        pairs = {i for i, t in enumerate(texts) if isinstance(t, tuple)}
        if pairs:
            order = sorted(pairs)
            firsts, seconds = zip(*(texts[i] for i in order), strict=True)
            encoded = self.hf(list(firsts), list(seconds), add_special_tokens=True)["input_ids"]
            for i, ids in zip(order, encoded, strict=True):
                out[i] = list(ids)
        for special in (False, True):
            idx = [i for i, c in enumerate(chat) if c != special and i not in pairs]
            if idx:
                encoded = self.hf([texts[i] for i in idx], add_special_tokens=special)["input_ids"]
                for i, ids in zip(idx, encoded, strict=True):
                    out[i] = list(ids)
        return out

    def _one(self, prompt: Prompt) -> list[int] | RowError:
        try:
            text = self._chat_texts([prompt])[0] if isinstance(prompt, list) else prompt
            (ids,) = self._tokenize([text], [isinstance(prompt, list)])
        except Exception as e:  # noqa: BLE001 - any tokenizer failure is this row's
            return RowError("tokenize_error", f"{type(e).__name__}: {e}")
        return self._fits(ids)

    def _fits(self, ids: list[int]) -> list[int] | RowError:
        if len(ids) > self.max_prompt_tokens:
            room = ", which leaves no room to generate" if self.max_prompt_tokens < self.max_model_len else ""
            return RowError(
                "prompt_too_long", f"the prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}{room}"
            )
        return ids
