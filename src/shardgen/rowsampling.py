"""Per-row sampling: a column whose value overrides the run's ``sampling`` for its row
(``input.sampling_column``), under OpenAI's request field names or vLLM's.

A row's value is a mapping (a struct column, or a JSON object in a string
column); null, or a null field, keeps the run's value. What a row may set:

- ``max_tokens`` (or ``max_completion_tokens``), ``temperature``, ``top_p``,
  ``seed``, ``stop``, ``presence_penalty``, ``frequency_penalty``: replace the
  run's value for that row (its ``seed`` replaces the seed shardgen derives
  from ``sampling.seed`` and the row's id);
- ``response_format``: OpenAI's ``{"type": "json_schema", "json_schema":
  {"schema": ...}}`` or ``{"type": "json_object"}`` constrain the row's text to
  JSON (``text`` changes nothing); only in a run whose config sets no
  ``structured_outputs``, whose columns (``label``, ``parsed``) are the run's;
- ``n``, ``logprobs`` and ``top_logprobs`` decide the output's rows and
  columns, which are the run's: a row may repeat the run's value, not change it;
- ``user``, ``metadata``, ``store``, ``stream``, ``model`` change no result and
  are ignored (``model``: the run serves one).

Anything else, or a value vLLM refuses (a negative ``max_tokens``, a
``temperature`` that is not a number), is the row's error
(``invalid_sampling``), naming the column and field; the other rows run.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from shardgen.errors import RowError

# OpenAI's name -> the sampling key (vLLM's name) a row's value replaces
REPLACED = {
    "max_tokens": "max_tokens",
    "max_completion_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "seed": "seed",
    "stop": "stop",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}
# what each replaced value must be (vLLM checks ranges, not types: a string temperature would fail
# inside a comparison that names no field)
NUMBER, INTEGER = "a number", "an integer"
TYPES = {"max_tokens": INTEGER, "seed": INTEGER, "temperature": NUMBER, "top_p": NUMBER,
         "presence_penalty": NUMBER, "frequency_penalty": NUMBER}  # fmt: skip
FIXED = ("n", "logprobs", "top_logprobs")  # decide the output's rows and columns
IGNORED = frozenset({"user", "metadata", "store", "stream", "model"})
REASON = "invalid_sampling"


def overrides(value: Any, column: str) -> dict[str, Any]:
    """A row's sampling value as ``{field: value}`` without null fields (``{}`` for null).

    Raises:
        RowError: the value is not a mapping or a JSON object.
    """
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise RowError(REASON, f"{column}: not a JSON object ({e})") from None
    if isinstance(value, list) and all(isinstance(kv, tuple) and len(kv) == 2 for kv in value):
        value = dict(value)  # an Arrow map column
    if not isinstance(value, Mapping):
        raise RowError(REASON, f"{column}: a mapping of sampling fields, not {type(value).__name__}")
    return {k: v for k, v in value.items() if v is not None}


def row_sampling(run: Mapping[str, Any], given: Mapping[str, Any], column: str) -> dict[str, Any]:
    """The sampling of one row: the run's ``sampling`` (vLLM's names) with the row's fields in.

    Raises:
        RowError: a field the row may not set, or a value the run decides.
    """
    out = dict(run)
    for field, value in given.items():
        if field in IGNORED:
            continue
        if field in REPLACED:
            _check_type(field, REPLACED[field], value, column)
            out[REPLACED[field]] = value
        elif field == "response_format":
            out.pop("structured_outputs", None)
            if run.get("structured_outputs"):
                raise RowError(REASON, f"{column}.response_format: the run's sampling.structured_outputs decide it")
            if (structured := _structured(value, column)) is not None:
                out["structured_outputs"] = structured
        elif field in FIXED:
            if value != _run_value(run, field):
                raise RowError(
                    REASON,
                    f"{column}.{field}: {value!r}, but the run's is {_run_value(run, field)!r}: it decides the "
                    "output's rows and columns, so a row cannot change it",
                )
        else:
            raise RowError(REASON, f"{column}.{field}: not a sampling field shardgen passes on (it would change "
                           "the result, so the row is not run without it)")  # fmt: skip
    return out


def _check_type(field: str, key: str, value: Any, column: str) -> None:
    want = TYPES.get(key)
    if key == "stop":
        ok = isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value))
        want = "a string or a list of strings"
    elif want == INTEGER:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok:
        raise RowError(REASON, f"{column}.{field}: {want}, not {value!r}")


def _run_value(run: Mapping[str, Any], field: str) -> Any:
    """The run's value of an OpenAI field that decides the output's shape."""
    if field == "n":
        return run.get("n", 1)
    if field == "logprobs":  # OpenAI: a bool; vLLM: how many
        return run.get("logprobs") is not None
    return run.get("logprobs")  # top_logprobs


def _structured(value: Any, column: str) -> dict[str, Any] | None:
    """vLLM's ``structured_outputs`` for OpenAI's ``response_format``."""
    kind = value.get("type") if isinstance(value, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema" and isinstance(value.get("json_schema"), Mapping) and "schema" in value["json_schema"]:
        return {"json": value["json_schema"]["schema"]}
    raise RowError(REASON, f"{column}.response_format: type text, json_object or json_schema (with a schema)")


def sampling_params(run: Mapping[str, Any], value: Any, column: str, choice_token_ids: list[int] | None = None):
    """vLLM's ``SamplingParams`` of a row whose ``column`` holds ``value``, and the row's own seed (None:
    the run's rule). Built anew, so that what vLLM derives from a field (the stop strings' buffer)
    follows the row's value, and checked by vLLM itself.

    Raises:
        RowError: naming the column and field.
    """
    from vllm.exceptions import VLLMValidationError

    from shardgen.engine import make_sampling_params

    given = overrides(value, column)
    sampling = row_sampling(run, given, column)
    seed = given.get("seed")
    try:
        return make_sampling_params(sampling, choice_token_ids), seed
    except (ValueError, TypeError, VLLMValidationError) as e:  # vLLM's own checks (SamplingParams._verify_args)
        raise RowError(REASON, f"{column}: {e}") from None
