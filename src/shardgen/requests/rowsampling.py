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
- ``n``: the row's number of samples. It changes the rows an input row
  gives where samples are rows (``output.samples: rows``, whose count the
  exactly-once checks take from the run's ``n``), so there a row may only
  repeat the run's; with ``output.samples: list`` (one output row per input
  row, whatever its samples) any ``n`` >= 1;
- ``logprobs`` and ``top_logprobs``: OpenAI's chat pair (``logprobs: true``
  and ``top_logprobs: k``, 0 to 20; an absent ``top_logprobs`` keeps the run's
  ``sampling.logprobs``, else 0), or an integer ``logprobs: k`` (vLLM's, and
  OpenAI's completions); ``logprobs: false`` drops them. The row's
  ``logprobs`` column holds them (null for a row without);
- ``user``, ``metadata``, ``store``, ``stream``, ``model`` change no result and
  are ignored (``model``: the run serves one).

Anything else, or a value vLLM refuses (a negative ``max_tokens``, a
``temperature`` that is not a number), is the row's error
(``invalid_sampling``), naming the column and field; the other rows run.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
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
MAX_TOP_LOGPROBS = 20  # OpenAI's bound, and vLLM's default max_logprobs
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


def row_sampling(
    run: Mapping[str, Any], given: Mapping[str, Any], column: str, *, own_n: bool = False
) -> dict[str, Any]:
    """The sampling of one row: the run's ``sampling`` (vLLM's names) with the row's fields in.

    Args:
        own_n: whether the row may have its own ``n`` (``output.samples: list``).

    Raises:
        RowError: a field the row may not set, or a value the run decides.
    """
    out = dict(run)
    if "logprobs" in given or "top_logprobs" in given:
        out["logprobs"] = _logprobs(run, given, column)
    for field, value in given.items():
        if field in IGNORED or field in ("logprobs", "top_logprobs"):
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
        elif field == "n":
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise RowError(REASON, f"{column}.n: an integer of at least 1, not {value!r}")
            if value != run.get("n", 1) and not own_n:
                raise RowError(
                    REASON,
                    f"{column}.n: {value}, but the run's is {run.get('n', 1)}: with output.samples rows it decides "
                    "how many rows each input row gives, so a row's own n needs output.samples: list",
                )
            out["n"] = value
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


def _logprobs(run: Mapping[str, Any], given: Mapping[str, Any], column: str) -> int | None:
    """vLLM's ``logprobs`` (how many top tokens besides the sampled one; None: none) of a row that
    sets OpenAI's ``logprobs`` or ``top_logprobs``."""
    asked, top = given.get("logprobs"), given.get("top_logprobs")
    if top is not None:
        _check_count(f"{column}.top_logprobs", top)
    if asked is None:
        asked = run.get("logprobs") is not None
    if asked is False:
        if top is not None:
            raise RowError(REASON, f"{column}.top_logprobs: needs logprobs true")
        return None
    if asked is True:
        return top if top is not None else (run.get("logprobs") or 0)
    _check_count(f"{column}.logprobs", asked)  # an integer: vLLM's, and OpenAI's completions
    if top is not None:
        raise RowError(REASON, f"{column}.top_logprobs: with logprobs true, not with logprobs {asked}")
    return asked


def _check_count(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise RowError(REASON, f"{name}: true, false or an integer from 0 to {MAX_TOP_LOGPROBS}, not {value!r}")


def row_logprobs(run: Mapping[str, Any], value: Any, column: str | None) -> int | None:
    """How many top tokens a row's ``logprobs`` column holds at each position besides the sampled one
    (vLLM's ``logprobs``; None: the row asked for none, or its sampling is not valid)."""
    if not column or value is None:
        return run.get("logprobs")
    try:
        return row_sampling(run, overrides(value, column), column, own_n=True).get("logprobs")
    except RowError:
        return None


def logprobs_of(sampling: Any, sampling_column: str | None) -> Callable[[dict[str, Any]], int | None]:
    """How many top tokens each request asked for (``top_logprobs``), from its row: the run's
    ``sampling.logprobs``, or the row's own (``input.sampling_column``)."""
    return lambda row: row_logprobs(sampling, row.get(sampling_column) if sampling_column else None, sampling_column)


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


def sampling_params(
    run: Mapping[str, Any],
    value: Any,
    column: str,
    choice_token_ids: list[int] | None = None,
    *,
    own_n: bool = False,
    make: Callable[[Mapping[str, Any], list[int] | None], Any],
):
    """The sampling parameters of a row whose ``column`` holds ``value``, and the row's own seed (None:
    the run's rule). Built anew by the engine kind's ``make`` (vLLM's ``SamplingParams`` in process), so
    that what vLLM derives from a field (the stop strings' buffer) follows the row's value, and checked
    by the engine's own checks.

    Args:
        choice_token_ids: ``output.choice_probs``' tokens, which take the log-probabilities.
        own_n: whether the row may have its own ``n`` (``output.samples: list``).
        make: the engine kind's ``sampling_params`` (``engine.Engine.sampling_params``).

    Raises:
        RowError: naming the column and field.
    """
    given = overrides(value, column)
    sampling = row_sampling(run, given, column, own_n=own_n)
    if choice_token_ids and sampling.get("logprobs") is not None:
        raise RowError(REASON, f"{column}.logprobs: output.choice_probs takes the log-probabilities of this run")
    seed = given.get("seed")
    try:
        return make(sampling, choice_token_ids), seed
    except (ValueError, TypeError) as e:  # the engine's own checks (vLLM's: SamplingParams._verify_args)
        raise RowError(REASON, f"{column}: {e}") from None
