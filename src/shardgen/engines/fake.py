"""The fake engine (``engine.kind: fake``): instant, deterministic answers behind the engine interface the
feed uses (``engine.Engine``: ``start``, ``tokenizer``, ``submit``, ``step``, ``abort``, ``close``), so that
what shardgen itself decides (planning, feeding, checkpoints, retries, exactly-once, workers, splits,
steps) runs in milliseconds, without a model. It is a real engine of its own, not a mock of vLLM: the feed
cannot tell it from vLLM but by its answers.

The rule of its answers: sample ``i`` of a request is the text ``fake <h>``, where ``h`` is the first 16 hex
digits of the BLAKE2b digest of the prompt's token ids, the request's seed and ``i``, tokenized by the
model's tokenizer and cut at ``max_tokens`` (``finish_reason`` ``length``, else ``stop``); with
``ignore_eos``, repeated to exactly ``max_tokens``. With structured
outputs, ``choice`` answers one of the labels (picked by ``h``) and ``json`` the smallest instance of the
schema (its required properties; strings ``h``, numbers 0, the first of an enum). Asked for log-probabilities,
each sampled token has log-probability 0. A pooling request (``classify``, ``reward``, ``embed``, ``score``)
gets values drawn from a generator seeded by the digest of its prompt: one logit per class of the model's
``id2label`` (a softmax with the task's activation), one per prompt token for a per-token reward model, and
an embedding of the model's size (or ``pooling.dimensions``), normalised with the activation. So the same
request gets the same answer in every run, whatever the batch, and different rows get different answers.

Its failures (``engine.fake``): rows whose requests it refuses, a death after N answers, an out-of-memory
start, time per generated token (a slow engine): what a run must survive.
"""

from __future__ import annotations

import array
import collections
import hashlib
import json
import math
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardgen import config as cfg
from shardgen.engines import kinds as eng
from shardgen.errors import ConfigError, ShardgenError
from shardgen.requests.results import EngineRequest, Pooled

KIND = "fake"
# With engine.fake.tokens_per_second, a step answers no more requests than take this long (at least one).
STEP_SECONDS = 0.2
# CUDA's message when memory runs out (what memory.failure_kind reads), for engine.fake.out_of_memory_at_start.
OUT_OF_MEMORY = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB"


class FakeEngineDied(ShardgenError):
    """The fake engine died (``engine.fake.crash_after``), as vLLM's engine core may: the attempt fails."""


@dataclass
class FakeSample:
    """One sample, with the fields of vLLM's ``CompletionOutput`` the tasks read."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[dict[int, Any]] | None = None
    cumulative_logprob: float | None = None
    stop_reason: Any = None


@dataclass
class FakeOutput:
    """A finished request, with the fields of vLLM's ``RequestOutput`` the feed and the tasks read."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[FakeSample]
    finished: bool = True
    metrics: Any = None
    num_cached_tokens: int = 0

    @property
    def tokens(self) -> int:
        """The tokens it took the engine to answer (engine.fake.tokens_per_second)."""
        return sum(len(s.token_ids) for s in self.outputs)


@dataclass
class FakePoolingOutput:
    """A finished pooling request, with the fields of vLLM's ``PoolingRequestOutput`` the feed reads."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: Pooled
    finished: bool = True
    num_cached_tokens: int = 0

    @property
    def tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class FakeLogprob:
    """vLLM's ``Logprob``: the log-probability of a token, its rank and its text."""

    logprob: float
    rank: int | None
    decoded_token: str | None


def fast_tokenizer(path: str, trust_remote_code: bool) -> Any:
    """The model's tokenizer, as the fake engine needs it: its fast tokenizer (``tokenizer.json``, its
    special tokens and chat template) without the model classes ``AutoTokenizer`` imports to choose one,
    which import torch (2 to 3 s of each fake job); ``AutoTokenizer`` where the model has no
    ``tokenizer.json`` or brings its own code."""
    if not trust_remote_code and (Path(path) / "tokenizer.json").exists():
        from transformers import PreTrainedTokenizerFast  # only where a job runs the fake (a second to import)

        return PreTrainedTokenizerFast.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


