"""What a row's result holds, and how an engine completion becomes output rows.

The columns shardgen adds to every input row depend on the sampling config:
several samples per row (one output row per sample with a ``sample_index``,
or list columns), a reasoning model's trace apart from its answer
(``reasoning``, ``reasoning_tokens``), structured outputs (the parsed JSON record as a typed
struct column, or the chosen ``label``), label probabilities, and top-k
log-probabilities. ``ResultSpec`` decides the columns once per run and turns
each completion into rows; a sample that does not parse gets a per-row error.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from shardgen.data.outputs import CONFIG_KEY, FINGERPRINT_KEY, ROWS_PER_INPUT_KEY, SHARD_KEY
from shardgen.errors import ConfigError, RowError, ShardgenError
from shardgen.models.heads import embedding_dim

if TYPE_CHECKING:
    from shardgen.config import RunConfig

LOGPROB_TYPE = pa.list_(
    pa.list_(pa.struct([("token_id", pa.int32()), ("token", pa.string()), ("logprob", pa.float32())]))
)
# Where a row's result came from (``Completion.source``): the engine, the request store, or a request
# with the same key in the job (engines.store); null for a row that got no result.
SOURCE_FIELD = pa.field("result_source", pa.string())
ENGINE, STORE, DUPLICATE = "engine", "store", "duplicate"
# The column of a step's row that the step before did not pass on: why (null for every row it passed
# on; shardgen.features.steps). A bookkeeping column: feed, merge and the steps read it.
DROPPED = "dropped"
# Every column shardgen may add; an input column of one of these names would clash.
RESERVED_COLUMNS = (
    "row_index",
    "sample_index",
    "generation",
    "finish_reason",
    "prompt_tokens",
    "generated_tokens",
    "reasoning",
    "reasoning_tokens",
    "parsed",
    "label",
    "label_prob",
    "choice_probs",
    "logprobs",
    "error",
    "result_source",
    # pooling tasks (PoolingSpec)
    "probs",
    "reward",
    "embedding",
    "score",
)


@dataclass
class Completion:
    """A finished request: the engine's output and what it cost, or the error it got instead."""

    key: int
    row: dict[str, Any]
    output: Any
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float | None
    latency_s: float | None
    error: RowError | None = None
    # From vLLM's per-request timestamps (RequestStateStats, monotonic in the engine core): time waiting
    # for the scheduler, and time to first token once scheduled (vLLM's own "prefill time").
    queue_s: float | None = None
    ttft_scheduled_s: float | None = None
    source: str = ENGINE  # where the answer came from (``SOURCE_FIELD``: ENGINE, STORE or DUPLICATE)


@dataclass
class Pooled:
    """A pooled output's values, with ``data.tolist()`` as vLLM's ``PoolingOutput`` tensor has them (the
    fake engine's, and a stored answer's)."""

    values: list[Any]

    @property
    def data(self) -> Pooled:
        return self

    def tolist(self) -> list[Any]:
        return self.values


@dataclass
class EngineRequest:
    """One request as the feed gives it to an engine (``Engine.submit``): its id (unique in the
    engine), the prompt (``{"prompt_token_ids": ...}``, with ``multi_modal_data`` for images), the
    task's parameters (``SamplingParams``/``PoolingParams``) and the LoRA adapter (a ``lora.Adapter``)."""

    request_id: str
    prompt: dict[str, Any]
    params: Any
    lora: Any = None
    row: int | None = None  # the row's index (an engine that acts per row: the fake's refusals)


# -- A request's parameters for an engine outside this process's vLLM -------------------------------------
# vLLM in process gets its own SamplingParams and PoolingParams (engine.make_sampling_params); the fake
# engine and a server read the same fields by name from these, so that their jobs never import vLLM.
# SamplingParams' defaults of the fields they read (vllm/sampling_params.py: SamplingParams).
SAMPLING_DEFAULTS: dict[str, Any] = {
    "n": 1, "max_tokens": 16, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": None,
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "ignore_eos": False,
    "min_tokens": 0, "stop": None, "stop_token_ids": None, "skip_special_tokens": True,
    "include_stop_str_in_output": False, "logprobs": None, "logprob_token_ids": None, "structured_outputs": None,
}  # fmt: skip
# Keys of ``sampling`` that are not a request's fields: the seed is per row (``engine.row_seed``), the
# reasoning parser an engine argument.
NOT_REQUEST_FIELDS = frozenset({"seed", "reasoning_parser"})


