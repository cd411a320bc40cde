"""The engine seam: the engine kinds by ``engine.kind``, the settings of a job's engine, what the kinds
that are not vLLM in this process share, and the tokenizer every kind's requests are made with.

Typical use (a shard job)::

    settings = EngineSettings.for_job(config, model_record, failures)  # GPUs, precision, memory
    engine = for_config(config)    # the handle of engine.kind: vllm, server or fake (not started)
    engine.start(settings)         # starts it once; a job's later shards reuse it
    ...
    engine.close()                 # stops it if this handle started it
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardgen.base import gpus, jobenv, jobinfo, kernels, memory
from shardgen.base.installed import version_problem, vllm_build
from shardgen.base.registry import Registry
from shardgen.errors import RowError, ShardgenError
from shardgen.models import fetch
from shardgen.requests import results

if TYPE_CHECKING:
    from shardgen.config import RunConfig
    from shardgen.requests.prompts import Prompt

log = logging.getLogger(__name__)


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
        adapters: the run's LoRA adapters, each name's local directory (a server serves them by name).
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
    adapters: dict[str, str] = field(default_factory=dict)

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
            adapters={name: str(r["path"]) for name, r in (model_record.get("adapters") or {}).items()},
        )


# -- The kinds -------------------------------------------------------------------------------------

# The engines by ``engine.kind``: each module of ``engines`` registers its class (``vllm.Engine``,
# ``server.ServerEngine``, ``fake.FakeEngine``), whose instance is a job's handle on its engine, with
# ``vllm.Engine``'s methods.
KINDS: dict[str, type] = Registry()


def for_config(config: RunConfig) -> Any:
    """A handle (not yet started) on the engine ``config.engine.kind`` names."""
    return KINDS[config.engine.kind].of(config)


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