@dataclass
class FakeEngine(eng.OutsideEngine):
    """A job's handle on the fake engine (``engine.KINDS["fake"]``), with ``engine.Engine``'s methods.

    Args:
        failures: the config's ``engine.fake``.
    """

    failures: dict[str, Any] = field(default_factory=dict)
    starts: int = 0  # engines this handle started
    answered: int = 0  # requests answered since it started
    _settings: Any = field(default=None, repr=False)
    _hf: Any = field(default=None, repr=False)
    _model_config: dict[str, Any] = field(default_factory=dict, repr=False)  # the model's config.json
    _queue: collections.OrderedDict = field(default_factory=collections.OrderedDict, repr=False)

    @classmethod
    def of(cls, config: Any) -> FakeEngine:
        return cls(dict(config.engine.fake))

    @property
    def running(self) -> bool:
        return self._hf is not None

    def start(self, settings: eng.EngineSettings) -> FakeEngine:
        """Load the model's tokenizer (nothing else of the model). Raises CUDA's out-of-memory error with
        ``engine.fake.out_of_memory_at_start``."""
        if self.failures.get("out_of_memory_at_start"):
            raise RuntimeError(OUT_OF_MEMORY)
        if self._hf is not None and settings.kwargs != self._settings.kwargs:
            self.close()  # other settings (an attempt after running out of memory): started again, as vLLM's
        if self._hf is None:
            model = settings.model
            self._hf = fast_tokenizer(model.get("tokenizer") or model["model"], bool(model.get("trust_remote_code")))
            self._model_config = json.loads((Path(model["model"]) / "config.json").read_text())
            self._settings, self.answered = settings, 0
            self.starts += 1
        return self

    def tokenizer(self, generates: bool = True, chat_template_kwargs: Any = None) -> eng.Tokenizer:
        return eng.Tokenizer(self._hf, self._max_model_len(), generates, chat_template_kwargs)

    def _max_model_len(self) -> int:
        model = self._settings.model
        if model.get("max_model_len"):
            return int(model["max_model_len"])
        return int(self._model_config.get("max_position_embeddings") or 2048)

    # -- Requests -------------------------------------------------------------------------------------

    def submit(self, requests: list[EngineRequest]) -> list[Exception | None]:
        refused = set(self.failures.get("reject_rows") or ())
        errors: list[Exception | None] = []
        for r in requests:
            if r.row in refused:
                errors.append(ValueError(f"the fake engine refuses row {r.row} (engine.fake.reject_rows)"))
                continue
            self._queue[r.request_id] = r
            errors.append(None)
        return errors

    def step(self) -> list[FakeOutput | FakePoolingOutput]:
        """Answer up to ``max_num_seqs`` requests, oldest first.

        Raises:
            FakeEngineDied: it answered ``engine.fake.crash_after`` requests already (a step stops at that
                many, and the next one dies).
        """
        crash_after, rate = self.failures.get("crash_after"), self.failures.get("tokens_per_second")
        if crash_after is not None and self.answered >= crash_after:
            raise FakeEngineDied(f"the fake engine died after {self.answered} requests (engine.fake.crash_after)")
        out: list[FakeOutput | FakePoolingOutput] = []
        tokens = 0
        while self._queue and len(out) < self.max_num_seqs:
            if crash_after is not None and self.answered >= crash_after:
                break  # the next step dies
            if rate and out and tokens / rate >= STEP_SECONDS:
                break  # a step stays short, so the feed looks at its stop flag and splits between them
            _, request = self._queue.popitem(last=False)
            out.append(self._answer(request))
            tokens += out[-1].tokens
            self.answered += 1
        if rate:  # as long as an engine of that speed takes for them
            time.sleep(tokens / rate)
        return out

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._queue.pop(request_id, None)

    def close(self, wait: float | None = None) -> None:
        self._queue.clear()
        self._hf = None

    # -- The answers ------------------------------------------------------------------------------------

    def _answer(self, request: EngineRequest) -> FakeOutput | FakePoolingOutput:
        params, ids = request.params, list(request.prompt["prompt_token_ids"])
        if getattr(params, "task", None) is not None:  # vLLM's PoolingParams
            return FakePoolingOutput(request.request_id, ids, Pooled(self._pooled(ids, params)))
        samples = [self._sample(ids, params, i) for i in range(getattr(params, "n", 1) or 1)]
        return FakeOutput(request.request_id, ids, samples)

    def _sample(self, ids: list[int], params: Any, index: int) -> FakeSample:
        seed = getattr(params, "seed", None)
        h = hashlib.blake2b(array.array("q", ids).tobytes() + f"/{seed}/{index}".encode(), digest_size=8).hexdigest()
        structured = getattr(params, "structured_outputs", None)
        if structured is not None and getattr(structured, "choice", None):
            text = structured.choice[int(h, 16) % len(structured.choice)]
        elif structured is not None and getattr(structured, "json", None) is not None:
            schema = structured.json if isinstance(structured.json, dict) else json.loads(structured.json)
            text = json.dumps(instance(schema, h))
        else:
            text = f"fake {h}"
        tokens = self._hf.encode(text, add_special_tokens=False)
        max_tokens, ignore_eos = getattr(params, "max_tokens", None), bool(getattr(params, "ignore_eos", False))
        finish = "stop"
        if max_tokens is not None:
            if ignore_eos:  # the answer again and again, to exactly max_tokens
                tokens = tokens * (max_tokens // max(len(tokens), 1) + 1)
            if len(tokens) > max_tokens:
                tokens, finish = tokens[:max_tokens], "length"
        text = self._hf.decode(tokens)
        logprobs = None
        if getattr(params, "logprobs", None) is not None:
            logprobs = [{t: FakeLogprob(0.0, 1, self._hf.decode([t]))} for t in tokens]
        return FakeSample(index, text, tokens, finish, logprobs)

    def _pooled(self, ids: list[int], params: Any) -> list[Any]:
        digest = hashlib.blake2b(array.array("q", ids).tobytes(), digest_size=8).digest()
        draw = random.Random(digest).gauss
        activation = params.use_activation is not False
        if params.task == "token_classify":  # a per-token reward model: one raw value per prompt token
            return [[draw(0.0, 1.0)] for _ in ids]
        if params.task == "embed":
            size = params.dimensions or self._model_config.get("hidden_size") or 64
            values = [draw(0.0, 1.0) for _ in range(size)]
            norm = math.sqrt(sum(v * v for v in values)) if activation else 1.0
            return [v / norm for v in values]
        labels = self._model_config.get("id2label") or {}
        logits = [draw(0.0, 2.0) for _ in range(len(labels) or 1)]
        if not activation:
            return logits
        if len(logits) == 1:  # one output: vLLM's sigmoid
            return [1 / (1 + math.exp(-logits[0]))]
        top = max(logits)
        exps = [math.exp(v - top) for v in logits]
        return [e / sum(exps) for e in exps]


def instance(schema: Any, h: str, root: Any = None) -> Any:
    """The smallest instance of a JSON schema: its required properties, each the smallest of its type
    (a number at its minimum, a string ``h`` fitted to its length bounds); local ``$ref``s and ``allOf``
    are followed. (A ``pattern`` or ``format`` is not: such a schema's rows may be ``invalid_json``.)"""
    root = schema if root is None else root
    if not isinstance(schema, dict):
        return None
    if isinstance(schema.get("$ref"), str) and schema["$ref"].startswith("#/"):
        target: Any = root
        for part in schema["$ref"][2:].split("/"):
            target = target.get(part, {}) if isinstance(target, dict) else {}
        return instance({**target, **{k: v for k, v in schema.items() if k != "$ref"}}, h, root)
    if schema.get("allOf"):
        merged = {k: v for k, v in schema.items() if k != "allOf"}
        for part in schema["allOf"]:
            merged = {**merged, **part, "required": [*merged.get("required", []), *part.get("required", [])]}
        return instance(merged, h, root)
    if "enum" in schema:
        return schema["enum"][0]
    if "const" in schema:
        return schema["const"]
    for key in ("anyOf", "oneOf"):
        if schema.get(key):
            return instance(schema[key][0], h, root)
    kind = schema.get("type")
    kind = kind[0] if isinstance(kind, list) else kind
    if kind == "object" or "properties" in schema:
        props = schema.get("properties") or {}
        return {k: instance(props.get(k, {}), h, root) for k in dict.fromkeys(schema.get("required", []))}
    if kind == "array":
        return [instance(schema.get("items") or {}, h, root) for _ in range(schema.get("minItems", 0))]
    if kind in ("integer", "number"):
        value = schema.get("minimum", 0)
        if "exclusiveMinimum" in schema:
            value = max(value, schema["exclusiveMinimum"] + 1)
        if "maximum" in schema:
            value = min(value, schema["maximum"])
        return math.ceil(value) if kind == "integer" else value
    if kind == "boolean":
        return False
    if kind == "null":
        return None
    text = (h * (schema.get("minLength", 0) // len(h) + 1))[: max(schema.get("minLength", 0), len(h))]
    return text[: schema["maxLength"]] if "maxLength" in schema else text


def check_config(config: dict[str, Any]) -> None:
    """``engine.fake`` goes with ``engine.kind: fake``.

    Raises:
        ConfigError: naming the key.
    """
    engine = config.get("engine") or {}
    if engine.get("kind", "vllm") != KIND:
        if any(v not in (None, False, 0, []) for v in (engine.get("fake") or {}).values()):
            raise ConfigError(f"engine.fake is set, but engine.kind is {engine.get('kind', 'vllm')}: set kind: fake")


def content(engine: Mapping[str, Any]) -> dict[str, Any]:
    """The fake's part of the fingerprint: the rows it refuses are errors; its crashes and speed change no row."""
    return {"reject_rows": (engine.get("fake") or {}).get("reject_rows")}


eng.KINDS[KIND] = FakeEngine
cfg.register_check(check_config)
cfg.register_engine(KIND, content)