def sampling_params(fields: Mapping[str, Any], choice_token_ids: Sequence[int] | None = None) -> Any:
    """A request's sampling as attributes, SamplingParams' fields over its defaults (``structured_outputs``
    a namespace of its own; ``choice_token_ids`` as ``logprob_token_ids``), for the fake engine and a
    server (``engine.make_sampling_params`` for vLLM).

    Raises:
        ValueError: a count or a temperature that no engine takes (vLLM's own words for them).
    """
    values = {**SAMPLING_DEFAULTS, **{k: v for k, v in fields.items() if k not in NOT_REQUEST_FIELDS and v is not None}}
    for name, least in (("n", 1), ("max_tokens", 1), ("temperature", 0.0), ("logprobs", 0)):
        value = values[name]
        if value is not None and (not isinstance(value, int | float) or isinstance(value, bool) or value < least):
            raise ValueError(f"{name} must be at least {least}, got {value!r}.")
    if values["structured_outputs"]:
        values["structured_outputs"] = SimpleNamespace(**values["structured_outputs"])
    if choice_token_ids:
        values["logprob_token_ids"] = list(choice_token_ids)
    return SimpleNamespace(**values)


def pooling_params(task: str, use_activation: bool | None, dimensions: int | None) -> Any:
    """A pooling request's parameters as attributes (``engine.make_pooling_params`` for vLLM)."""
    return SimpleNamespace(task=task, use_activation=use_activation, dimensions=dimensions)


@dataclass
class Sample:
    """One generated sequence of a request: with a reasoning parser, ``text`` is the answer (None when
    there is none) and the trace is apart (``reasoning.Splitter``)."""

    text: str | None
    finish_reason: str | None
    generated_tokens: int
    # per position: (token_id, token, logprob) of the sampled token, then the top-k most likely first
    # (the sampled one once: k + 1 entries when it is not among them)
    logprobs: list[list[tuple[int, str | None, float]]] | None = None
    # log-probabilities of chosen token ids at the answer's first position
    first_logprobs: dict[int, float] | None = None
    reasoning: str | None = None
    reasoning_tokens: int | None = None  # the trace's, end marker included
    error: str | None = None  # the sample has no answer (reasoning.UNFINISHED, NO_ANSWER)


def json_arrow_type(schema: Any) -> pa.DataType | None:
    """The Arrow type for values of a JSON schema, or None where no fixed type fits.

    Objects with ``properties`` become structs, arrays with ``items`` lists,
    string/integer/number/boolean the matching scalars (an enum of strings is
    a string). What has no single type (``anyOf``, free-form objects) is None:
    such values are stored as JSON text.
    """
    if not isinstance(schema, dict):
        return None
    if "enum" in schema and all(isinstance(v, str) for v in schema["enum"]):
        return pa.string()
    kind = schema.get("type")
    if isinstance(kind, list):
        kinds = [k for k in kind if k != "null"]
        kind = kinds[0] if len(kinds) == 1 else None
    if kind == "object" and isinstance(schema.get("properties"), dict) and schema["properties"]:
        return pa.struct([(name, json_arrow_type(sub) or pa.string()) for name, sub in schema["properties"].items()])
    if kind == "array" and isinstance(schema.get("items"), dict):
        return pa.list_(json_arrow_type(schema["items"]) or pa.string())
    return {"string": pa.string(), "integer": pa.int64(), "number": pa.float64(), "boolean": pa.bool_()}.get(kind)


def _to_typed(value: Any, schema: Any) -> Any:
    """``value`` shaped for ``json_arrow_type(schema)``: untyped parts become JSON text."""
    t = json_arrow_type(schema)
    if t is None or value is None:
        return None if value is None else json.dumps(value, ensure_ascii=False)
    if pa.types.is_struct(t) and isinstance(value, dict):
        props = schema["properties"]
        return {k: _to_typed(value.get(k), sub) for k, sub in props.items()}
    if pa.types.is_list(t) and isinstance(value, list):
        return [_to_typed(v, schema["items"]) for v in value]
    return value


