"""Results out (``output.format: openai_batch``): a request's rows as its result or error line, its
log-probabilities in OpenAI's shape, and the files (an output format, registered with formats)."""

from __future__ import annotations

import datetime
import hashlib
import itertools
import json
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from shardgen.base.io import replace_dir
from shardgen.data import formats
from shardgen.errors import ShardgenError

if TYPE_CHECKING:
    pass

from shardgen.features.openai_batch.api import (
    COMPLETIONS,
    EMBEDDINGS,
    ERRORS,
    FINISH_REASONS,
    OUTPUT,
    PROVENANCE,
    RERANK,
    SCORE,
    URLS,
)


def custom_id(row: dict[str, Any], id_column: str | None) -> str:
    return str(row[id_column]) if id_column else str(row["row_index"])


def requests(rows: Iterable[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
    """The output rows grouped by request: consecutive rows of one ``row_index`` (one per sample with
    ``output.samples: rows``), or of one score or rerank request (a row per pair, ``pair_index`` 0, 1, ...)."""
    group: list[dict[str, Any]] = []
    for row in rows:
        if group and not _same_request(group[-1], row):
            yield group
            group = []
        group.append(row)
    if group:
        yield group


def _same_request(before: dict[str, Any], row: dict[str, Any]) -> bool:
    if row["row_index"] == before["row_index"]:
        return True
    pair = row.get("pair_index")
    return bool(pair) and row.get("url") in SCORE + RERANK and row.get("custom_id") == before.get("custom_id")


def _samples(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One dict per sample, whatever the layout: a row per sample, or one row of list columns."""
    first = rows[0]
    if len(rows) == 1 and isinstance(first.get("generation"), list):
        keys = ("generation", "finish_reason", "generated_tokens")
        keys += tuple(k for k in ("reasoning", "reasoning_tokens", "logprobs") if k in first)
        return [dict(zip(keys, values, strict=True)) for values in zip(*(first[k] for k in keys), strict=True)]
    return rows


def result_line(
    rows: list[dict[str, Any]],
    task: str,
    model: str,
    created: int,
    id_column: str | None,
    top_logprobs: int | None = None,
) -> dict:
    """The result line of one request (its output rows); ``response.status_code`` 400 for an error line.

    Args:
        top_logprobs: how many of the most likely tokens the request asked for at each position
            (``rowsampling.logprobs_of``); its ``logprobs`` column holds them beside the sampled token.
    """
    first = rows[0]
    index = first["row_index"]
    line = {"id": f"batch_req_{index}", "custom_id": custom_id(first, id_column), "error": None}
    prompt_tokens = first.get("prompt_tokens") or 0
    error = first.get("error")
    body: dict[str, Any]
    if task == "score":
        if any(r.get("score") is None for r in rows):
            error = next((r["error"] for r in rows if r.get("error")), None)
            return _error(line, index, error or "no_score: the pair got no score")
        body = _score_body(rows, index, model, created)
    elif URLS[task] == EMBEDDINGS:
        if first.get("embedding") is None:
            return _error(line, index, error or "no_embedding: the row got no embedding")
        body = {
            "object": "list",
            "data": [{"object": "embedding", "index": 0, "embedding": list(first["embedding"])}],
            "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        }
    else:
        # a rollout's row (its `turns`; `messages` alone is a chat request's input): its last assistant message
        samples = _samples(rows) if first.get("turns") is None else [_last_turn(first)]
        if any(s.get("generation") is None and not s.get("tool_calls") for s in samples):
            return _error(line, index, error or "no_generation: the row got no generation")
        unfinished = [s["finish_reason"] for s in samples if s.get("finish_reason") not in FINISH_REASONS]
        if unfinished:
            return _error(line, index, f"unfinished: the generation ended with finish_reason {unfinished[0]!r}")
        completion = sum(s.get("generated_tokens") or 0 for s in samples)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                 "total_tokens": prompt_tokens + completion}  # fmt: skip
        if first.get("url") == COMPLETIONS:  # a completion request (input.openai_batch) gets a completion
            body = {
                "id": f"cmpl-{index}",
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": i,
                        "text": s["generation"],
                        "finish_reason": s["finish_reason"],
                        "logprobs": _completion_logprobs(s.get("logprobs"), top_logprobs),
                    }
                    for i, s in enumerate(samples)
                ],
                "usage": usage,
            }
            return {**line, "response": {"status_code": 200, "request_id": f"req_{index}", "body": body}}
        # a reasoning model's trace, as vLLM's server gives it (vllm/entrypoints/openai/chat_completion/
        # protocol.py: ChatMessage.reasoning; serving.py: completion_tokens_details.reasoning_tokens)
        reasons = "reasoning_tokens" in first
        body = {
            "id": f"chatcmpl-{index}",
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": s["generation"], "refusal": None}
                    | ({"reasoning": s.get("reasoning")} if reasons else {})
                    | ({"tool_calls": s["tool_calls"]} if s.get("tool_calls") else {}),
                    "finish_reason": s["finish_reason"],
                    "logprobs": _chat_logprobs(s.get("logprobs"), top_logprobs),
                }
                for i, s in enumerate(samples)
            ],
            "usage": usage
            | (
                {
                    "completion_tokens_details": {
                        "reasoning_tokens": sum(s.get("reasoning_tokens") or 0 for s in samples)
                    }
                }
                if reasons
                else {}
            ),
        }
    return {**line, "response": {"status_code": 200, "request_id": f"req_{index}", "body": body}}


def _last_turn(row: dict[str, Any]) -> dict[str, Any]:
    """A rollout's row (``messages``) as the one sample its response holds: the last assistant message,
    with its tool calls when the conversation ended at max_turns on a call (``finish_reason``
    ``tool_calls``, as OpenAI ends a message that calls tools)."""
    last = next(m for m in reversed(json.loads(row["messages"])) if m["role"] == "assistant")
    calls = last.get("tool_calls") or None
    return {**row, "generation": last.get("content"), "tool_calls": calls,
            "finish_reason": "tool_calls" if calls else row["finish_reason"]}  # fmt: skip


def _score_body(rows: list[dict[str, Any]], index: int, model: str, created: int) -> dict[str, Any]:
    """vLLM's ``ScoreResponse`` (a score per pair, in the request's order) or, for a rerank request,
    its ``RerankResponse`` (the documents by relevance, most relevant first, the first ``top_n``), as
    vLLM's server makes them (vllm/entrypoints/pooling/scoring/serving.py); the usage is the pairs'
    prompt tokens."""
    tokens = sum(r.get("prompt_tokens") or 0 for r in rows)
    if rows[0].get("url") not in RERANK:
        return {
            "id": f"score-{index}",
            "object": "list",
            "created": created,
            "model": model,
            "data": [{"index": i, "object": "score", "score": r["score"]} for i, r in enumerate(rows)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                      "prompt_tokens_details": None, "completion_tokens_details": None},  # vLLM's UsageInfo
        }  # fmt: skip
    results = [{"index": r["pair_index"], "document": {"text": r["pair"], "multi_modal": None},
                "relevance_score": r["score"]} for r in rows]  # fmt: skip
    results.sort(key=lambda x: x["relevance_score"], reverse=True)  # stable: ties keep the documents' order
    top_n = json.loads(rows[0]["body"]).get("top_n", 0) if rows[0].get("body") else 0
    return {
        "id": f"rerank-{index}",
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "results": results[:top_n] if top_n else results,
    }


# -- Log-probabilities (results.LOGPROB_TYPE: per position the sampled token, then the top-k) ---------


def _token(entry: dict[str, Any]) -> str:
    # a token vLLM could not decode alone is named as its server names it
    return entry["token"] if entry["token"] is not None else f"token_id:{entry['token_id']}"


def _logprob(entry: dict[str, Any]) -> float:
    return max(entry["logprob"], -9999.0)  # as vLLM's server: JSON has no -inf


def _top(position: list[dict[str, Any]], k: int | None) -> list[dict[str, Any]]:
    """The k most likely tokens of a position (the sampled one is among them only if it is one)."""
    return sorted(position, key=lambda e: -e["logprob"])[: k or 0]


def _chat_logprobs(positions: list[list[dict[str, Any]]] | None, k: int | None) -> dict[str, Any] | None:
    """OpenAI's ``ChoiceLogprobs``: per generated token, it and its k most likely alternatives."""
    if positions is None:
        return None

    def entry(e: dict[str, Any]) -> dict[str, Any]:
        token = _token(e)
        return {"token": token, "logprob": _logprob(e), "bytes": list(token.encode("utf-8", errors="replace"))}

    content = [{**entry(p[0]), "top_logprobs": [entry(e) for e in _top(p, k)]} for p in positions]
    return {"content": content, "refusal": None}


def _completion_logprobs(positions: list[list[dict[str, Any]]] | None, k: int | None) -> dict[str, Any] | None:
    """OpenAI's completions ``Logprobs``: the tokens, their log-probabilities, the k most likely at each
    position, and where each token starts in the text."""
    if positions is None:
        return None
    tokens = [_token(p[0]) for p in positions]
    return {
        "tokens": tokens,
        "token_logprobs": [_logprob(p[0]) for p in positions],
        "top_logprobs": [{_token(e): _logprob(e) for e in _top(p, k)} for p in positions],
        "text_offset": list(itertools.accumulate((len(t) for t in tokens), initial=0))[: len(tokens)],
    }


def _error(line: dict[str, Any], index: int, message: str) -> dict[str, Any]:
    code = message.split(":", 1)[0].split()[0] if message else "error"
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
    return {**line, "response": {"status_code": 400, "request_id": f"req_{index}", "body": body}}


# -- The output: OpenAI's result and error files (an output format, registered with formats) --------------


def write_results(
    path: Path,
    batches: formats.Batches,
    provenance: dict,
    id_column: str | None,
    top_logprobs: Callable[[dict[str, Any]], int | None],
) -> None:
    """OpenAI's result and error files, and the provenance naming their digests, in a directory
    written beside ``path`` and swapped into place."""
    task, model = provenance["task"], provenance["model"]
    created = int(datetime.datetime.fromisoformat(provenance["created"]).timestamp())
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.name}.") as tmp:
        out = Path(tmp) / "out"
        out.mkdir()
        digests = {OUTPUT: hashlib.sha256(), ERRORS: hashlib.sha256()}
        with open(out / OUTPUT, "wb") as ok, open(out / ERRORS, "wb") as failed:
            rows = (row for _, batch in batches for row in batch.to_pylist())
            for request in requests(rows):
                line = result_line(request, task, model, created, id_column, top_logprobs(request[0]))
                name, f = (OUTPUT, ok) if line["response"]["status_code"] == 200 else (ERRORS, failed)
                data = (json.dumps(line, ensure_ascii=False, default=formats.json_default) + "\n").encode()
                f.write(data)
                digests[name].update(data)
        sums = {f"{name}_sha256": d.hexdigest() for name, d in digests.items()}
        (out / PROVENANCE).write_text(json.dumps({**provenance, **sums}, indent=1) + "\n")
        replace_dir(out, path)


def results_provenance(path: Path) -> dict[str, Any]:
    """The provenance beside the result files, checked against the files it names.

    Raises:
        ShardgenError: it describes other files than those there.
    """
    prov = json.loads((path / PROVENANCE).read_text())
    for name in (OUTPUT, ERRORS):
        if prov.get(f"{name}_sha256") != formats.file_sha256(path / name):
            raise ShardgenError(
                f"'{path}/{PROVENANCE}' describes another '{name}' than the one there; run the "
                "workflow again, which merges again"
            )
    return prov


def results_usage(path: Path, batch_size: int) -> tuple[list[str], formats.ColumnReader]:
    """The results' usage as columns: a request's prompt tokens, and its samples' generated ones summed."""
    names = ["prompt_tokens", "generated_tokens"]

    def usage_batches(columns: list[str]) -> Iterator[pa.RecordBatch]:
        key = {"prompt_tokens": "prompt_tokens", "generated_tokens": "completion_tokens"}
        for batch in formats.jsonl_batches(path / OUTPUT, ["response"], batch_size):
            usage = [r["body"]["usage"] for r in batch.column("response").to_pylist()]
            yield pa.RecordBatch.from_arrays([pa.array([u.get(key[c]) for u in usage]) for c in columns], columns)

    return names, usage_batches


# output.format openai_batch: <dir>/openai/, told by its result file
formats.register("openai_batch", formats.OutputFormat(
    write=write_results, holds=lambda path: (path / OUTPUT).exists(), provenance=results_provenance,
    read_columns=results_usage,
))  # fmt: skip
