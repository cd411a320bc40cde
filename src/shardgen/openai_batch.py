"""OpenAI's Batch API result format (``output.format: openai_batch``): the merged rows as the two files
a batch of requests gives back, so that code written for a hosted batch API reads a shardgen run.

``<dir>/openai/`` holds:

- ``output.jsonl``: a line per request that got a result, in input order:
  ``{"id", "custom_id", "response": {"status_code": 200, "request_id", "body"}, "error": null}``,
  the body a chat completion (``task: generate``: a choice per sample, with
  its ``message``, ``finish_reason``, ``index`` and ``logprobs``; ``usage``
  with the prompt, completion and total tokens), a text completion for a
  ``/v1/completions`` request of ``input.openai_batch`` (``text`` for
  ``message``, OpenAI's completions ``logprobs``), or an embedding list
  (``task: embed``). A request that asked for log-probabilities (the run's
  ``sampling.logprobs``, or its own ``logprobs``/``top_logprobs``) gets them
  from the ``logprobs`` column: the sampled token of each position, and the
  ``top_logprobs`` most likely; the others get ``logprobs: null``;
- ``errors.jsonl``: a line per request that did not, in input order, with
  ``status_code`` 400 and an ``error`` body: shardgen's per-row error as the
  ``message``, its reason (the error's first word) as the ``code``;
- ``provenance.json``: the run's provenance and the SHA-256 of both files.

A request's ``custom_id`` is its ``input.id_column`` value, else its row
index. Ids are deterministic (``batch_req_<row>``, ``chatcmpl-<row>``), so a
rerun writes the same lines. The files' shape is what the ``openai``
package's types accept (``openai.types.chat.ChatCompletion``,
``openai.types.CreateEmbeddingResponse``), which the tests check.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterable, Iterator
from typing import Any

OUTPUT, ERRORS, PROVENANCE = "output.jsonl", "errors.jsonl", "provenance.json"
CHAT, COMPLETIONS, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
# the tasks OpenAI's batch format serves, and the url of each (generation without chat: COMPLETIONS)
URLS = {"generate": CHAT, "embed": EMBEDDINGS}
# the finish reasons a chat completion may have; vLLM's others ("abort") make the row an error line
FINISH_REASONS = frozenset({"stop", "length", "tool_calls", "content_filter", "function_call"})


def custom_id(row: dict[str, Any], id_column: str | None) -> str:
    return str(row[id_column]) if id_column else str(row["row_index"])


def requests(rows: Iterable[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
    """The output rows grouped by request: consecutive rows of one ``row_index`` (one per sample with
    ``output.samples: rows``)."""
    for _, group in itertools.groupby(rows, key=lambda r: r["row_index"]):
        yield list(group)


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
            (``logprobs_of``); its ``logprobs`` column holds them beside the sampled token.
    """
    first = rows[0]
    index = first["row_index"]
    line = {"id": f"batch_req_{index}", "custom_id": custom_id(first, id_column), "error": None}
    prompt_tokens = first.get("prompt_tokens") or 0
    error = first.get("error")
    body: dict[str, Any]
    if URLS[task] == EMBEDDINGS:
        if first.get("embedding") is None:
            return _error(line, index, error or "no_embedding: the row got no embedding")
        body = {
            "object": "list",
            "data": [{"object": "embedding", "index": 0, "embedding": list(first["embedding"])}],
            "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        }
    else:
        samples = _samples(rows)
        if any(s.get("generation") is None for s in samples):
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
                    | ({"reasoning": s.get("reasoning")} if reasons else {}),
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


# -- Log-probabilities (results.LOGPROB_TYPE: per position the sampled token, then the top-k) ---------


def logprobs_of(sampling: Any, sampling_column: str | None) -> Callable[[dict[str, Any]], int | None]:
    """How many top tokens each request asked for (``top_logprobs``), from its row: the run's
    ``sampling.logprobs``, or the row's own (``input.sampling_column``)."""
    from shardgen.rowsampling import row_logprobs

    return lambda row: row_logprobs(sampling, row.get(sampling_column) if sampling_column else None, sampling_column)


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


# -- Requests in (input.openai_batch) -----------------------------------------------------------------

# body fields a row's columns take; the rest is sampling (input.sampling_column: shardgen.rowsampling)
CONTENT_FIELDS = ("messages", "prompt", "input", "model")
# /v1/embeddings fields that change no result here
EMBEDDING_IGNORED = frozenset({"user", "encoding_format"})


def expected_url(task: str, chat: bool) -> str:
    """The request url a run serves: its task, and for generation whether prompts are chats."""
    return COMPLETIONS if URLS[task] == CHAT and not chat else URLS[task]


def scan_line(line: bytes, path: str, lineno: int) -> tuple[str, str | None]:
    """A request line's ``custom_id`` and ``body.model``, read when planning.

    Raises:
        InputError: the line is not a JSON object with a string ``custom_id``, naming the file and line.
    """
    from shardgen.errors import InputError

    try:
        request = json.loads(line)
    except ValueError as e:
        raise InputError(f"input: '{path}', line {lineno}: not JSON ({e})") from None
    if not isinstance(request, dict) or not isinstance(request.get("custom_id"), str) or not request["custom_id"]:
        raise InputError(f"input: '{path}', line {lineno}: a request needs a custom_id (a non-empty string)")
    body = request.get("body")
    model = body.get("model") if isinstance(body, dict) else None
    return request["custom_id"], model if isinstance(model, str) else None


def request_row(line: bytes) -> dict[str, Any]:
    """The row of one request line (``sources.BATCH_SCHEMA``): its custom id and url, the chat
    ``messages`` (text parts joined) or the text ``input`` (``input``, or a completion's ``prompt``),
    the sampling fields of its body as JSON (``body``), and what makes it invalid
    (``request_error``, naming the field), which makes it the row's error."""
    request = json.loads(line)
    body = request.get("body")
    row = {"custom_id": request["custom_id"], "url": request.get("url"), "messages": None, "input": None,
           "body": None, "request_error": None}  # fmt: skip
    try:
        if not isinstance(body, dict):
            raise ValueError("body: a JSON object")
        if row["url"] == CHAT:
            row["messages"] = _messages(body.get("messages"))
        elif row["url"] in (COMPLETIONS, EMBEDDINGS):
            key = "prompt" if row["url"] == COMPLETIONS else "input"
            if not isinstance(body.get(key), str):
                raise ValueError(f"body.{key}: one string per request")
            row["input"] = body[key]
        else:
            raise ValueError(f"url: {row['url']!r} is none of {CHAT}, {COMPLETIONS}, {EMBEDDINGS}")
        rest = {k: v for k, v in body.items() if k not in CONTENT_FIELDS}
        if row["url"] == EMBEDDINGS and (changes := sorted(set(rest) - EMBEDDING_IGNORED)):
            raise ValueError(f"body.{changes[0]}: not served for embeddings (it would change the result)")
        row["body"] = json.dumps(rest) if rest and row["url"] != EMBEDDINGS else None
    except ValueError as e:
        row["request_error"] = str(e)
    return row


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise ValueError("body.messages: a non-empty list of messages")
    out = []
    for i, m in enumerate(value):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise ValueError(f"body.messages[{i}].content: only text parts are served")
            content = "".join(str(p.get("text", "")) for p in content)
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(content, str):
            raise ValueError(f"body.messages[{i}]: a role and a text content")
        out.append({"role": m["role"], "content": content})
    return out