class Columns:
    """What every task's result columns share: the shard file's schema, the names, the rows of an
    input row that got no result."""

    rows_per_input = 1

    def fields(self) -> list[pa.Field]:
        raise NotImplementedError

    def schema(
        self, input_schema: pa.Schema, fingerprint: str = "", config_fingerprint: str = "", shard_id: str = ""
    ) -> pa.Schema:
        """A shard file's schema (the merged output's, with no fingerprints): the input's columns, then
        the result columns, stamped with the shard and what made it."""
        meta = {
            FINGERPRINT_KEY: fingerprint.encode(),
            CONFIG_KEY: config_fingerprint.encode(),
            SHARD_KEY: shard_id.encode(),
            ROWS_PER_INPUT_KEY: str(self.rows_per_input).encode(),
        }
        return pa.schema(list(input_schema) + self.fields(), metadata=meta)

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.fields()]

    def error_rows(self, row: dict[str, Any], index: int, error: str, prompt_tokens: int | None = None) -> list[dict]:
        """The output rows of an input row that got no result."""
        return [
            {**row, **dict.fromkeys(self.names), "row_index": index, "prompt_tokens": prompt_tokens, "error": error}
        ]


class ResultSpec(Columns):
    """The result columns of a text generation run, and the rows a completion gives.

    Args:
        sampling: the config's ``sampling`` section (``SamplingParams`` fields).
        samples: ``output.samples``: with ``n`` > 1, one output row per sample
            (``rows``) or list columns (``list``).
        choice_probs: ``output.choice_probs``.
        choice_token_ids: the first token of each label (``output.choice_probs``),
            as the engine's tokenizer encodes it.
        per_row: whether rows have their own sampling (``input.sampling_column``):
            with ``samples: list`` the columns are lists whatever the run's ``n``
            (a row may set its own), and a ``logprobs`` column is kept (null
            for a row that asks for none) unless ``choice_probs`` takes them.
    """

    def __init__(
        self,
        sampling: Mapping[str, Any],
        samples: str = "rows",
        choice_probs: bool = False,
        choice_token_ids: Sequence[int] | None = None,
        per_row: bool = False,
    ) -> None:
        self.n: int = sampling.get("n", 1)
        self.as_list = samples == "list" and (self.n > 1 or per_row)
        self.as_rows = self.n > 1 and not self.as_list
        structured = sampling.get("structured_outputs") or {}
        self.json_schema = structured.get("json")
        self.choices: list[str] | None = structured.get("choice")
        self.choice_probs = choice_probs
        # empty until the engine's tokenizer is known (the columns do not depend on it)
        self.choice_token_ids = list(choice_token_ids or [])
        if self.choice_token_ids and len(self.choice_token_ids) != len(self.choices or []):
            raise ValueError("choice_token_ids must give one token per label")
        self.logprobs: int | None = sampling.get("logprobs")
        # a column even when the run asks for none: a row may (rowsampling)
        self.logprobs_column = self.logprobs is not None or (per_row and not choice_probs)
        self.reasoning = bool(sampling.get("reasoning_parser"))
        self.json_type = json_arrow_type(self.json_schema) if self.json_schema is not None else None
        self._validator = None
        if self.json_schema is not None:
            from jsonschema import validators

            self._validator = validators.validator_for(self.json_schema)(self.json_schema)

    @classmethod
    def of(cls, config: RunConfig, choice_token_ids: Sequence[int] | None = None) -> ResultSpec:
        """The result columns of a run."""
        out = config.output
        per_row = config.input.sampling_column is not None
        return cls(config.sampling, out.samples, out.choice_probs, choice_token_ids, per_row)

    @property
    def rows_per_input(self) -> int:  # type: ignore[override]
        """Output rows each input row gives."""
        return self.n if self.as_rows else 1

    def _sample_fields(self) -> list[pa.Field]:
        fields = [pa.field("generation", pa.string()), pa.field("finish_reason", pa.string())]
        fields.append(pa.field("generated_tokens", pa.int32()))
        if self.reasoning:
            fields += [pa.field("reasoning", pa.string()), pa.field("reasoning_tokens", pa.int32())]
        if self.json_schema is not None:
            fields.append(pa.field("parsed", self.json_type or pa.string()))
        if self.choices:
            fields.append(pa.field("label", pa.string()))
        if self.choice_probs:
            fields.append(pa.field("label_prob", pa.float64()))
            fields.append(pa.field("choice_probs", pa.struct([(c, pa.float64()) for c in self.choices or []])))
        if self.logprobs_column:
            fields.append(pa.field("logprobs", LOGPROB_TYPE))
        return fields

    def fields(self) -> list[pa.Field]:
        """The result columns, in output order."""
        sample = self._sample_fields()
        if self.as_list:
            sample = [pa.field(f.name, pa.list_(f.type)) for f in sample]
        out = [pa.field("row_index", pa.int64(), nullable=False)]
        if self.as_rows:
            out.append(pa.field("sample_index", pa.int32()))
        out += [*sample[:2], pa.field("prompt_tokens", pa.int32()), *sample[2:]]
        out += [pa.field("error", pa.string()), SOURCE_FIELD]
        return out

    def error_rows(self, row: dict[str, Any], index: int, error: str, prompt_tokens: int | None = None) -> list[dict]:
        """The output rows of an input row that got no generation."""
        (base,) = super().error_rows(row, index, error, prompt_tokens)
        if not self.as_rows:
            return [base]
        return [{**base, "sample_index": i} for i in range(self.n)]

    def rows(self, row: dict[str, Any], index: int, prompt_tokens: int, samples: list[Sample]) -> list[dict]:
        """The output rows of a completed input row; a sample that does not parse gets an error."""
        results = [self._sample(s) for s in samples]
        base = {**row, "row_index": index, "prompt_tokens": prompt_tokens}
        if self.as_rows:
            return [{**base, **r, "sample_index": i} for i, r in enumerate(results)]
        if not self.as_list:
            return [{**base, **results[0]}]
        merged: dict[str, Any] = {f.name: [r[f.name] for r in results] for f in self._sample_fields()}
        errors = [f"sample {i}: {r['error']}" for i, r in enumerate(results) if r["error"]]
        return [{**base, **merged, "error": "; ".join(errors) or None}]

    def _sample(self, s: Sample) -> dict[str, Any]:
        out: dict[str, Any] = {
            "generation": s.text,
            "finish_reason": s.finish_reason,
            "generated_tokens": s.generated_tokens,
            "error": s.error,
        }
        if self.reasoning:
            out.update(reasoning=s.reasoning, reasoning_tokens=s.reasoning_tokens)
        if self.json_schema is not None:
            out["parsed"] = None
        if self.choices:
            out["label"] = None
        try:
            if s.error is None and self.json_schema is not None:  # the answer, not the trace
                out["parsed"] = self._parse_json(s)
            if s.error is None and self.choices:
                out["label"] = self._label(s)
        except RowError as e:
            out["error"] = str(e)
        if self.choice_probs:
            probs = self._choice_probs(s)
            out["choice_probs"] = probs
            out["label_prob"] = probs.get(out["label"]) if probs and out.get("label") else None
        if self.logprobs_column:
            out["logprobs"] = s.logprobs
        return out

    def _parse_json(self, s: Sample) -> Any:
        try:
            value = json.loads(s.text or "")
        except ValueError as e:
            cut = " (the output was cut at max_tokens)" if s.finish_reason == "length" else ""
            raise RowError("invalid_json", f"the output is not valid JSON{cut}: {e}") from None
        assert self._validator is not None
        error = next(iter(self._validator.iter_errors(value)), None)
        if error is not None:
            path = ".".join(map(str, error.absolute_path)) or "(top level)"
            raise RowError("invalid_json", f"the output does not match the schema at {path}: {error.message}")
        typed = _to_typed(value, self.json_schema)
        try:
            pa.array([typed], self.json_type or pa.string())
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as e:
            raise RowError("invalid_json", f"the output does not fit the schema's column type: {e}") from None
        except UnicodeEncodeError:
            pass  # text no output can hold (a lone surrogate): the rule of every column (outputs.arrow_table)
        return typed

    def _label(self, s: Sample) -> str:
        text = (s.text or "").strip()
        if text not in (self.choices or []):
            cut = " (cut at max_tokens)" if s.finish_reason == "length" else ""
            raise RowError("invalid_choice", f"the output {text[:80]!r} is not one of the labels{cut}")
        return text

    def _choice_probs(self, s: Sample) -> dict[str, float] | None:
        """Each label's probability: the softmax of its first token's log-probability over the labels."""
        if not s.first_logprobs:
            return None
        lps = [s.first_logprobs.get(t, -math.inf) for t in self.choice_token_ids]
        top = max(lps)
        if top == -math.inf:
            return None
        weights = [math.exp(lp - top) for lp in lps]
        total = sum(weights)
        return {c: w / total for c, w in zip(self.choices or [], weights, strict=True)}


# classify with pooling.top_k: the k most likely classes, most likely first
LABEL_PROB_TYPE = pa.list_(pa.struct([("label", pa.string()), ("prob", pa.float32())]))


class PoolingSpec(Columns):
    """The result columns of a pooling task, and the row a pooled output gives: one output row per
    input row, with its ``row_index``, ``prompt_tokens`` and ``error``, and the task's own columns
    (``kind.pooled_fields``, ``kind.pooled``).

    Args:
        kind: the task (``tasks.ClassifyTask``, ``RewardTask``, ``EmbedTask`` or ``ScoreTask``).
        head: the model's (``heads.Head``); without it only the column names are known.
        pooling: the config's ``pooling`` section.
    """

    def __init__(self, kind: Any, head: Any = None, pooling: Mapping[str, Any] | None = None) -> None:
        pooling = pooling or {}
        self.kind = kind
        self.labels: list[str] = list(head.labels) if head is not None else []
        self.top_k: int | None = pooling.get("top_k")
        self.dim = embedding_dim(head, pooling)
        self.per_token = bool(head is not None and head.per_token_reward)

    def fields(self) -> list[pa.Field]:
        return [pa.field("row_index", pa.int64(), nullable=False), pa.field("prompt_tokens", pa.int32()),
                *self.kind.pooled_fields(self), pa.field("error", pa.string()), SOURCE_FIELD]  # fmt: skip

    def rows(self, row: dict[str, Any], index: int, prompt_tokens: int, data: list[Any]) -> list[dict]:
        """The output row of an input row whose pooled output is ``data`` (the engine's tensor as a list).

        Raises:
            ShardgenError: the engine's output does not have the shape the
                model's config promised (every row would fail the same way).
        """
        out = {**row, "row_index": index, "prompt_tokens": prompt_tokens, "error": None}
        out.update(self.kind.pooled(self, data))
        return [out]

    def expect(self, got: int, want: int, what: str, of: str) -> None:
        """Raises ``ShardgenError`` when the engine gave ``got`` values per row where the model's config
        says ``want``."""
        if got != want:
            raise ShardgenError(
                f"the engine gave {got} {what} per row, but the model's config.json says {want} ({of}); "
                "is model.model the checkpoint you meant, or is a pooler/hf_overrides setting changing its head?"
            )


def result_spec(config: RunConfig, head: Any = None, choice_token_ids: Sequence[int] | None = None) -> Columns:
    """The result columns of a run: its task's, for the model's ``head`` (``heads.Head``; without it
    only the column names are known)."""
    return config.kind.columns(config, head, choice_token_ids)


def choice_first_tokens(tokenizer: Any, choices: list[str]) -> list[int]:
    """The first token of each label as the model would start its answer with it.

    Raises:
        ConfigError: two labels start with the same token, so their
            first-token probabilities cannot tell them apart.
    """
    firsts = []
    for c in choices:
        ids = tokenizer.encode(c, add_special_tokens=False)
        firsts.append(ids[0])
    seen: dict[int, str] = {}
    for c, t in zip(choices, firsts, strict=True):
        if t in seen:
            raise ConfigError(
                f"output.choice_probs: the labels {seen[t]!r} and {c!r} start with the same token, so their "
                "probabilities cannot be told apart; reword one (e.g. 'A: ...', 'B: ...')"
            )
        seen[t] = c
    return firsts
